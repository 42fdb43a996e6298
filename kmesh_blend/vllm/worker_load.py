"""Worker side, loading: the masters a request reads, and what the blend computes for it.

`fetch_masters` reads each master once per step (the segment cache's retention and singleflight
behind it) and says, in words, why one cannot be had; `blend_request` turns a load into the
blend's input, with vLLM's exact prefix as a pseudo-segment the blend never recomputes;
`blend_groups` runs one group blend per distinct setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kmesh_blend.blend import (
    BlendOptions,
    BlendRequest,
    BlendResult,
    MasterSource,
    SegmentUse,
    blend_group,
)
from kmesh_blend.models.layerwise import LayerwiseModel
from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.master import Master
from kmesh_blend.vllm.meta import KMeshWorkerMetadata, LoadRequest
from kmesh_blend.vllm.paged_attention import Hook
from kmesh_blend.vllm.seam.engine import all_reduce
from kmesh_blend.vllm.worker_lifetimes import Lifetimes

__all__ = [
    "Masters", "WorkerHooks", "agree", "blend_groups", "blend_request", "fetch_masters",
]  # fmt: skip

Masters = dict[str, Master]  # segment id (or a derived key: a cut, vLLM's prefix) → its rows


@dataclass
class WorkerHooks:
    """Test hooks of one worker (set on a live ``WorkerSide.hooks``). ``fault(load)``: a reason
    fails that load; ``capture(req_id, kv)``: after each forward, the prompt KV
    [L, 2, T, Hkv, D] read back from the paged cache of every request blended in the step."""

    fault: Callable[[LoadRequest], str | None] | None = None
    capture: Callable[[str, torch.Tensor], None] | None = None


def fetch_masters(load: LoadRequest, masters: Masters, cache: SegmentCache,
                  lifetimes: Lifetimes, out: KMeshWorkerMetadata) -> str | None:  # fmt: skip
    """Fetch the masters of ``load`` into ``masters``; the failure reason, or None. Reads and
    time spent waiting go into the request's report."""
    reads, waited = 0, 0.0
    for ref in load.segments:
        if ref.segment_id in masters:
            continue
        start = time.perf_counter()
        fetched = cache.fetch(ref.segment_id, family=load.family)
        waited += time.perf_counter() - start
        reads += fetched.reads
        if fetched.master is None:
            return _missing(ref.segment_id, fetched.source, fetched.reason, cache, lifetimes, out)
        if load.family is not None:
            cache.hold(ref.segment_id, load.family)
        if fetched.master.num_tokens != ref.end - ref.start:
            out.lost.append(ref.segment_id)
            return f"segment {ref.segment_id[:16]} has {fetched.master.num_tokens} tokens"
        masters[ref.segment_id] = fetched.master
    report = out.reports.setdefault(load.req_id, {})
    report["storage_reads"], report["load_ms"] = reads, round(waited * 1e3, 3)
    return None


def _missing(segment_id: SegmentId, source: str, reason: str, cache: SegmentCache,
             lifetimes: Lifetimes, out: KMeshWorkerMetadata) -> str:  # fmt: skip
    """Why a master could not be had, in words; one the store no longer holds is reported
    lost (the scheduler forgets it and the recomputed request stores it again)."""
    if reason:  # the store failed: the master is not lost
        return reason
    rejected = cache.store.rejected(segment_id)
    if rejected is not None:  # deleted by the store
        out.lost.append(segment_id)
        return f"segment {segment_id[:16]} failed its integrity check: {rejected}"
    retired = lifetimes.reason(segment_id)
    if retired is not None:
        return retired
    out.lost.append(segment_id)
    return f"segment {segment_id[:16]} {source}"


def blend_request(load: LoadRequest, masters: Masters,
                  prefix_kv: Callable[[int], torch.Tensor]) -> BlendRequest:  # fmt: skip
    """What the blend computes for ``load``. Tokens before ``load.first`` came from vLLM's
    prefix cache: their exact KV (``prefix_kv(first)``: [L, 2, first, Hkv, D]) is read back as a
    pseudo-segment the blend never recomputes, and a segment reaching into them is cut to its
    part after them."""
    first, uses = load.first, []
    if first > 0:
        prefix_id = f"prefix:{load.req_id}"
        masters[prefix_id] = Master(prefix_kv(first).cpu(), torch.arange(first))
        uses.append(SegmentUse(0, first, prefix_id))
    for ref in load.segments:
        if ref.end <= first:
            continue
        segment_id: str = ref.segment_id
        start = max(ref.start, first)
        if start > ref.start:  # keep the stored rows of [start, end) only
            cut, master = start - ref.start, masters[ref.segment_id]
            segment_id = f"{ref.segment_id}@{cut}"
            masters[segment_id] = Master(master.kv[:, :, cut:], master.positions[cut:])
        uses.append(SegmentUse(start, ref.end, segment_id))
    tokens = torch.tensor(load.token_ids[: load.blend_len])
    whole = load.end is None  # vLLM's sampler reads the final state: no logits here
    return BlendRequest(tokens, tuple(uses), exact_prefix=first, output=whole, logits=False)


def blend_groups(model: LayerwiseModel, ready: list[tuple[LoadRequest, BlendRequest]],
                 masters: Masters, options: BlendOptions,
                 hooks: list[Hook | None]) -> list[BlendResult]:  # fmt: skip
    """One group blend per distinct setting (requests may carry their own ratio and sink
    tokens); results in ``ready``'s order."""
    groups: dict[BlendOptions, list[int]] = {}
    for i, (load, _) in enumerate(ready):
        mine = options.for_request(load.recompute_ratio, load.sink_tokens, load.drift_correction)
        groups.setdefault(mine, []).append(i)
    source, results = MasterSource(masters), dict[int, BlendResult]()
    for mine, members in groups.items():
        outs = blend_group(model, [ready[i][1] for i in members], source, mine,
                           [hooks[i] for i in members])  # fmt: skip
        results.update(zip(members, outs, strict=True))
    return [results[i] for i in range(len(ready))]


def agree(blends: list[tuple[LoadRequest, str | None]],
          world_size: int) -> list[tuple[LoadRequest, str | None]]:  # fmt: skip
    """Under tensor parallelism every rank must blend the same requests (the blend's
    projections all-reduce across ranks): a request that failed on any rank fails on all."""
    if world_size == 1 or not blends:
        return blends
    failed = all_reduce(torch.tensor([float(reason is not None) for _, reason in blends]))
    return [
        (load, reason or ("failed on another tensor-parallel rank" if bad > 0 else None))
        for (load, reason), bad in zip(blends, failed.tolist(), strict=True)
    ]
