"""cascade_attention (torch backend) against attention over each sibling's materialized KV.

Tolerances: fp32 ≤ 1e-5 absolute (outputs are convex combinations of unit-normal values; the two
paths differ only by rounding in where the rotation is applied and in the merge). bf16: inputs in
bf16, the reference materializes re-positioned keys in bf16 as the blend stores them (one bf16
rounding the cascade avoids), then both attend in fp32 and round the output to bf16:
≤ 3e-2 absolute (≈ 4 bf16 ulps at |out| ≈ 1).
"""

import pytest
import torch
import torch.nn.functional as F

from kmesh_blend.attention import SharedSegment, Sibling, cascade_attention
from kmesh_blend.models.rope import RotaryEmbedding
from tests.attention.problems import ROPES, Problem, ground_truth, make_problem

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _max_err(problem: Problem, backend: str = "torch") -> float:
    got = cascade_attention(
        problem.siblings, problem.segments, problem.scale, problem.inv_freq, backend=backend
    )
    want = ground_truth(problem)
    errs = []
    for g, w, sib in zip(got, want, problem.siblings, strict=True):
        assert g.shape == sib.q.shape and g.dtype == sib.q.dtype
        errs.append(float((g.float() - w.to(g.dtype).float()).abs().max()) if g.numel() else 0.0)
    return max(errs)


@pytest.mark.parametrize("rope", ROPES.keys())
@pytest.mark.parametrize("num_segments", [1, 2])
@pytest.mark.parametrize("replaced_frac", [0.0, 0.15, 1.0])
@pytest.mark.parametrize("placement", ["zero", "end"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("num_siblings", [1, 2, 8])
def test_fp32_equals_materialized(
    num_siblings: int,
    heads: int,
    kv_heads: int,
    placement: str,
    replaced_frac: float,
    num_segments: int,
    rope: str,
) -> None:
    p = make_problem(num_siblings, heads, kv_heads, placement, replaced_frac, num_segments, rope)
    assert _max_err(p) <= TOL[torch.float32]


@pytest.mark.parametrize("rope", ROPES.keys())
@pytest.mark.parametrize("replaced_frac", [0.0, 0.15, 1.0])
@pytest.mark.parametrize("num_siblings", [1, 8])
def test_bf16_within_stated_tolerance(num_siblings: int, replaced_frac: float, rope: str) -> None:
    p = make_problem(num_siblings, 8, 2, "end", replaced_frac, 2, rope, dtype=torch.bfloat16)
    assert _max_err(p) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("rope", ROPES.keys())
def test_rope_algebra_against_raw_keys(rope: str) -> None:
    """Independent of re-positioning: raw keys rotated at master positions (the master) vs the
    same raw keys rotated directly at each sibling's positions. fp32 angles of ~1e2 rad carry
    ~1e-5 rad of rounding, hence 1e-4."""
    r = RotaryEmbedding(ROPES[rope])
    gen = torch.Generator().manual_seed(1)
    raw_k, v = torch.randn(30, 2, 32, generator=gen), torch.randn(30, 2, 32, generator=gen)
    master = torch.arange(50, 80)
    seg = SharedSegment(r.apply(raw_k, master), v, master)
    sibs, want = [], []
    for offset in (0, 7, 130):
        q_pos = torch.arange(offset, offset + 30)
        q = r.apply(torch.randn(30, 4, 32, generator=gen), q_pos)
        empty = torch.zeros(0, 2, 32)
        sibs.append(Sibling(q, q_pos, [offset], [None], empty, empty, q_pos[:0]))
        k_new = r.apply(raw_k, q_pos).transpose(0, 1)
        causal = torch.ones(30, 30, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k_new, v.transpose(0, 1), attn_mask=causal,
            scale=32**-0.5, enable_gqa=True,
        )  # fmt: skip
        want.append(out.transpose(0, 1))
    got = cascade_attention(sibs, [seg], 32**-0.5, r.inv_freq, backend="torch")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


def test_guard_wrong_mask_or_offset_fails() -> None:
    """The comparison can fail: ignoring replaced rows, or an offset off by one, is caught."""
    p = make_problem(2, 4, 2, "middle", 0.15, 1, "llama3")
    want = ground_truth(p)
    s0 = p.siblings[0]
    assert s0.offsets[0] is not None and bool(s0.replaced[0].any())  # type: ignore[union-attr]
    for wrong in (s0._replace(replaced=[None]), s0._replace(offsets=[s0.offsets[0] + 1])):
        got = cascade_attention([wrong], p.segments, p.scale, p.inv_freq, backend="torch")
        assert float((got[0] - want[0]).abs().max()) > 100 * TOL[torch.float32]


def test_sibling_without_queries_and_unused_segment() -> None:
    p = make_problem(3, 4, 2, "middle", 0.15, 2)
    s1 = p.siblings[1]
    idle = s1._replace(q=s1.q[:0], q_positions=s1.q_positions[:0])
    unused = SharedSegment(p.segments[0].k, p.segments[0].v, p.segments[0].positions + 500)
    sibs = [s._replace(offsets=[*s.offsets, None], replaced=[*s.replaced, None])
            for s in (p.siblings[0], idle, p.siblings[2])]  # fmt: skip
    got = cascade_attention(sibs, [*p.segments, unused], p.scale, p.inv_freq, backend="torch")
    want = ground_truth(p)
    assert got[1].shape == (0, 4, 32)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5)


def test_auto_backend_on_cpu_is_torch_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    from kmesh_blend.attention.backend import chosen_backend

    chosen_backend.cache_clear()
    with caplog.at_level("INFO", logger="kmesh_blend.attention"):
        assert chosen_backend(torch.device("cpu"), torch.float32) == "torch"
    assert "torch backend on cpu" in caplog.text
    p = make_problem(2, 4, 2, "zero", 0.15, 1)
    assert _max_err(p, backend="auto") <= TOL[torch.float32]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s, g: (s._replace(q_positions=s.q_positions[1:]), g), "q_positions"),
        (lambda s, g: (s._replace(offsets=[*s.offsets, 0]), g), "one offset"),
        (lambda s, g: (s, g._replace(positions=g.positions * 2)), "contiguous"),
        (lambda s, g: (s._replace(replaced=[torch.zeros(3, dtype=torch.bool)]), g), "replaced"),
    ],
)
def test_bad_inputs_name_the_problem(change, match: str) -> None:  # type: ignore[no-untyped-def]
    p = make_problem(1, 4, 2, "middle", 0.15, 1)
    sib, seg = change(p.siblings[0], p.segments[0])
    with pytest.raises(ValueError, match=match):
        cascade_attention([sib], [seg], p.scale, p.inv_freq, backend="torch")
