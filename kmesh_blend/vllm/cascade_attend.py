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

from kmesh_blend.attention.decode import MasterRows, OwnRows, decode_cascade
from kmesh_blend.models.rope import RotaryEmbedding
from kmesh_blend.vllm.cascade_buffers import Composition, Group, OwnPool
from kmesh_blend.vllm.paged import PagedLayout
from kmesh_blend.vllm.seam.cpu_attention import KernelBatch

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer

__all__ = [
    "EngineKV",
    "Heads",
    "Kernel",
    "KernelCalls",
    "Step",
    "attend_kernel",
    "attend_torch",
    "gathered",
]

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
    calls: KernelCalls | None = None  # the CPU kernel's calls (None: the torch path)
    lone: bool = False  # every group has one request: no master read by two in this step


Call = tuple[torch.Tensor, tuple[object, ...]]  # query rows [c] int64, the other arguments


class KernelCalls:
    """The CPU kernel's calls of one composition (`cascade_buffers.Composition`), per layer:
    the arguments that stay while the set of requests and the pool's storage stay, built once
    instead of per layer and step (slicing them in Python every layer cost about 20 µs a layer,
    a few % of a small model's decode step). What moves from step to step — the requests' query
    rows in the batch and the own column this step's row goes to — is written in place
    (`advance`) into buffers the calls hold views of. Per group, one call per `per_call(heads)`
    requests (the kernel keeps n · H/Hkv query rows in reach: at most 64)."""

    def __init__(self, composition: Composition, pool: OwnPool, heads: Heads) -> None:
        self.composition, self.generation = composition, pool.generation
        chunk = per_call(heads)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.layers: list[list[Call]] = [[] for _ in range(pool.num_layers)]
        # Views are taken per group and chunk with one `unbind` over layers each (slicing per
        # layer and level cost about 1 ms a composition: a step's, where the set changes)
        pool_layers = list(zip(pool.k, pool.v, pool.bias.unbind(0), strict=True))
        for group in composition.groups:
            g = int(group.rows.numel())
            tokens = torch.zeros(g, dtype=torch.int64)
            cols = torch.zeros_like(group.first_free)  # [L, g]
            self._buffers.append((tokens, cols, group.first_free))
            master_k = _by_layer([level.master.k_t for level in group.levels], pool.num_layers)
            master_v = _by_layer([level.master.v for level in group.levels], pool.num_layers)
            for a in range(0, g, chunk):
                b = min(a + chunk, g)
                rows, slots, col = tokens[a:b], group.slots[a:b], cols[:, a:b].unbind(0)
                biases = _by_layer([level.bias[:, a:b] for level in group.levels],
                                   pool.num_layers)  # fmt: skip
                rotations = [r[a:b] for r in group.rotations]
                for index, calls in enumerate(self.layers):
                    k, v, bias = pool_layers[index]
                    calls.append((rows, (
                        k, v, bias, slots, col[index], master_k[index], master_v[index],
                        biases[index], rotations,
                    )))  # fmt: skip

    def serves(self, composition: Composition, pool: OwnPool) -> bool:
        """Whether these calls are ``composition``'s on ``pool``'s current storage."""
        return composition is self.composition and pool.generation == self.generation

    def advance(self, groups: list[tuple[Group, torch.Tensor, torch.Tensor]]) -> None:
        """This step's query rows and own columns (`Step.groups`, this composition's order)."""
        for (tokens, cols, first), (_, rows, generated) in zip(self._buffers, groups, strict=True):
            tokens.copy_(rows)
            torch.add(first, generated, out=cols)


def _by_layer(tensors: list[torch.Tensor], num_layers: int) -> list[list[torch.Tensor]]:
    """Per layer l, the views ``t[l]`` of each of ``tensors`` (each [L, ...]), in their order."""
    views = [t.unbind(0) for t in tensors]
    return [[v[layer] for v in views] for layer in range(num_layers)]


def attend_kernel(kernel: Kernel, index: int, calls: KernelCalls, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, heads: Heads,
                  scale: float, exact: bool = False) -> None:  # fmt: skip
    """Layer ``index`` on the CPU kernel: query [t, H·D], key / value [t, Hkv·D] of the whole
    step; writes the cascade requests' rows of ``out`` [t, H, D] and appends this step's K/V to
    their slots of the pool (``exact``: the kernel's two-term bf16 operands); each call reads
    its group's masters (`KernelCalls`)."""
    num_heads, kv_heads, dim = heads
    query, key, value = (query.view(-1, num_heads, dim), key.view(-1, kv_heads, dim),
                         value.view(-1, kv_heads, dim))  # fmt: skip
    for tokens, rest in calls.layers[index]:
        kernel(out, tokens, query, key, value, *rest, scale, exact)


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


def gathered(pool: OwnPool, group: Group, layer: int) -> tuple[OwnRows, torch.Tensor]:
    """The torch path's inputs of layer ``layer``: the group's own rows (copies gathered from
    their slots) and its bias [g, C + ΣS] fp32 over own rows then every level."""
    slots = group.slots
    own = OwnRows(pool.k[layer][slots], pool.v[layer][slots])
    levels = (level.bias[layer] for level in group.levels)
    return own, torch.cat((pool.bias[layer][slots], *levels), dim=1)
