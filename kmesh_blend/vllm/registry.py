"""Bounded registries of the scheduler side: what it believes is stored never grows without end.

An entry that falls out costs at most one more save (a forgotten segment is stored again by
its next reader) or one turn restored from segments instead of its record: never wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["LruDict", "LruSet"]

K = TypeVar("K")
V = TypeVar("V")


class LruDict(Generic[K, V]):
    """A dict of at most ``capacity`` entries; reads and writes make an entry the newest, the
    oldest goes first (``on_evict(key, value)`` is told)."""

    def __init__(self, capacity: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity, self.on_evict = capacity, on_evict
        self._items: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def __setitem__(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            old, gone = self._items.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old, gone)

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)


class LruSet(Generic[K]):
    """A set of at most ``capacity`` members; the least recently added or checked goes first."""

    def __init__(self, capacity: int) -> None:
        self._items: LruDict[K, None] = LruDict(capacity)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        if key not in self._items:
            return False
        self._items.get(key)  # type: ignore[arg-type]
        return True

    def add(self, key: K) -> None:
        self._items[key] = None

    def update(self, keys: Iterable[K]) -> None:
        for key in keys:
            self.add(key)

    def difference_update(self, keys: Iterable[K]) -> None:
        for key in keys:
            self._items.pop(key)
