"""External retention: restored masters stay in host RAM for their family's or round's lifetime.

`RetentionPool` holds objects (e.g. ``(kv, positions)`` pairs) under a byte budget. Objects can be
*pinned* by owners (a family name, ``"round:3"``, ...) and *acquired* while a reader copies from
them. Eviction is least-recently-used among objects that are neither pinned nor in use; a put that
cannot fit without dropping such an object is rejected (the caller still has its value; it is just
not retained). So ``retained_bytes`` never exceeds the budget and always equals the sum of the
live objects' sizes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["RetentionPool"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Slot(Generic[V]):
    value: V
    nbytes: int
    owners: set[str] = field(default_factory=set)
    refcount: int = 0


class RetentionPool(Generic[K, V]):
    """Byte-budgeted, pin-aware LRU pool of host-RAM objects. Thread-safe."""

    def __init__(
        self, budget_bytes: int, *, on_evict: Callable[[K, int], None] | None = None
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._on_evict = on_evict
        self._slots: OrderedDict[K, _Slot[V]] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.RLock()
        self._stats = {"hits": 0, "misses": 0, "puts": 0, "rejected": 0, "evictions": 0}
        self._stats["evicted_bytes"] = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def retained_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._slots)

    def stats(self) -> dict[str, int]:
        """hits, misses, puts, rejected, evictions, evicted_bytes, retained_bytes, num_objects."""
        with self._lock:
            return {**self._stats, "retained_bytes": self._bytes, "num_objects": len(self._slots)}

    def is_held(self, key: K) -> bool:
        """True if the object is pinned or in use (it cannot be evicted)."""
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and (slot.refcount > 0 or bool(slot.owners))

    # -- put / get ----------------------------------------------------------------------------

    def put(self, key: K, value: V, nbytes: int, *, owner: str | None = None) -> bool:
        """Retain ``value`` (``nbytes`` of host RAM), pinned by ``owner`` if given.

        If ``key`` is already retained, the existing object is kept (touched, pinned by
        ``owner``). Returns False if it does not fit without evicting a held object.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        evicted: list[tuple[K, int]] = []
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                self._slots.move_to_end(key)
                if owner is not None:
                    slot.owners.add(owner)
                return True
            if not self._make_room(nbytes, evicted):
                self._stats["rejected"] += 1
                ok = False
            else:
                new: _Slot[V] = _Slot(value, nbytes)
                if owner is not None:
                    new.owners.add(owner)
                self._slots[key] = new
                self._bytes += nbytes
                self._stats["puts"] += 1
                ok = True
        self._notify(evicted)
        return ok

    def get(self, key: K) -> V | None:
        """The retained object (and a hit), or ``None`` (and a miss)."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                self._stats["misses"] += 1
                return None
            self._stats["hits"] += 1
            self._slots.move_to_end(key)
            return slot.value

    def acquire(self, key: K) -> V | None:
        """`get` and mark in use until `release` (never evicted meanwhile)."""
        with self._lock:
            value = self.get(key)
            if value is not None:
                self._slots[key].refcount += 1
            return value

    def release(self, key: K) -> None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or slot.refcount <= 0:
                raise ValueError(f"release of {key!r} without acquire")
            slot.refcount -= 1

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, key: K, owner: str) -> bool:
        """Pin a retained object for ``owner``; False if it is not retained."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return False
            slot.owners.add(owner)
            return True

    def unpin(self, key: K, owner: str) -> None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                slot.owners.discard(owner)

    def release_owner(self, owner: str) -> int:
        """Drop every pin of ``owner`` (its family closed or its round ended); returns how many
        objects it pinned. The objects stay until the budget needs their room."""
        with self._lock:
            count = 0
            for slot in self._slots.values():
                if owner in slot.owners:
                    slot.owners.discard(owner)
                    count += 1
            return count

    def remove(self, key: K) -> bool:
        """Drop an object now unless it is in use (pins do not protect against removal)."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or slot.refcount > 0:
                return False
            del self._slots[key]
            self._bytes -= slot.nbytes
            return True

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget; evicts unheld objects until the pool fits (if it can)."""
        evicted: list[tuple[K, int]] = []
        with self._lock:
            self.budget_bytes = budget_bytes
            self._make_room(0, evicted)
        self._notify(evicted)

    # -- helpers -------------------------------------------------------------------------------

    def _make_room(self, nbytes: int, evicted: list[tuple[K, int]]) -> bool:
        need = self._bytes + nbytes - self.budget_bytes
        if need <= 0:
            return True
        victims = []
        freed = 0
        for key, slot in self._slots.items():
            if freed >= need:
                break
            if slot.refcount == 0 and not slot.owners:
                victims.append(key)
                freed += slot.nbytes
        if freed < need:
            return False
        for key in victims:
            slot = self._slots.pop(key)
            self._bytes -= slot.nbytes
            self._stats["evictions"] += 1
            self._stats["evicted_bytes"] += slot.nbytes
            evicted.append((key, slot.nbytes))
        return True

    def _notify(self, evicted: list[tuple[K, int]]) -> None:
        if self._on_evict is not None:
            for key, nbytes in evicted:
                self._on_evict(key, nbytes)
