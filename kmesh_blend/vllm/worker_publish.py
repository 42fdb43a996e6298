"""Worker side, publishing: a new segment's KV, read back from the paged cache after the forward
that computed it, becomes its master in the store (held for its family, counted in its round)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.store import LMCacheMasterStore
from kmesh_blend.vllm.meta import KMeshWorkerMetadata, SaveRequest
from kmesh_blend.vllm.worker_lifetimes import Lifetimes

__all__ = ["publish"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


def publish(save: SaveRequest, kv_at: Callable[[torch.Tensor], torch.Tensor], block_size: int,
            cache: SegmentCache, store: LMCacheMasterStore, lifetimes: Lifetimes,
            out: KMeshWorkerMetadata) -> None:  # fmt: skip
    """Store each segment of ``save`` (``kv_at(slots)``: [L, 2, n, Hkv, D] of the paged cache);
    what did not store is reported with the store's reason."""
    for ref in save.segments:
        kv = kv_at(save.slots(block_size, ref))
        positions = torch.arange(ref.start, ref.end, dtype=torch.int64)
        if cache.publish(ref.segment_id, kv.cpu(), positions, round=save.round,
                         family=save.family, scope=save.scope):  # fmt: skip
            out.published.append(ref.segment_id)
            lifetimes.published(ref.segment_id)
            if save.family is not None:
                cache.hold(ref.segment_id, save.family)
        else:
            log.warning("kmesh: could not store segment %s", ref.segment_id[:16])
            out.unpublished.append(ref.segment_id)
            why = store.last_error or "the store refused it"
            out.store_errors[ref.segment_id] = f"{store.tier} store: {why}"
