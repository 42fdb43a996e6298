"""The disk tier: artifact payloads as files in one directory, under a byte budget.

The byte accounting and least-recently-used eviction are `RetentionPool`'s (the same pool that
keeps masters in host RAM), here holding file paths and charged each file's *size on disk*; an
evicted entry's file is deleted. So the bytes in the directory never exceed the budget.

File format: ``numpy.savez`` (no pickle): ``bytes=`` uint8 for a byte payload, ``array=`` for an
array, ``item0``, ``item1``, ... for a tuple of arrays. A file is written under a temporary name
and renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kmesh_blend.artifacts.errors import ArtifactInputError
from kmesh_blend.artifacts.objects import Payload, freeze
from kmesh_blend.segments.retention import RetentionPool

__all__ = ["DiskTier"]


class DiskTier:
    """Byte-budgeted LRU directory of payload files. Thread-safe.

    ``root=None`` makes a private temporary directory, deleted by `close`.
    """

    def __init__(self, budget_bytes: int, root: str | Path | None = None) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ArtifactInputError(f"disk_bytes must be an int >= 0, got {budget_bytes!r}")
        self._owned = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kmesh-artifacts-") if root is None else root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._paths: dict[str, Path] = {}
        self._lock = threading.RLock()
        self._serial = itertools.count()
        self._pool: RetentionPool[str, Path] = RetentionPool(budget_bytes, on_evict=self._unlink)
        self.num_writes = 0
        self.num_reads = 0

    @property
    def budget_bytes(self) -> int:
        return self._pool.budget_bytes

    @property
    def used_bytes(self) -> int:
        """Sum of the sizes of the files this tier holds."""
        return self._pool.retained_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._pool

    def __len__(self) -> int:
        return len(self._pool)

    def put(self, key: str, payload: Payload) -> bool:
        """Write ``payload`` under ``key``; False if it does not fit in the budget (nothing is
        left on disk then). A key already stored is kept as it is (payloads are immutable)."""
        if self._pool.budget_bytes == 0:
            return False
        with self._lock:
            if key in self._pool:
                self._pool.get(key)  # touch
                return True
            path = self.root / f"{_stem(key)}-{next(self._serial)}.npz"
            tmp = path.with_suffix(".tmp")
            savez: Any = np.savez  # (file, **arrays): numpy's stubs type the kwargs too narrowly
            with open(tmp, "wb") as f:
                savez(f, **_arrays(payload))
            size = tmp.stat().st_size
            if not self._pool.put(key, path, size):
                tmp.unlink()
                return False
            os.replace(tmp, path)
            self._paths[key] = path
            self.num_writes += 1
            return True

    def get(self, key: str) -> Payload | None:
        """The stored payload (frozen), or None if this tier does not hold ``key``."""
        with self._lock:
            path = self._pool.get(key)
        if path is None:
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                payload = _decode({name: data[name] for name in data.files})
        except FileNotFoundError:  # evicted between the lookup and the read
            return None
        with self._lock:
            self.num_reads += 1
        return payload

    def remove(self, key: str) -> int:
        """Delete ``key``'s file now; returns the bytes freed (0 if absent)."""
        with self._lock:
            path = self._paths.get(key)
            if path is None:
                return 0
            size = self._size(key)
            if self._pool.remove(key):
                self._paths.pop(key, None)
                path.unlink(missing_ok=True)
                return size
            return 0

    def stats(self) -> dict[str, int]:
        """RetentionPool counters (hits, misses, evictions, ...) plus reads and writes."""
        out = self._pool.stats()
        out.update(reads=self.num_reads, writes=self.num_writes, budget_bytes=self.budget_bytes)
        return out

    def close(self) -> None:
        """Delete every file (and the directory if this tier made it)."""
        with self._lock:
            for key in list(self._paths):
                self.remove(key)
            if self._owned:
                shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------------

    def _size(self, key: str) -> int:
        path = self._paths.get(key)
        try:
            return path.stat().st_size if path is not None else 0
        except FileNotFoundError:
            return 0

    def _unlink(self, key: str, nbytes: int) -> None:
        # Called by the pool while put() holds self._lock: the path is still the evicted one.
        path = self._paths.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)


def _stem(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _arrays(payload: Payload) -> dict[str, np.ndarray]:
    if isinstance(payload, bytes):
        return {"bytes": np.frombuffer(payload, dtype=np.uint8)}
    if isinstance(payload, np.ndarray):
        return {"array": payload}
    return {f"item{i}": a for i, a in enumerate(payload)}


def _decode(arrays: dict[str, np.ndarray]) -> Payload:
    if "bytes" in arrays:
        return arrays["bytes"].tobytes()
    if "array" in arrays:
        return freeze(arrays["array"], copy=False)
    items = [arrays[f"item{i}"] for i in range(len(arrays))]
    return freeze(tuple(items), copy=False)
