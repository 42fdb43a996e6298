"""The scheduler's view of blocks: block hashes, the prefix-cache check, a step's requests (seam).

- `rewrite_hashes`: rewrites entries of ``request.block_hashes`` (the keys vLLM's prefix cache
  files a request's full blocks under; `kmesh_blend.vllm.prefix_cache` makes blended ones private);
- `check_prefix_caching`: proves on a scratch ``KVCacheManager`` that rewritten hashes keep
  blocks out of other requests' prefix hits;
- `step_requests`: the requests of a ``SchedulerOutput`` with their block ids (one KV cache
  group), new ones, continuing ones and ones resumed after a preemption alike;
- `release_blocks`: gives a running request's blocks back to vLLM's pool in the middle of its
  block list (``kmesh.share_kv_memory``), the way vLLM frees a sliding window's blocks: each
  entry becomes vLLM's null block, its prefix-cache hash is dropped, the block is freed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, cast

from kmesh_blend.vllm.seam import REPORT

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "StepRequest",
    "block_bytes",
    "check_prefix_caching",
    "free_blocks",
    "held_blocks",
    "release_blocks",
    "rewrite_hashes",
    "step_requests",
]

Mix = Callable[[bytes], bytes]  # a block hash → its replacement


class StepRequest(NamedTuple):
    """A request scheduled in a step: ``blocks`` are all its block ids when ``whole`` (new or
    resumed after a preemption), else the ones added this step; ``num_computed`` tokens were
    computed before the step and ``num_scheduled`` are computed in it."""

    req_id: str
    whole: bool
    blocks: list[int]
    num_computed: int
    num_scheduled: int


def step_requests(out: SchedulerOutput) -> list[StepRequest]:
    """The step's requests (new ones first, in the scheduler's order)."""
    scheduled = out.num_scheduled_tokens
    got = [
        StepRequest(
            new.req_id,
            True,
            list(new.block_ids[0]),
            new.num_computed_tokens,
            scheduled.get(new.req_id, 0),
        )
        for new in out.scheduled_new_reqs
    ]
    cached = out.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for i, req_id in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[i]
        back = req_id in resumed  # comes back with all its blocks anew
        ids = list(blocks[0]) if blocks is not None else []
        got.append(StepRequest(req_id, back, ids, cached.num_computed_tokens[i],
                               scheduled.get(req_id, 0)))  # fmt: skip
    return got


def release_blocks(manager: KVCacheManager, request: Request,
                   blocks: list[tuple[int, int]]) -> int:  # fmt: skip
    """Give back entries (index into the request's block list, block id) of a running request;
    returns how many went. An entry stays when the request is not running, the id at that index
    is another (a preemption came first), or another request holds the block too (a prefix-cache
    hit it shares: freeing it saves nothing)."""
    from vllm.v1.request import RequestStatus

    groups = manager.coordinator.single_type_managers
    if request.status != RequestStatus.RUNNING or len(groups) != 1:
        return 0
    own = groups[0].req_to_blocks.get(request.request_id)
    if own is None:
        return 0
    pool = manager.block_pool
    freed = []
    for index, block_id in blocks:
        block = own[index] if index < len(own) else None
        if block is None or block.is_null or block.block_id != block_id or block.ref_cnt != 1:
            continue
        own[index] = pool.null_block
        freed.append(block)
    if freed:
        # never served by prefix caching (its rows belong to no prefix now)
        pool.evict_blocks({block.block_id for block in freed})
        pool.free_blocks(freed)
    return len(freed)


def held_blocks(manager: KVCacheManager, block_ids: list[int]) -> int:
    """How many of a request's ``block_ids`` are blocks of vLLM's pool (not its null block)."""
    null = manager.block_pool.null_block.block_id
    return sum(1 for block_id in block_ids if block_id != null)


def free_blocks(manager: KVCacheManager) -> int:
    """Blocks vLLM's pool can hand out now (free or evictable prefix-cache blocks)."""
    return int(manager.block_pool.get_num_free_blocks())


def block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block across every layer of the (single) KV cache group; 0 when unknown."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return 0
    group = groups[0]
    return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)


def rewrite_hashes(request: Request, start: int, stop: int, mix: Mix) -> int:
    """Replace entries [start, stop) of ``request.block_hashes`` by ``mix(entry)``; returns how
    many entries the request has. Raises TypeError for hashes that are not bytes."""
    hashes = request.block_hashes
    for i in range(start, min(stop, len(hashes))):
        entry = hashes[i]
        if not isinstance(entry, bytes):
            raise TypeError(f"block hashes are {type(entry).__name__}, not bytes")
        hashes[i] = cast("BlockHash", mix(entry))
    return len(hashes)


def num_hashes(request: Request) -> int:
    return len(request.block_hashes)


def hash_block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Tokens per entry of ``request.block_hashes``."""
    size = getattr(kv_cache_config, "hash_block_size", None)
    return int(size or vllm_config.cache_config.block_size)


def check_prefix_caching(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                         privatize: Callable[[Request, int], object]) -> str | None:  # fmt: skip
    """None when ``privatize(request, first_token)`` keeps blocks out of exact prefix hits in
    this vLLM; else what failed, in words.

    Runs on a scratch `KVCacheManager` of 16 blocks (never the engine's): a request privatized
    from its second block on is allocated and freed; an identical request with real hashes must
    then find exactly its first block in the cache."""
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request
    except ImportError as exc:
        return f"vLLM's prefix-cache classes are not where expected: {exc}"
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None or len(groups) != 1:
        return f"{len(groups or [])} KV cache groups (one is supported)"
    block = int(vllm_config.cache_config.block_size)
    hash_block = hash_block_size(vllm_config, kv_cache_config)
    if block % hash_block:
        return f"block size {block} is not a multiple of the hash block size {hash_block}"
    try:
        scratch = dataclasses.replace(kv_cache_config, num_blocks=16)
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block, hash_fn)
        tokens = [(7 * i + 3) % 1000 + 1 for i in range(4 * block + 1)]

        def request(req_id: str) -> Request:
            params = SamplingParams(max_tokens=1)
            return Request(req_id, list(tokens), params, None, block_hasher=hasher)

        manager = KVCacheManager(scratch, 4 * block + 8, block, hash_block, enable_caching=True)
        blended = request("kmesh-check-blended")
        if num_hashes(blended) != 4 * block // hash_block:
            return f"{num_hashes(blended)} block hashes for {4 * block + 1} tokens"
        privatize(blended, block)
        if manager.allocate_slots(blended, len(tokens)) is None:
            return "the scratch cache could not allocate 5 blocks"
        manager.free(blended)
        _, hit = manager.get_computed_blocks(request("kmesh-check-exact"))[:2]
    except Exception as exc:
        return f"the start-up check failed: {type(exc).__name__}: {exc}"
    if hit != block:
        return (
            f"an exact request found {hit} cached tokens after a blended one (want {block}: the "
            "exact first block, and none of the privatized ones)"
        )
    REPORT.note_found("prefix caching", "block hashes rewritable (scratch check passed)")
    return None
