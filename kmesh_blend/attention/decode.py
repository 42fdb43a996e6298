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

__all__ = ["MASKED", "MasterRows", "OwnRows", "decode_cascade"]

# Additive score bias of a masked key (a padding row, or a master row a request does not read).
# Finite, so that a row masked everywhere gives exp(−1e30 − max) = 0, never 0/0.
MASKED = -1.0e30


class OwnRows(NamedTuple):
    """Each request's own rows, padded to U: k_t [n, Hkv, D, U] (keys, transposed for the score
    product; fp32, or converted on use) and v [n, Hkv, U, D] (fp32, or 16-bit: see
    `decode_cascade`)."""

    k_t: torch.Tensor
    v: torch.Tensor


class MasterRows(NamedTuple):
    """A shared master: k_t [Hkv, D, S] (keys rotated at the master's positions, transposed; fp32,
    or converted on use), v [Hkv, S, D] (fp32, or 16-bit: see `decode_cascade`), and q [n, H, D]
    fp32, each request's query rotated on by −Δ into the master's frame (the model's
    `RotaryEmbedding.apply` at positions −Δ)."""

    k_t: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor


def decode_cascade(
    q: torch.Tensor, own: OwnRows, masters: Sequence[MasterRows], bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one decode query per request over its own rows and the shared masters.

    q: [n, H, D] (rotated at each request's position), any float dtype. bias: [n, U + ΣS] fp32
    over the keys in order (own rows, then each master's): 0 where the request reads the row,
    `MASKED` where not (padding; a master row its own copy replaced, or a master it does not
    read). Each master's K/V are read once for all n queries: one product per KV head covers
    them all. Returns [n, H, D] fp32: softmax attention over each request's materialized
    context, summed in another order.

    Precision: scores and softmax in fp32 always; with fp32 values everything is fp32 (within
    1e-5 of attention over the materialized context). 16-bit values make the value product run
    in their dtype (the weights rounded to it, ≈ 2⁻⁹ relative, and each product's output): half
    the cost, but further from vLLM's kernel, so the vLLM path passes fp32 values.
    """
    n, heads, dim = q.shape
    kv_heads, _, width = own.k_t.shape[1:]
    group = heads // kv_heads
    qf = q.float().view(n, kv_heads, group, dim)
    parts = [
        torch.bmm(
            qf.reshape(n * kv_heads, group, dim), own.k_t.reshape(n * kv_heads, dim, width).float()
        ).view(n, kv_heads, group, width)
    ]
    for m in masters:
        qm = m.q.view(n, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, n * group, dim)
        parts.append(torch.bmm(qm, m.k_t.float()).view(kv_heads, n, group, -1).transpose(0, 1))
    scores = torch.cat(parts, dim=-1).mul_(scale).add_(bias[:, None, None, :])
    probs = torch.softmax(scores, dim=-1).to(own.v.dtype)  # [n, Hkv, G, U + ΣS]
    out = (
        torch.bmm(
            probs[..., :width].reshape(n * kv_heads, group, width),
            own.v.reshape(n * kv_heads, width, dim),
        )
        .view(n, kv_heads, group, dim)
        .float()
    )
    start = width
    for m in masters:
        size = m.k_t.shape[-1]
        p = probs[..., start : start + size].transpose(0, 1).reshape(kv_heads, n * group, size)
        out += torch.bmm(p, m.v).view(kv_heads, n, group, dim).transpose(0, 1).float()
        start += size
    return out.view(n, heads, dim)
