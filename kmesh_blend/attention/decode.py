"""One decode step of a family in cascade: each shared segment's K/V read once for all readers.

Used by vLLM's decode path (`kmesh_blend.vllm.cascade_decode`). Request r decodes one query at
position P_r; its context is (a) rows of stored masters it reads unchanged, at offset Δ_rg from
where master g was computed, and (b) its own rows (private tokens, rows it replaced, generated
tokens), gathered from its paged blocks. RoPE scores depend only on position differences, so
rotating r's query by −Δ_rg lets it score against master g's stored keys as they are (see
`kmesh_blend.attention.cascade`); every decode query lies after the whole prompt, so no causal
mask is needed inside a level. The levels' (max, sum, unnormalized output) states merge exactly.

Plain torch, fp32 math whatever the input dtype; no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["MASKED", "OwnLevel", "SharedLevel", "decode_cascade", "rotation_tables"]

# Additive score bias of a masked key. Finite, so a level whose keys are all masked for a query
# yields a finite state whose merge weight underflows to exactly 0 (−inf would give 0/0).
MASKED = -1.0e30


class OwnLevel(NamedTuple):
    """Rows of each request's own, padded to U: k_t [n, Hkv, D, U] fp32 (keys, transposed for
    the score product), v [n, Hkv, U, D] fp32, bias [n, U] fp32 (0 real row, `MASKED` pad)."""

    k_t: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor


class SharedLevel(NamedTuple):
    """One shared master and the rows of this step's queries that read it.

    k_t: [Hkv, D, S] fp32 (keys rotated at the master's positions, transposed); v: [Hkv, S, D]
    fp32. users: [u] int64 rows of the step's queries, or None for all n in order. cos /
    signed_sin: [u, D] fp32, the rotation by −Δ of each user (`rotation_tables`). bias: [u, S]
    fp32, 0 where the user reads the master row, `MASKED` where its own copy differs (those rows
    are in its own level).
    """

    k_t: torch.Tensor
    v: torch.Tensor
    users: torch.Tensor | None
    cos: torch.Tensor
    signed_sin: torch.Tensor
    bias: torch.Tensor


def rotation_tables(deltas: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(cos, signed_sin) [u, D] fp32 rotating a query by −``deltas`` [u] (neox pairing, as
    `kmesh_blend.models.rope.RotaryEmbedding`): x·cos + swap(x)·signed_sin."""
    angles = -deltas.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cos = torch.cat((angles, angles), dim=-1).cos().float()
    sin = angles.sin().float()
    return cos, torch.cat((-sin, sin), dim=-1)


def decode_cascade(
    q: torch.Tensor, own: Sequence[OwnLevel], shared: Sequence[SharedLevel], scale: float
) -> torch.Tensor:
    """Attention of one decode query per request over its own rows and the shared masters.

    q: [n, H, D] (rotated at each request's position), any float dtype; ``own``: at least one
    level. Returns [n, H, D] fp32, equal to softmax attention over each request's materialized
    context (the start-up self-check bounds the difference to vLLM's kernel).
    """
    n, heads, dim = q.shape
    kv_heads = own[0].k_t.shape[1]
    group = heads // kv_heads
    qf = q.float().view(n, kv_heads, group, dim)
    state: list[torch.Tensor] | None = None
    for level in own:  # batched over requests: scores [n, Hkv, G, U]
        scores = torch.matmul(qf, level.k_t)
        scores = scores.mul_(scale).add_(level.bias[:, None, None, :])
        state = _merge(state, scores, level.v, None)
    assert state is not None, "decode_cascade needs an own level"
    for level in shared:
        rows = level.users
        u = n if rows is None else rows.numel()
        if u == 0:
            continue
        qu = qf.view(n, heads, dim) if rows is None else qf.view(n, heads, dim)[rows]
        half = dim // 2
        swapped = torch.cat((qu[..., half:], qu[..., :half]), dim=-1)
        qu = qu * level.cos[:, None, :] + swapped * level.signed_sin[:, None, :]
        # [Hkv, u·G, D]: one product per KV head covers every reader of the master.
        qu = qu.view(u, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, u * group, dim)
        scores = torch.matmul(qu, level.k_t).mul_(scale).view(kv_heads, u, group, -1)
        scores = scores.add_(level.bias[None, :, None, :]).transpose(0, 1)  # [u, Hkv, G, S]
        state = _merge(state, scores, level.v, rows)
    top, total, acc = state
    return (acc / total[..., None]).view(n, heads, dim)


def _merge(state: list[torch.Tensor] | None, scores: torch.Tensor, v: torch.Tensor,
           rows: torch.Tensor | None) -> list[torch.Tensor]:  # fmt: skip
    """Fold one level (scores [u, Hkv, G, K]; v [u, Hkv, K, D] or shared [Hkv, K, D]) into the
    running (max [n, Hkv, G], sum [n, Hkv, G], unnormalized output [n, Hkv, G, D])."""
    top = scores.amax(-1)
    probs = torch.exp(scores - top[..., None])
    total = probs.sum(-1)
    if v.dim() == 3:  # a shared level: [Hkv, u·G, K] @ [Hkv, K, D]
        u, kv_heads, group, keys = probs.shape
        flat = probs.transpose(0, 1).reshape(kv_heads, u * group, keys)
        acc = torch.matmul(flat, v).view(kv_heads, u, group, -1).transpose(0, 1)
    else:
        acc = torch.matmul(probs, v)
    if state is None:
        return [top, total, acc.contiguous()]
    old_top, old_total, old_acc = state if rows is None else [t[rows] for t in state]
    new_top = torch.maximum(old_top, top)
    w_old, w_new = torch.exp(old_top - new_top), torch.exp(top - new_top)
    merged = [new_top, old_total * w_old + total * w_new,
              old_acc * w_old[..., None] + acc * w_new[..., None]]  # fmt: skip
    if rows is None:
        return merged
    for t, m in zip(state, merged, strict=True):
        t[rows] = m
    return state
