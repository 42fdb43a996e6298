"""Master storage through LMCache: the narrow interface the blend uses.

    store = open_store("redis://127.0.0.1:6379", MasterLayout(24, 2, 64, "bfloat16"))
    store.put(segment_id, kv, positions)        # kv [L, 2, T, Hkv, D], positions [T] int64
    master = store.get(segment_id)               # Master(kv, positions) | None

Every get is one *read from the backing tier* (counted by the caller, `SegmentCache`). A get
returns ``None`` — never doubtful KV — when the segment is absent, its metadata is malformed, or
the KV's shape, dtype or checksum disagree with the metadata. Each call is serialised by a lock
(LMCache's ``lm://`` client shares one socket).

Faults (`kmesh_blend.segments.health`): every operation on the tier has a deadline. A tier that
fails or misses one is *down*: `get` and `contains` then raise `StoreUnavailable` at once (its
message names the ``kmesh.store`` address and why), `put` returns False with that reason in
``last_error``, deletes return False, until a background probe finds the tier answering. A store
unreachable at start is down from the start, the same way for every kind.

What is written in LMCache and why: see `kmesh_blend.segments.master` (layout, metadata
object) and `kmesh_blend.segments.lmcache_tiers` (which LMCache classes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch

from kmesh_blend.config import StoreSpec, parse_store
from kmesh_blend.segments.health import Health, StoreUnavailable
from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.lmcache_tiers import LMCacheTier, make_key
from kmesh_blend.segments.master import (
    Master,
    MasterLayout,
    MasterMeta,
    MasterStore,
    kv_checksum,
)

__all__ = ["LMCacheMasterStore", "MasterStore", "StoreUnavailable", "open_store"]

log = logging.getLogger(__name__)

_KV_PREFIX = "kmesh"
_META_PREFIX = "kmesh-meta"
_BLOB_PREFIX = "kmesh-blob"
_MAX_REJECTED = 1024
_PROBE_ID = "0" * 32  # never written: a probe only asks whether the tier answers


class LMCacheMasterStore:
    """`MasterStore` on one LMCache backend (host RAM, disk, ``lm://`` or ``redis://``)."""

    def __init__(
        self,
        spec: StoreSpec,
        layout: MasterLayout,
        *,
        cpu_bytes: int = 1 << 30,
        timeout_s: float = 0.5,
    ) -> None:
        self.tier: str = spec.kind
        self.layout = layout
        self._dtype = layout.torch_dtype()
        self.health = Health(spec.address, timeout_s, self._probe)
        self._backend = LMCacheTier(
            spec, layout, cpu_bytes=cpu_bytes, deadline=self.health.deadline
        )
        self._lock = threading.Lock()
        self.num_corrupt = 0
        self._rejected: dict[SegmentId, str] = {}  # recent rejections: id → why (bounded)
        self.last_error = ""  # why the last refused `put` was refused, in words
        try:  # one behaviour for every kind: a store that does not answer now is down
            self._probe()
        except Exception as exc:
            self.health.failed(_why(exc))

    def _io(self, op: Any, *args: Any) -> Any:
        """``op(*args)`` on the tier (lock held); a fault marks the store down."""
        try:
            return op(*args)
        except Exception as exc:
            raise self.health.failed(_why(exc)) from None

    def _probe(self) -> None:
        with self._lock:
            obj = self._backend.get(self._key(_META_PREFIX, _PROBE_ID, torch.uint8))
            if obj is not None:
                obj.ref_count_down()

    def _key(self, prefix: str, object_id: str, dtype: torch.dtype) -> Any:
        return make_key(prefix, object_id, dtype, self.layout.rank, self.layout.world_size)

    def put(self, segment_id: SegmentId, kv: torch.Tensor, positions: torch.Tensor) -> bool:
        master = Master(kv, positions)
        master.check(self.layout)
        L, _, T, H, D = kv.shape
        meta = MasterMeta(
            T, tuple(kv.shape), self.layout.dtype, kv_checksum(kv), tuple(positions.tolist())
        ).sealed(segment_id)
        blob = meta.encode()
        try:
            self.health.check()
        except StoreUnavailable as exc:
            self.last_error = str(exc)
            return False
        with self._lock:
            kv_obj = self._backend.allocate((2, L, T, H * D), self._dtype)
            meta_obj = self._backend.allocate((1, 1, 1, len(blob)), torch.uint8)
            try:
                if kv_obj is None or meta_obj is None:
                    self.last_error = f"no room for {master.nbytes} bytes in its host-RAM pool"
                    log.warning("kmesh store %s: %s", self.tier, self.last_error)
                    return False
                # [L, 2, T, Hkv, D] -> LMCache's KV_2LTD [2, L, T, Hkv*D] (one strided copy)
                kv_obj.tensor.copy_(kv.permute(1, 0, 2, 3, 4).reshape(2, L, T, H * D))
                meta_obj.tensor.view(-1).copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
                put = self._backend.put
                self._io(put, self._key(_KV_PREFIX, segment_id, self._dtype), kv_obj)
                # metadata last: it marks the master complete
                self._io(put, self._key(_META_PREFIX, segment_id, torch.uint8), meta_obj)
                return True
            except StoreUnavailable as exc:  # no reuse, no crash; the outage was logged once
                self.last_error = str(exc)
                return False
            finally:
                for obj in (kv_obj, meta_obj):
                    if obj is not None:
                        obj.ref_count_down()

    def get(self, segment_id: SegmentId) -> Master | None:
        """The master, or None (absent, or rejected: `rejected` says why); raises
        `StoreUnavailable` while the tier is down."""
        self.health.check()
        with self._lock:
            self._rejected.pop(segment_id, None)
            return self._get_locked(segment_id)

    def rejected(self, segment_id: SegmentId) -> str | None:
        """Why the last `get` of ``segment_id`` refused its master (integrity), else None."""
        return self._rejected.get(segment_id)

    def contains(self, segment_id: SegmentId) -> bool:
        """Whether the metadata object exists (a cheap check; `get` still verifies); raises
        `StoreUnavailable` while the tier is down."""
        self.health.check()
        with self._lock:
            obj = self._io(self._backend.get, self._key(_META_PREFIX, segment_id, torch.uint8))
            if obj is None:
                return False
            obj.ref_count_down()
            return True

    def delete(self, segment_id: SegmentId) -> bool:
        try:
            self.health.check()
            with self._lock:
                gone = self._io(
                    self._backend.remove, self._key(_META_PREFIX, segment_id, torch.uint8)
                )
                self._io(self._backend.remove, self._key(_KV_PREFIX, segment_id, self._dtype))
                return bool(gone)
        except StoreUnavailable:
            return False

    def close(self) -> None:
        self.health.close()
        with self._lock:
            self._backend.close()

    # -- opaque objects (mirrors; `kmesh_blend.mirror.lifecycle`) ------------------------------

    def put_blob(self, object_id: SegmentId, blob: bytes) -> bool:
        """Store opaque bytes under ``object_id`` (a uint8 LMCache object under its own key
        prefix, next to the masters); False if the tier refused. The bytes carry their own
        checksum: `get_blob` returns them unverified."""
        if not self.health.up:
            return False
        with self._lock:
            obj = self._backend.allocate((1, 1, 1, len(blob)), torch.uint8)
            try:
                if obj is None:
                    log.warning("kmesh store %s: no room for %d bytes", self.tier, len(blob))
                    return False
                obj.tensor.view(-1).copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
                self._io(self._backend.put, self._key(_BLOB_PREFIX, object_id, torch.uint8), obj)
                return True
            except StoreUnavailable:
                return False
            finally:
                if obj is not None:
                    obj.ref_count_down()

    def get_blob(self, object_id: SegmentId) -> bytes | None:
        """The bytes stored by `put_blob`, or None (absent, or the tier failed)."""
        if not self.health.up:
            return None
        with self._lock:
            try:
                obj = self._io(self._backend.get, self._key(_BLOB_PREFIX, object_id, torch.uint8))
            except StoreUnavailable:
                return None
            if obj is None:
                return None
            try:
                return bytes(obj.tensor.reshape(-1).numpy().tobytes())
            finally:
                obj.ref_count_down()

    def delete_blob(self, object_id: SegmentId) -> bool:
        if not self.health.up:
            return False
        with self._lock:
            try:
                key = self._key(_BLOB_PREFIX, object_id, torch.uint8)
                return bool(self._io(self._backend.remove, key))
            except StoreUnavailable:
                return False

    # -- helpers -------------------------------------------------------------------------------

    def _get_locked(self, segment_id: SegmentId) -> Master | None:
        meta_obj = self._io(self._backend.get, self._key(_META_PREFIX, segment_id, torch.uint8))
        if meta_obj is None:
            return None
        try:
            meta = MasterMeta.decode(bytes(meta_obj.tensor.reshape(-1).numpy().tobytes()))
        except Exception as exc:  # malformed metadata: rejected, not a fault of the tier
            return self._corrupt(segment_id, f"metadata unreadable: {type(exc).__name__}")
        finally:
            meta_obj.ref_count_down()
        if not meta.seal_holds(segment_id):
            return self._corrupt(segment_id, "metadata not sealed for this segment")
        nbytes = _numel(meta.shape) * self._dtype.itemsize
        key = self._key(_KV_PREFIX, segment_id, self._dtype)
        kv_obj = self._io(self._backend.get, key, nbytes)
        if kv_obj is None:
            return None
        try:
            L, two, T, H, D = meta.shape
            stored = kv_obj.tensor
            if tuple(stored.shape) != (two, L, T, H * D) or stored.dtype != self._dtype:
                return self._corrupt(segment_id, f"shape {tuple(stored.shape)} {stored.dtype}")
            kv = stored.view(two, L, T, H, D).permute(1, 0, 2, 3, 4).contiguous()
        finally:
            kv_obj.ref_count_down()
        if meta.dtype != self.layout.dtype or kv_checksum(kv) != meta.checksum:
            return self._corrupt(segment_id, "checksum mismatch")
        return Master(kv, torch.tensor(meta.positions, dtype=torch.int64))

    def _corrupt(self, segment_id: SegmentId, why: str) -> Master | None:
        """Count, log and delete a rejected master (lock held; so the next reader that computes
        the segment stores it again); returns None (what `get` then returns)."""
        self.num_corrupt += 1
        log.warning("kmesh store %s: master %s… rejected: %s", self.tier, segment_id[:12], why)
        if len(self._rejected) >= _MAX_REJECTED:
            self._rejected.pop(next(iter(self._rejected)))
        self._rejected[segment_id] = why
        for key in (
            self._key(_META_PREFIX, segment_id, torch.uint8),
            self._key(_KV_PREFIX, segment_id, self._dtype),
        ):
            with contextlib.suppress(Exception):
                self._backend.remove(key)
        return None


def open_store(
    store: str | StoreSpec,
    layout: MasterLayout,
    *,
    cpu_bytes: int = 1 << 30,
    timeout_s: float = 0.5,
) -> LMCacheMasterStore:
    """Open the store named by a ``kmesh.store`` value (``cpu``, ``disk:///p``, ``lm://h:p``,
    ``redis://h:p``). ``cpu_bytes``: host-RAM pool of LMCache (the store itself for ``cpu``,
    staging for the other tiers). ``timeout_s``: base deadline of one operation
    (``kmesh.store_timeout_s``). Never raises for a store that does not answer: it starts down."""
    spec = parse_store(store) if isinstance(store, str) else store
    return LMCacheMasterStore(spec, layout, cpu_bytes=cpu_bytes, timeout_s=timeout_s)


def _why(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
