"""Running beside vLLM's prefix caching: blended blocks are cached under hashes no one else has.

vLLM's prefix cache keys a full block by ``request.block_hashes[i]``, a hash chained over the
prompt's tokens (and ``cache_salt``, LoRA, multimodal keys) up to the block's end. It caches a
request's blocks when it allocates them — including blocks whose KV a connector provides — and a
later request whose own chain reaches the same hash gets the block as exact prefix KV. A blended
block is an approximation of the exact prefill, so it must never be found that way.

The mechanism (`privatize`): when the connector accepts a request for reuse, before vLLM
allocates its blocks, every entry of ``request.block_hashes`` from the first token the connector
provides onward is replaced by a hash private to that request (a per-engine serial number mixed
with the original). Blocks are then cached under keys no other request's chain produces, and the
hashes vLLM appends later (generated tokens) chain from a private one, so they are private too.
The exact leading prefix — the blocks vLLM found in its own cache — keeps its real hashes.

Consequences: unannotated traffic keeps its prefix-cache hits; an annotated request takes its
leading prefix from the cache and the blend starts after it; a prompt that repeats or extends a
blended request's prompt gets exact hits only up to where the blend began, and recomputes the
rest. Blended requests never share blocks with each other, not even identical ones: a blend's KV
depends on its siblings (collective selection) and on the master it read, so equal annotations do
not prove equal KV. A block whose load failed is recomputed exactly by vLLM and stays under its
private hash (a lost hit, never a wrong one). Privatization is sticky: a request rescheduled after
preemption keeps the private hashes it had.

Assumptions, checked at start against the running vLLM (`check_prefix_caching`; if one fails, the
connector refuses to start with prefix caching on, naming it): one KV cache group; the hasher
gives one hash per ``hash_block_size`` tokens; `KVCacheManager` caches blocks under
``request.block_hashes`` at allocation and looks them up by the same list.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

__all__ = ["Privatizer", "check_prefix_caching"]

_TAG = b"kmesh-blended\0"


class Privatizer:
    """Replaces a request's block hashes from a token onward with private ones (see module doc).

    ``hash_block_size``: tokens per entry of ``request.block_hashes``."""

    def __init__(self, hash_block_size: int) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size={hash_block_size} must be positive")
        self.hash_block_size = hash_block_size
        self._serial = itertools.count()
        self._private_from: dict[str, int] = {}  # request id → first private entry

    def privatize(self, request: Any, first_token: int) -> int:
        """Make every hash entry covering tokens ≥ ``first_token`` private; returns the index of
        the first private entry. Idempotent per request, and never un-privatizes an entry."""
        hashes = request.block_hashes
        start = first_token // self.hash_block_size
        done = self._private_from.get(request.request_id, len(hashes))
        salt = next(self._serial).to_bytes(8, "little")
        for i in range(start, min(done, len(hashes))):
            if not isinstance(hashes[i], bytes):
                raise TypeError(f"block hashes are {type(hashes[i]).__name__}, not bytes")
            hashes[i] = hashlib.sha256(_TAG + salt + hashes[i]).digest()
        first = min(start, done)
        self._private_from[request.request_id] = first
        return first

    def is_private(self, request_id: str) -> bool:
        return request_id in self._private_from

    def forget(self, request_id: str) -> None:
        """The request finished: its entries stay private in the cache; only our record goes."""
        self._private_from.pop(request_id, None)


def check_prefix_caching(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """None when the mechanism holds in this vLLM; else what failed, in words.

    Runs on a scratch `KVCacheManager` of 16 blocks (never the engine's): a request whose
    entries from its second block on are privatized is allocated and freed; an identical request
    with real hashes must then find exactly its first block in the cache."""
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
    hash_block = int(getattr(kv_cache_config, "hash_block_size", None) or block)
    if block % hash_block:
        return f"block size {block} is not a multiple of the hash block size {hash_block}"
    try:
        import dataclasses

        scratch = dataclasses.replace(kv_cache_config, num_blocks=16)
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block, hash_fn)
        tokens = [(7 * i + 3) % 1000 + 1 for i in range(4 * block + 1)]

        def request(req_id: str) -> Any:
            params = SamplingParams(max_tokens=1)
            return Request(req_id, list(tokens), params, None, block_hasher=hasher)

        manager = KVCacheManager(scratch, 4 * block + 8, block, hash_block, enable_caching=True)
        blended = request("kmesh-check-blended")
        if len(blended.block_hashes) != 4 * block // hash_block:
            return f"{len(blended.block_hashes)} block hashes for {4 * block + 1} tokens"
        Privatizer(hash_block).privatize(blended, block)
        if manager.allocate_slots(blended, len(tokens)) is None:
            return "the scratch cache could not allocate 5 blocks"
        manager.free(blended)
        exact = request("kmesh-check-exact")
        _, hit, *_ = manager.get_computed_blocks(exact)
    except Exception as exc:
        return f"the start-up check failed: {type(exc).__name__}: {exc}"
    if hit != block:
        return (
            f"an exact request found {hit} cached tokens after a blended one (want {block}: the "
            "exact first block, and none of the privatized ones)"
        )
    return None
