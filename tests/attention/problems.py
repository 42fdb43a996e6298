"""Random cascade problems and their ground truth (attention over each materialized KV)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kmesh_blend.attention import SharedSegment, Sibling
from kmesh_blend.attention.reference import materialized_kv
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding

ROPES = {
    "default": RopeConfig(head_dim=32),
    "llama3": RopeConfig(
        head_dim=32, theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=64
    ),
}


class Problem(NamedTuple):
    siblings: list[Sibling]
    segments: list[SharedSegment]
    scale: float
    inv_freq: torch.Tensor


def make_problem(
    num_siblings: int,
    heads: int,
    kv_heads: int,
    placement: str,
    replaced_frac: float,
    num_segments: int,
    rope: str = "default",
    dtype: torch.dtype = torch.float32,
    seg_len: int = 24,
    seed: int = 0,
) -> Problem:
    """Siblings = [prefix] seg0 [gap] seg1 … [suffix], queries at a random third of positions.

    ``placement``: ``"zero"`` (first segment at offset 0), ``"end"`` (last segment ends the
    context), ``"middle"``. Sibling 2, 5, … skip the last segment when there are several. Masters
    sit at positions 100·g + 3 (segment g), so every sibling's shift Δ is non-zero somewhere.
    """
    gen = torch.Generator().manual_seed(seed)
    dim = ROPES[rope].head_dim
    inv_freq = RotaryEmbedding(ROPES[rope]).inv_freq

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    segments = [
        SharedSegment(
            rand(seg_len, kv_heads, dim),
            rand(seg_len, kv_heads, dim),
            torch.arange(100 * g + 3, 100 * g + 3 + seg_len),
        )
        for g in range(num_segments)
    ]
    siblings = []
    for i in range(num_siblings):
        used = [g for g in range(num_segments) if not (g == num_segments - 1 and i % 3 == 2)]
        used = used or [0]
        cursor = 0 if placement == "zero" else randint(1, 6 + 3 * i)
        offsets: list[int | None] = [None] * num_segments
        replaced: list[torch.Tensor | None] = [None] * num_segments
        shared = torch.zeros(0, dtype=torch.int64)
        for g in used:
            offsets[g] = cursor
            rep = torch.rand(seg_len, generator=gen) < replaced_frac
            replaced[g] = rep
            kept = cursor + (~rep).nonzero().squeeze(1)
            shared = torch.cat((shared, kept))
            cursor += seg_len + (randint(0, 4) if g != used[-1] else 0)
        total = cursor + (0 if placement == "end" else randint(1, 6))
        own = torch.ones(total, dtype=torch.bool)
        own[shared] = False
        kv_pos = own.nonzero().squeeze(1)
        q_pick = torch.rand(total, generator=gen) < 0.34
        q_pick[total - 1] = True
        q_pos = q_pick.nonzero().squeeze(1)
        siblings.append(
            Sibling(
                rand(q_pos.numel(), heads, dim),
                q_pos,
                offsets,
                replaced,
                rand(kv_pos.numel(), kv_heads, dim),
                rand(kv_pos.numel(), kv_heads, dim),
                kv_pos,
            )
        )
    return Problem(siblings, segments, dim**-0.5, inv_freq)


def ground_truth(problem: Problem) -> list[torch.Tensor]:
    """Per sibling [n, H, D] fp32: torch SDPA over its materialized KV (shared rows moved to its
    offsets by `reposition_reference`, in the KV dtype as the blend stores them)."""
    outs = []
    for sib in problem.siblings:
        k, v, pos = materialized_kv(
            [(s.k, s.v, s.positions) for s in problem.segments],
            sib.offsets,
            sib.replaced,
            (sib.k, sib.v, sib.kv_positions),
            problem.inv_freq,
        )
        mask = pos[None, :] <= sib.q_positions[:, None]
        out = F.scaled_dot_product_attention(
            sib.q.float().transpose(0, 1),
            k.float().transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=mask,
            scale=problem.scale,
            enable_gqa=True,
        )
        outs.append(out.transpose(0, 1))
    return outs
