"""What the connector derives from vLLM's configuration once, at start-up: the segment
namespace (model, weights fingerprint, dtype, layout, RoPE), the prefix-caching guard, and the
shared-store lookup the scheduler uses to route families across engines."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kmesh_blend.config import KMeshConfig
from kmesh_blend.segments.fingerprint import weights_fingerprint
from kmesh_blend.segments.identity import Namespace, SegmentId, make_namespace
from kmesh_blend.vllm.prefix_cache import Privatizer
from kmesh_blend.vllm.seam.blocks import check_prefix_caching, hash_block_size

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["engine_namespace", "prefix_privatizer", "shared_store_lookup"]

log = logging.getLogger("vllm.kmesh_blend")


def engine_namespace(vllm_config: VllmConfig) -> Namespace:
    """The namespace every segment id of this engine is keyed under."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    # The weights' fingerprint is part of the identity: new weights at the same path never read
    # KV the old ones computed (what it catches: kmesh_blend/segments/fingerprint.py).
    fingerprint = weights_fingerprint(_local_weights(mc))
    if fingerprint.startswith("unverified:"):
        log.warning("kmesh: weights of %s not found locally; segments keyed by name only", mc.model)
    return make_namespace(
        f"{mc.model}#{fingerprint}",
        mc.dtype,
        num_layers=mc.get_num_layers(vllm_config.parallel_config),
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_dim=mc.get_head_size(),
        rope=dict(rope),
    )


def prefix_privatizer(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Privatizer | None:
    """With prefix caching on: the checked mechanism that keeps blended blocks out of exact
    prefix hits (refuses to start, naming the reason, when the check fails); else None."""
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        return None
    privatizer = Privatizer(hash_block_size(vllm_config, kv_cache_config))
    problem = check_prefix_caching(
        vllm_config, kv_cache_config, Privatizer(privatizer.hash_block_size).privatize
    )
    if problem is not None:
        raise ValueError(
            f"KMeshConnector: blended KV must never be served as exact prefix KV, and the check "
            f"of how this vLLM caches blocks failed ({problem}); start vLLM with prefix caching "
            "off (enable_prefix_caching=False, --no-enable-prefix-caching)"
        )
    log.info("kmesh: prefix caching on; blended blocks get private hashes (check passed)")
    return privatizer


def _local_weights(model_config: ModelConfig) -> str:
    """The local directory of the served weights (a hub id resolved in the local HF cache)."""
    path = str(model_config.model)
    if Path(path).exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, revision=model_config.revision, local_files_only=True))
    except Exception:
        return path


def shared_store_lookup(
    config: KMeshConfig, vllm_config: VllmConfig
) -> Callable[[SegmentId], bool] | None:
    """``contains(segment_id)`` for stores other engines can write (lm://, redis://), else None."""
    if config.store_spec.kind not in ("lm", "redis"):
        return None
    from kmesh_blend.segments.master import MasterLayout
    from kmesh_blend.segments.store import open_store

    mc = vllm_config.model_config
    parallel = vllm_config.parallel_config
    # Rank 0's shard stands for the segment: a rank whose shard is missing fails its load and
    # the request recomputes.
    layout = MasterLayout(
        mc.get_num_layers(parallel),
        mc.get_num_kv_heads(parallel),
        mc.get_head_size(),
        str(mc.dtype).removeprefix("torch."),
        rank=0,
        world_size=parallel.tensor_parallel_size,
    )
    store = open_store(
        config.store_spec, layout, cpu_bytes=64 << 20, timeout_s=config.store_timeout_s
    )
    return store.contains
