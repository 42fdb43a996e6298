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

__all__ = ["MASKED", "SharedLevel", "decode_cascade", "rotation_tables"]

# Additive score bias of a masked key. Finite, so a level whose keys are all masked for a query
# yields a finite state whose merge weight underflows to exactly 0 (−inf would give 0/0).
MASKED = -1.0e30


class SharedLevel(NamedTuple):
    """One shared master and the rows of this step's queries that read it.

    k / v: [Hkv, S, D] fp32 (k rotated at the master's positions). users: [u] int64 rows of the
    step's queries. cos / signed_sin: [u, D] fp32, the rotation by −Δ of each user
    (`rotation_tables`). bias: [u, S] fp32, 0 where the user reads the master row, `MASKED`
    where its own copy differs (those rows are in its unique level).
    """

    k: torch.Tensor
    v: torch.Tensor
    users: torch.Tensor
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
    q: torch.Tensor,
    unique_k: torch.Tensor,
    unique_v: torch.Tensor,
    unique_bias: torch.Tensor,
    shared: Sequence[SharedLevel],
    scale: float,
) -> torch.Tensor:
    """Attention of one decode query per request over its unique rows and the shared masters.

    q: [n, H, D] (rotated at each request's position). unique_k / unique_v: [n, U, Hkv, D], each
    request's own rows, padded to U; unique_bias: [n, U] fp32 (0 real row, `MASKED` padding).
    Returns [n, H, D] fp32, equal to softmax attention over each request's materialized context
    (fp32: within 1e-5 of vLLM's kernel, measured by the start-up self-check).
    """
    n, heads, dim = q.shape
    kv_heads = unique_k.shape[2]
    group = heads // kv_heads
    qf = q.float().view(n, kv_heads, group, dim)
    # Unique level, batched over requests: [n, Hkv, G, U].
    scores = torch.matmul(qf, unique_k.float().permute(0, 2, 3, 1)) * scale
    scores += unique_bias[:, None, None, :]
    top = scores.amax(-1)
    probs = torch.exp(scores - top[..., None])
    total = probs.sum(-1)
    acc = torch.matmul(probs, unique_v.float().transpose(1, 2))  # [n, Hkv, G, D]
    top, total, acc = top.view(n, heads), total.view(n, heads), acc.view(n, heads, dim)
    for level in shared:
        u = level.users.numel()
        if u == 0:
            continue
        qu = qf.view(n, heads, dim)[level.users]
        half = dim // 2
        swapped = torch.cat((qu[..., half:], qu[..., :half]), dim=-1)
        qu = qu * level.cos[:, None, :] + swapped * level.signed_sin[:, None, :]
        # [Hkv, u·G, D] so that one matmul per KV head covers every reader of the master.
        qu = qu.view(u, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, u * group, dim)
        s = torch.matmul(qu, level.k.transpose(1, 2)) * scale  # [Hkv, u·G, S]
        s = s.view(kv_heads, u, group, -1) + level.bias[None, :, None, :]
        m = s.amax(-1)
        p = torch.exp(s - m[..., None])
        t = p.sum(-1)
        a = torch.matmul(p.view(kv_heads, u * group, -1), level.v)  # [Hkv, u·G, D]
        m = m.transpose(0, 1).reshape(u, heads)
        t = t.transpose(0, 1).reshape(u, heads)
        a = a.view(kv_heads, u, group, dim).transpose(0, 1).reshape(u, heads, dim)
        rows = level.users
        old_top = top[rows]
        new_top = torch.maximum(old_top, m)
        w_old, w_new = torch.exp(old_top - new_top), torch.exp(m - new_top)
        total[rows] = total[rows] * w_old + t * w_new
        acc[rows] = acc[rows] * w_old[..., None] + a * w_new[..., None]
        top[rows] = new_top
    return acc / total[..., None]
