"""decode_cascade (one decode query per request, masters read once) against softmax attention over
each request's materialized context.

Each request's context: private rows, a copy of one or two masters at its own offset (rows rotated
on by Δ, some replaced by rows of its own), generated rows. Its own level holds everything but
the master rows it reads; the bias masks the rest. fp32: ≤ 1e-5 absolute (unit-normal values;
the paths differ by where the rotation is applied and by the order of sums). bf16 queries and
caches: the reference rotates in fp32 and rounds the moved keys to bf16 as the blend stores them,
the cascade reads the master unrounded and forms the value product in bf16: ≤ 3e-2 absolute.
"""

from __future__ import annotations

import pytest
import torch

from kmesh_blend.attention.decode import (
    MASKED,
    MasterRows,
    OwnRows,
    decode_cascade,
)
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding

HEADS, KV_HEADS, DIM, SCALE = 6, 2, 16, 0.25


def _problem(n: int, num_masters: int, replaced: float, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(RopeConfig(head_dim=DIM))
    sizes = [37, 23][:num_masters]
    firsts = [4, 0][:num_masters]
    masters = [
        (
            rope.apply(torch.randn(s, KV_HEADS, DIM, generator=gen), torch.arange(f, f + s)).to(
                dtype
            ),
            torch.randn(s, KV_HEADS, DIM, generator=gen).to(dtype),
        )
        for s, f in zip(sizes, firsts, strict=True)
    ]
    queries, want, owns, reads = [], [], [], []
    for r in range(n):
        private = 5 + 3 * r
        layout, pos = [], private
        for g, size in enumerate(sizes):
            uses = r % 3 != 2 or g == 0  # every third request skips the second master
            layout.append(pos if uses else None)
            pos += size + 2 if uses else 0
        total = pos + 4 + r  # question + generated rows
        k = rope.apply(torch.randn(total, KV_HEADS, DIM, generator=gen), torch.arange(total))
        v = torch.randn(total, KV_HEADS, DIM, generator=gen)
        k, v = k.to(dtype), v.to(dtype)
        own = torch.ones(total, dtype=torch.bool)
        request_reads = []
        for g, ((mk, mv), offset) in enumerate(zip(masters, layout, strict=True)):
            read = torch.zeros(sizes[g], dtype=torch.bool)
            if offset is not None:
                read = torch.rand(sizes[g], generator=gen) >= replaced
                delta = torch.full((sizes[g],), offset - firsts[g])
                moved = rope.apply(mk.float(), delta).to(dtype)
                k[offset : offset + sizes[g]][read] = moved[read]
                v[offset : offset + sizes[g]][read] = mv[read]
                own[offset : offset + sizes[g]] &= ~read
            request_reads.append((read, offset))
        q = rope.apply(torch.randn(1, HEADS, DIM, generator=gen), torch.tensor([total - 1]))
        q = q.to(dtype)
        group = HEADS // KV_HEADS
        scores = torch.einsum("hd,shd->hs", q[0].float(), k.float().repeat_interleave(group, 1))
        probs = (scores * SCALE).softmax(-1)
        want.append(torch.einsum("hs,shd->hd", probs, v.float().repeat_interleave(group, 1)))
        queries.append(q)
        owns.append((k[own], v[own]))
        reads.append(request_reads)
    width = max(k.shape[0] for k, _ in owns) + 3  # padding too
    k_t = torch.zeros(n, KV_HEADS, DIM, width)
    v_pad = torch.zeros(n, KV_HEADS, width, DIM)
    bias = [torch.full((n, width), MASKED)]
    for r, (k, v) in enumerate(owns):
        k_t[r, :, :, : k.shape[0]] = k.float().permute(1, 2, 0)
        v_pad[r, :, : k.shape[0]] = v.float().transpose(0, 1)
        bias[0][r, : k.shape[0]] = 0.0
    rows = []
    q_all = torch.cat(queries).float()
    for g, ((mk, mv), first) in enumerate(zip(masters, firsts, strict=True)):
        deltas = torch.tensor([(reads[r][g][1] or first) - first for r in range(n)])
        moved_q = rope.apply(q_all, -deltas)  # into the master's frame
        rows.append(
            MasterRows(mk.permute(1, 2, 0).contiguous(), mv.transpose(0, 1).contiguous(), moved_q)
        )
        bias.append(torch.stack([torch.where(reads[r][g][0], 0.0, MASKED) for r in range(n)]))
    own_rows = OwnRows(k_t.to(dtype), v_pad.to(dtype))  # in the KV dtype, as the engine keeps them
    got = decode_cascade(torch.cat(queries), own_rows, rows, torch.cat(bias, 1), SCALE)
    return got, torch.stack(want)


@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("num_masters", [1, 2])
@pytest.mark.parametrize("replaced", [0.0, 0.15, 1.0])
def test_fp32_equals_materialized_attention(n: int, num_masters: int, replaced: float) -> None:
    got, want = _problem(n, num_masters, replaced, torch.float32)
    assert got.shape == (n, HEADS, DIM) and got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("n", [1, 8])
def test_bf16_within_stated_tolerance(n: int) -> None:
    got, want = _problem(n, 2, 0.15, torch.bfloat16, seed=1)
    assert float((got - want).abs().max()) <= 3e-2


def test_a_wrong_rotation_is_caught() -> None:
    """The comparison can fail: a master read at the wrong offset changes the result."""
    got, want = _problem(4, 1, 0.15, torch.float32)
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(head_dim=DIM))
    q = torch.randn(1, HEADS, DIM, generator=gen)
    own = OwnRows(torch.randn(1, KV_HEADS, DIM, 2), torch.randn(1, KV_HEADS, 2, DIM))
    moved_q = rope.apply(q, torch.full((1,), -7))
    master = MasterRows(torch.randn(KV_HEADS, DIM, 5), torch.randn(KV_HEADS, 5, DIM), moved_q)
    right = decode_cascade(q, own, [master], torch.zeros(1, 7), SCALE)
    wrong = decode_cascade(q, own, [master._replace(q=q)], torch.zeros(1, 7), SCALE)
    assert float((right - wrong).abs().max()) > 1e-3
    assert float((got - want).abs().max()) <= 1e-5
