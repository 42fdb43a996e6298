"""Family pins in host RAM, capped: what a family keeps for its later children.

`PinLedger` pins objects of a `RetentionPool` for families and keeps the pinned bytes within a
cap (a share of the pool's budget). A pin that would pass the cap is not taken: the object stays
in the pool as an ordinary LRU entry. So family retention can never hold all of host RAM: the
rest stays for children's copies and for unrelated requests. Pins are released per family when
it closes (`unpin_family`) or, oldest first, when a child's copy needs the room (`unpin_oldest`).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from kmesh_blend.segments.retention import RetentionPool

__all__ = ["PinLedger"]

K = TypeVar("K", bound=Hashable)


class PinLedger(Generic[K]):
    """Capped family pins over one pool. Thread-safe."""

    def __init__(self, pool: RetentionPool[K, Any], limit_bytes: int) -> None:
        self.pool = pool
        self.limit_bytes = limit_bytes
        self._pins: dict[K, tuple[set[str], int]] = {}  # oldest first: key -> (families, nbytes)
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        return self._bytes

    def pin(self, key: K, family: str, nbytes: int) -> bool:
        """Pin ``key`` (``nbytes``, if retained) for ``family`` unless that passes the cap; an
        object already pinned by another family is shared (no new bytes)."""
        with self._lock:
            held = self._pins.get(key)
            if held is not None:
                if self.pool.pin(key, family):
                    held[0].add(family)
                    return True
                return False
            if self._bytes + nbytes > self.limit_bytes or not self.pool.pin(key, family):
                return False
            self._pins[key] = ({family}, nbytes)
            self._bytes += nbytes
            return True

    def unpin_family(self, family: str) -> None:
        """Drop every pin of ``family`` (in the ledger and the pool)."""
        with self._lock:
            for key, (families, size) in list(self._pins.items()):
                if family in families:
                    families.discard(family)
                    self.pool.unpin(key, family)
                    if not families:
                        del self._pins[key]
                        self._bytes -= size

    def unpin_oldest(self) -> bool:
        """Unpin the oldest pinned object for all its families; False if nothing is pinned."""
        with self._lock:
            if not self._pins:
                return False
            key = next(iter(self._pins))
            families, size = self._pins.pop(key)
            self._bytes -= size
            for family in families:
                self.pool.unpin(key, family)
            return True

    def forget(self, key: K) -> None:
        """The object left the pool (deleted): drop its pins from the ledger."""
        with self._lock:
            pin = self._pins.pop(key, None)
            if pin is not None:
                self._bytes -= pin[1]
