"""Mirrors next to their masters: the same LMCache store, the same round-aware index.

    mirrors = MirrorStore(segment_cache)
    mid = mirrors.put(master_id, master, keys, values, positions, inv_freq, owner="req-7")
    got = mirrors.fetch(mid)                     # MirrorFetch(mirror, master, reason)
    if got.reason is None:                       # else: recompute (never doubtful KV)
        plan = plan_restore(got.master.kv, got.master.positions, got.mirror, inv_freq)

Rules:
- **Versioned**: a mirror records its master's id and `kv_checksum` (the master *version*); a fetch
  verifies the master it gets against both, so a mirror is never applied to another master (a
  re-published segment with other bits, another model's master, a tampered one).
- **Checksummed**: the stored bytes carry a BLAKE2b digest (`kmesh_blend.mirror.wire`); corrupted,
  truncated or malformed objects are refused, counted (``num_corrupt``) and dropped.
- **Never outlives its master** (pin, not promote): storing a mirror pins its master in the index
  under the family ``mirror:<mirror id>``, so the master cannot be retired or evicted while the
  mirror lives; retiring or dropping the mirror closes that family, which lets the master retire
  in turn. If the master vanishes anyway (the tier dropped it under memory pressure), the fetch
  finds no master, drops the mirror and says so. Promotion to a master is left to the caller
  (`kmesh_blend.mirror.reference.restore_dense_reference` gives the dense KV to publish).

Every failure returns a reason (``MirrorFetch.reason``) instead of raising: the caller recomputes.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch

from kmesh_blend.mirror.codec import PREDICTOR, Granularity, Mirror, encode
from kmesh_blend.mirror.wire import MirrorFormatError, decode, encode_bytes
from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.master import Master, kv_checksum

if TYPE_CHECKING:
    from kmesh_blend.segments.cache import SegmentCache
    from kmesh_blend.segments.index import SegmentInfo

__all__ = ["MirrorFetch", "MirrorStore", "master_version", "mirror_id"]

log = logging.getLogger("kmesh_blend.mirror")

_PIN_PREFIX = "mirror:"
_versions: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


class MirrorFetch(NamedTuple):
    """A verified mirror and the master it applies to, or ``reason`` (why to recompute)."""

    mirror: Mirror | None
    master: Master | None
    reason: str | None


def mirror_id(master_id: str, owner: str, positions: torch.Tensor) -> SegmentId:
    """Content id of a mirror: its master, its owner (a request or family) and its positions."""
    h = hashlib.sha256(b"kmesh-mirror-v1\0")
    h.update(master_id.encode() + b"\0" + owner.encode() + b"\0")
    h.update(positions.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
    return SegmentId(h.hexdigest())


def master_version(master: Master) -> str:
    """`kv_checksum` of ``master.kv``, computed once per tensor object (masters are read-only)."""
    key = id(master.kv)
    hit = _versions.get(key)
    if hit is not None and hit[0]() is master.kv:
        return hit[1]
    version = kv_checksum(master.kv)

    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _versions.pop(key, None)

    _versions[key] = (weakref.ref(master.kv, forget), version)
    return version


class MirrorStore:
    """Mirrors in the store and index of one `SegmentCache` (opaque objects in its store:
    ``put_blob`` / ``get_blob``)."""

    def __init__(self, cache: SegmentCache, compress: bool = False) -> None:
        self.cache, self.compress = cache, compress  # compress: byte-plane zlib rows (wire)
        self.store = cache.store
        self.num_corrupt = 0
        self._mirrors: set[SegmentId] = set()

    def put(
        self,
        master_id: SegmentId,
        master: Master,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        *,
        owner: str,
        granularity: Granularity = "token",
        round: int | None = None,
        family: str | None = None,
    ) -> SegmentId | None:
        """Encode and store a sibling's segment KV as a mirror of ``master``; its id, or None.

        ``keys`` / ``values``: [L, S, H, D] of the sibling (K rotated at ``positions`` [S] int64);
        ``inv_freq``: [D/2] fp32. The master must be indexed (it gets pinned).
        """
        if self.cache.index.get(master_id) is None:
            log.warning(
                "kmesh mirror: master %s… is not indexed; mirror not stored", master_id[:12]
            )
            return None
        mirror = encode(
            master.kv, master.positions, keys, values, positions, inv_freq,
            granularity, master_version(master),
        )  # fmt: skip
        blob = encode_bytes(mirror, master_id, self.compress)
        mid = mirror_id(master_id, owner, positions)
        self.cache.index.pin(master_id, _PIN_PREFIX + mid)  # before the write: no gap
        if not self.store.put_blob(mid, blob):
            self.cache.close_family(_PIN_PREFIX + mid)
            return None
        self.cache.index.publish(
            mid, mirror.num_tokens, position_offset=int(positions[0]), round=round,
            family=family, nbytes=len(blob),
        )  # fmt: skip
        self._mirrors.add(mid)
        return mid

    def fetch(self, mid: SegmentId, *, family: str | None = None) -> MirrorFetch:
        """Read, verify and bind a mirror to its master (see the module docstring). Never raises."""
        blob = self.store.get_blob(mid)
        if blob is None:
            return MirrorFetch(None, None, "mirror missing")
        try:
            mirror, header = decode(blob)
        except MirrorFormatError as exc:
            self.num_corrupt += 1
            log.warning("kmesh mirror %s… rejected: %s", mid[:12], str(exc))
            self.drop(mid)
            return MirrorFetch(None, None, f"corrupt mirror: {exc}")
        if header.predictor != PREDICTOR:
            return MirrorFetch(None, None, f"mirror predictor {header.predictor!r} unsupported")
        master = self.cache.fetch(SegmentId(header.master_id), family=family).master
        if master is None:
            self.drop(mid)
            return MirrorFetch(None, None, "master missing")
        if master_version(master) != header.master_checksum:
            return MirrorFetch(None, None, "wrong master version")
        L, _, S, H, D = master.kv.shape
        if header.shape != (L, S, H, D) or str(master.kv.dtype) != f"torch.{header.dtype}":
            return MirrorFetch(None, None, f"mirror {header.shape} does not fit the master")
        return MirrorFetch(mirror, master, None)

    def drop(self, mid: SegmentId) -> list[SegmentInfo]:
        """Delete a mirror now and unpin its master; returns index entries this retired."""
        self._mirrors.discard(mid)
        self.store.delete_blob(mid)
        info = self.cache.index.evict(mid)
        retired = [info] if info is not None else []
        return retired + self.cache.close_family(_PIN_PREFIX + mid)

    def advance_round(self, to: int | None = None) -> list[SegmentInfo]:
        """`SegmentCache.advance_round`, then the retired mirrors' objects and master pins."""
        return self._finish(self.cache.advance_round(to))

    def close_family(self, family: str) -> list[SegmentInfo]:
        """`SegmentCache.close_family`, then the retired mirrors' objects and master pins."""
        return self._finish(self.cache.close_family(family))

    def _finish(self, retired: list[SegmentInfo]) -> list[SegmentInfo]:
        out = list(retired)
        for info in retired:
            if info.segment_id in self._mirrors:
                self._mirrors.discard(info.segment_id)
                self.store.delete_blob(info.segment_id)
                out += self._finish(self.cache.close_family(_PIN_PREFIX + info.segment_id))
        return out
