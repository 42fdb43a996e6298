"""One layer of one cascade decode step, on either implementation of the same math.

`attend_kernel` runs the CPU kernel (`kmesh_blend.cpu.cascade_decode_op`: appends this step's
K/V to each request's own rows, attends to them and to every master level, writes the output
rows, in one call, K/V in the cache dtype); `attend_torch` does the same in plain torch on fp32
copies (`kmesh_blend.attention.decode.decode_cascade`). Both read a `Step`: the requests
decoding in cascade this step in groups (those reading common masters), each group's levels,
and their own rows' slots in the engine's pool (`kmesh_blend.vllm.cascade_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from kmesh_blend.attention.decode import MasterRows, decode_cascade
from kmesh_blend.models.rope import RotaryEmbedding
from kmesh_blend.vllm.cascade_buffers import Group, OwnPool, gathered
from kmesh_blend.vllm.paged import PagedLayout
from kmesh_blend.vllm.seam.cpu_attention import KernelBatch

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer

__all__ = ["EngineKV", "Heads", "Kernel", "Step", "attend_kernel", "attend_torch"]

Kernel = Callable[..., object]  # torch.ops.kmesh_cpu.cascade_decode (see kmesh_blend/cpu)


class Heads(NamedTuple):
    """Attention heads of this rank: query heads, KV heads, head size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


class EngineKV(NamedTuple):
    """What the cascade path reads and writes in one engine: its attention layers in model
    order, their paged KV caches and its layout, the model's rotary embedding, this rank's
    heads."""

    layers: list[AttnLayer]
    caches: list[torch.Tensor]
    layout: PagedLayout
    rope: RotaryEmbedding
    heads: Heads


class Step(NamedTuple):
    """n requests decoding in cascade in one step."""

    tokens: torch.Tensor  # [n] int64 query rows of the cascade requests
    # per group (`cascade_buffers.Group`): the group, its query rows [g] int64 and its generated
    # rows before this step's token [g] int64
    groups: list[tuple[Group, torch.Tensor, torch.Tensor]]
    others: tuple[torch.Tensor, KernelBatch] | None  # the step's other requests, for vLLM


def attend_kernel(kernel: Kernel, index: int, step: Step, pool: OwnPool, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, heads: Heads,
                  scale: float, exact: bool = False) -> None:  # fmt: skip
    """Layer ``index`` on the CPU kernel: query [t, H·D], key / value [t, Hkv·D] of the whole
    step; writes the cascade requests' rows of ``out`` [t, H, D] and appends this step's K/V to
    their slots of ``pool`` (``exact``: the kernel's two-term bf16 operands). Per group, one
    call per `per_call(heads)` requests (the kernel keeps n · H/Hkv query rows in reach: at
    most 64); each call reads its group's masters."""
    num_heads, kv_heads, dim = heads
    query, key, value = (query.view(-1, num_heads, dim), key.view(-1, kv_heads, dim),
                         value.view(-1, kv_heads, dim))  # fmt: skip
    own_k, own_v, own_bias = pool.k[index], pool.v[index], pool.bias[index]
    chunk = per_call(heads)
    for group, tokens, generated in step.groups:
        cols = group.first_free[index] + generated
        levels = group.levels
        master_k = [level.master.k_t[index] for level in levels]
        master_v = [level.master.v[index] for level in levels]
        biases = [level.bias[index] for level in levels]
        n = int(tokens.numel())
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            kernel(
                out, tokens[a:b], query, key, value, own_k, own_v, own_bias, group.slots[a:b],
                cols[a:b], master_k, master_v, [bias[a:b] for bias in biases],
                [r[a:b] for r in group.rotations], scale, exact,
            )  # fmt: skip


def per_call(heads: Heads) -> int:
    """Requests one CPU kernel call serves: n · H/Hkv ≤ 64 query rows."""
    return max(1, 64 * heads.num_kv_heads // heads.num_heads)


def attend_torch(index: int, step: Step, pool: OwnPool, query: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, heads: Heads,
                 rope: RotaryEmbedding, scale: float) -> None:  # fmt: skip
    """Layer ``index`` in plain torch: this step's token of every cascade request joins its
    own rows in ``pool``, then attends (fp32); writes their rows of ``out`` [t, H, D]."""
    for group, tokens, generated in step.groups:
        slots = group.slots
        cols = group.first_free[index] + generated
        shape = (slots.numel(), heads.num_kv_heads, heads.head_dim)
        pool.k[index][slots, :, :, cols] = key[tokens].reshape(shape).float()
        pool.v[index][slots, :, cols] = value[tokens].reshape(shape).float()
        pool.bias[index][slots, cols] = 0.0
        query_f32 = query[tokens].view(-1, heads.num_heads, heads.head_dim).float()
        masters = [
            # The same −Δ tensor every layer: the rotary tables are memoized for it.
            MasterRows(lv.master.k_t[index], lv.master.v[index], rope.apply(query_f32, lv.back))
            for lv in group.levels
        ]
        own, bias = gathered(pool, group, index)
        out[tokens] = decode_cascade(query_f32, own, masters, bias, scale).to(out.dtype)
