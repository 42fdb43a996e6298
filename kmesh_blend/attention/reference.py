"""Plain-torch fp32 references of cascade attention.

- `attention_state`: the attention state (v, s) of queries over one masked key set — the math
  every level of every backend computes (s = log2-sum-exp of the scaled scores, as FlashInfer).
- `merge_state_reference`: the exact base-2 state merge, empty levels (s = −inf) guarded.
- `level_state_reference`: one cascade level (key positions, visibility limits, excluded rows)
  on top of `attention_state`; the torch backend of `cascade_attention`.
- `materialized_attention`: the ground truth — each sibling attends over its own materialized
  KV (shared rows re-positioned to its offsets, replaced rows taken from its unique part).

Everything runs in fp32 whatever the input dtype, under `torch.no_grad()`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kmesh_blend.ops.reference import reposition_reference

__all__ = [
    "attention_state",
    "level_state_reference",
    "materialized_attention",
    "materialized_kv",
    "merge_state_reference",
]

LOG2E = 1.0 / math.log(2.0)  # exp(x) = 2^(x · log2 e)


@torch.no_grad()
def attention_state(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of ``q`` [M, H, D] over ``k`` / ``v`` [S, Hkv, D] (H a multiple of Hkv).

    ``visible``: [M, S] bool. Returns (v [M, H, D] fp32, s [M, H] fp32) with
    s = log2 Σ_visible exp(scale · q·k); a query that sees no key gets (0, −inf).
    """
    if k.shape[0] == 0 or q.shape[0] == 0:  # an empty level: the neutral state
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        return out, torch.full(q.shape[:2], float("-inf"), device=q.device)
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, M, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    logits = (qf @ kf.transpose(1, 2)) * (scale * LOG2E)  # [H, M, S], base-2 logits
    logits = logits.masked_fill(~visible[None], float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)  # empty rows: shift 0
    p = torch.exp2(logits - peak)
    total = p.sum(dim=-1, keepdim=True)  # [H, M, 1]
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    out = (p @ vf) / total  # [H, M, D]
    s = torch.where(empty, float("-inf"), peak + torch.log2(total))[..., 0]
    return out.transpose(0, 1).contiguous(), s.transpose(0, 1).contiguous()


@torch.no_grad()
def merge_state_reference(
    va: torch.Tensor, sa: torch.Tensor, vb: torch.Tensor, sb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states over disjoint key sets: ``va``/``vb`` [n, H, D], ``sa``/``sb`` [n, H] fp32.

    Returns (v [n, H, D] fp32, s [n, H] fp32): m = max(sa, sb), w = 2^(s − m),
    v = (wa·va + wb·vb) / (wa + wb), s = m + log2(wa + wb); both empty → (0, −inf).
    """
    m = torch.maximum(sa, sb)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp2(sa - m), torch.exp2(sb - m)
    total = wa + wb
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    v = (va.float() * wa[..., None] + vb.float() * wb[..., None]) / total[..., None]
    s = torch.where(empty, float("-inf"), m + torch.log2(total))
    return v, s


@torch.no_grad()
def level_state_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_positions: torch.Tensor,
    q_limits: torch.Tensor,
    exclude: torch.Tensor | None,
    exclude_row: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One cascade level: key j is visible to query m iff ``k_positions[j] <= q_limits[m]`` and
    not ``exclude[exclude_row[m], j]``.

    ``q`` [M, H, D] (rotated into the keys' frame), ``k`` / ``v`` [S, Hkv, D], ``k_positions``
    [S] int64, ``q_limits`` [M] int64, ``exclude`` [R, S] bool or None, ``exclude_row`` [M] int64.
    Returns the state (v [M, H, D] fp32, s [M, H] fp32).
    """
    visible = k_positions[None, :] <= q_limits[:, None]
    if exclude is not None and exclude_row is not None:
        visible = visible & ~exclude.bool()[exclude_row]
    return attention_state(q, k, v, visible, scale)


@torch.no_grad()
def materialized_kv(
    segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    offsets: Sequence[int | None],
    replaced: Sequence[torch.Tensor | None],
    unique: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sibling's KV as per-request attention sees it: (k, v [T, Hkv, D], positions [T]).

    ``segments``: per segment (k, v [S, Hkv, D] rotated at positions, positions [S] int64);
    ``offsets``: the sibling's position of each segment's row 0 (None: not used);
    ``replaced``: per segment [S] bool or None; ``unique``: (k, v [U, Hkv, D], positions [U]).
    Kept shared rows are moved to their new positions by `reposition_reference` (in k's dtype,
    the way the blend materializes them); rows are concatenated in no particular order.
    """
    ks, vs, ps = [unique[0]], [unique[1]], [unique[2]]
    for (k, v, pos), offset, rep in zip(segments, offsets, replaced, strict=True):
        if offset is None:
            continue
        keep = torch.ones(k.shape[0], dtype=torch.bool) if rep is None else ~rep.cpu()
        new = offset + torch.arange(k.shape[0], dtype=torch.int64)
        delta = (new - pos.cpu())[keep].to(k.device)
        ks.append(reposition_reference(k[keep.to(k.device)], delta, inv_freq.to(k.device)))
        vs.append(v[keep.to(v.device)])
        ps.append(new[keep].to(pos.device))
    return torch.cat(ks), torch.cat(vs), torch.cat(ps)


@torch.no_grad()
def materialized_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` [n, H, D] at ``q_positions`` [n] over a materialized KV
    (``k`` / ``v`` [T, Hkv, D] at ``k_positions`` [T]): the state (v [n, H, D], s [n, H]) fp32."""
    visible = k_positions[None, :] <= q_positions[:, None]
    return attention_state(q, k, v, visible, scale)
