"""vLLM's CPU attention kernel on part of a step's batch.

When some requests of a step decode in cascade, the others (unannotated requests, prefills, any
request without a plan) still attend through vLLM's own kernel: `sub_batch` selects their rows of
the step's attention metadata and builds the kernel's schedule for them, with the settings vLLM's
own metadata builder uses; `attend` runs the kernel on them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["SubBatch", "attend", "sub_batch"]


class SubBatch(NamedTuple):
    """vLLM kernel inputs for the step's other requests (a sub-batch)."""

    tokens: torch.Tensor  # [t] int64 query rows
    query_start_loc: torch.Tensor  # [r+1] int32
    seq_lens: torch.Tensor  # [r] int32
    block_table: torch.Tensor  # [r, max_blocks] int32
    schedule: Any


def sub_batch(
    meta: Any, layer: Any, dtype: torch.dtype, rows: list[int], starts: list[int]
) -> SubBatch:
    """Kernel inputs for requests ``rows`` of the step described by ``meta`` (vLLM's CPU
    attention metadata; ``starts``: its query starts as a list), all their query tokens."""
    from vllm import _custom_ops as ops
    from vllm import envs

    tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows])
    lens = torch.tensor([starts[i + 1] - starts[i] for i in rows], dtype=torch.int32)
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()))
    index = torch.tensor(rows)
    seq_lens = meta.seq_lens[index].contiguous()
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(rows),
        num_heads=layer.impl.num_heads,
        num_kv_heads=layer.impl.num_kv_heads,
        head_dim=layer.impl.head_size,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=bool(meta.causal),
        sliding_window_size=-1,
        isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=layer.impl.kv_cache_dtype,
    )
    block_table = meta.block_table[index].contiguous()
    return SubBatch(tokens, query_start_loc, seq_lens, block_table, schedule)


def attend(
    layer: Any, cache: torch.Tensor, query: torch.Tensor, sub: SubBatch, causal: bool
) -> torch.Tensor:
    """vLLM's CPU attention kernel on a sub-batch: [t, H, D] in the query dtype."""
    from vllm import _custom_ops as ops

    impl = layer.impl
    blocks, heads, block_size, _ = cache.shape
    base = cache.view(blocks, heads, 2 * block_size, -1)
    key_cache, value_cache = base.chunk(2, dim=2)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query.contiguous(),
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=sub.query_start_loc,
        seq_lens=sub.seq_lens,
        scale=impl.scale,
        causal=causal,
        alibi_slopes=impl.alibi_slopes,
        sliding_window=impl.sliding_window,
        block_table=sub.block_table,
        softcap=impl.logits_soft_cap,
        scheduler_metadata=sub.schedule,
        s_aux=impl.sinks,
        dynamic_causal=None,
        k_scale=layer._k_scale_float,
        v_scale=layer._v_scale_float,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    return out
