"""Cascade Triton kernels (TRITON_INTERPRET=1 on the CPU) against the fp32 torch references.

Tolerances: level states and merges in fp32 ≤ 2e-6 on v (exp2/log2/cos/sin differ by ulps
between NumPy and torch) and on s; bf16 inputs are converted right after loading, so bf16
results match the fp32 reference of the same bf16 inputs to the same tolerance. Empty levels
must give exactly (0, −inf).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kmesh_blend.attention import cascade_attention, level_state, merge_state
from kmesh_blend.attention.backend import run_self_check
from kmesh_blend.attention.reference import attention_state
from kmesh_blend.ops import dispatch
from tests.attention.problems import ROPES, ground_truth, make_problem

GEN = torch.Generator().manual_seed(0)
INV_FREQ = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)


def _level_inputs(m: int, heads: int, kv_heads: int, s: int, dtype: torch.dtype) -> tuple:
    q = torch.randn(m, heads, 32, generator=GEN).to(dtype)
    k = torch.randn(s, kv_heads, 32, generator=GEN).to(dtype)
    v = torch.randn(s, kv_heads, 32, generator=GEN).to(dtype)
    k_pos = torch.arange(40, 40 + s)
    q_lim = torch.randint(30, 40 + s + 5, (m,), generator=GEN)
    q_lim[0] = 10  # sees nothing: the empty state
    return q, k, v, k_pos, q_lim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shift", [False, True], ids=["noshift", "shift"])
@pytest.mark.parametrize("exclude", [False, True], ids=["all", "exclude"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_level_kernel_matches_reference(
    heads: int, kv_heads: int, exclude: bool, shift: bool, dtype: torch.dtype
) -> None:
    q, k, v, k_pos, q_lim = _level_inputs(11, heads, kv_heads, 45, dtype)  # 45: partial tile
    ex = torch.rand(3, 45, generator=GEN) < 0.3 if exclude else None
    ex_row = torch.randint(0, 3, (11,), generator=GEN) if exclude else None
    q_shift = torch.randint(-2000, 2000, (11,), generator=GEN) if shift else None
    freq = INV_FREQ if shift else None
    args = (q, k, v, k_pos, q_lim, 0.17, ex, ex_row, q_shift, freq)
    got_v, got_s = level_state(*args, backend="triton")
    want_v, want_s = level_state(*args, backend="torch")
    assert got_v.dtype == got_s.dtype == torch.float32
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=2e-6)
    assert torch.equal(got_v[0], torch.zeros_like(got_v[0]))
    assert bool(torch.isneginf(got_s[0]).all())


def _states(n: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    va, vb = torch.randn(2, n, heads, 32, generator=GEN)
    sa, sb = torch.randn(2, n, heads, generator=GEN) * 20
    sa[0], sb[1] = float("-inf"), float("-inf")  # one side empty
    sa[2], sb[2] = float("-inf"), float("-inf")  # both empty
    sa[3], sb[3] = 150.0, -150.0  # far apart: 2^-300 underflows to 0 in fp32
    return va, sa, vb, sb


@pytest.mark.parametrize("heads", [1, 3, 8])
def test_merge_kernel_matches_reference_and_guards_empty(heads: int) -> None:
    va, sa, vb, sb = _states(37, heads)
    got_v, got_s = merge_state(va, sa, vb, sb, backend="triton")
    want_v, want_s = merge_state(va, sa, vb, sb, backend="torch")
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_v[0], vb[0])  # empty A: B unchanged
    torch.testing.assert_close(got_v[1], va[1])
    assert torch.equal(got_v[2], torch.zeros_like(va[2])) and bool(torch.isneginf(got_s[2]).all())
    torch.testing.assert_close(got_v[3], va[3])
    assert not bool(got_v.isnan().any())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_merge_of_split_key_set_equals_whole(backend: str) -> None:
    """merge(state(A), state(B)) == attention over A ∪ B (torch SDPA), s == log2-sum-exp."""
    q, k, v, _, _ = _level_inputs(9, 4, 2, 50, torch.float32)
    split = torch.rand(50, generator=GEN) < 0.4
    visible = torch.rand(9, 50, generator=GEN) < 0.7
    visible[:, 0] = True
    a = attention_state(q, k, v, visible & split, 0.2)
    b = attention_state(q, k, v, visible & ~split, 0.2)
    got_v, got_s = merge_state(*a, *b, backend=backend)  # type: ignore[arg-type]
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=visible, scale=0.2, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(got_v, want, rtol=0, atol=1e-5)
    scores = torch.einsum("mhd,nhd->hmn", q, k.repeat_interleave(2, dim=1)) * 0.2
    lse2 = scores.masked_fill(~visible[None], float("-inf")).logsumexp(-1).T / math.log(2)
    torch.testing.assert_close(got_s, lse2, rtol=0, atol=1e-5)


CASES = [  # (siblings, heads, kv_heads, placement, replaced, segments, rope, dtype)
    (1, 4, 4, "zero", 0.0, 1, "default", torch.float32),
    (2, 4, 2, "end", 0.15, 2, "llama3", torch.float32),
    (8, 8, 2, "zero", 0.15, 2, "default", torch.float32),
    (8, 4, 1, "end", 1.0, 1, "llama3", torch.float32),
    (2, 4, 2, "middle", 1.0, 2, "default", torch.float32),
    (8, 8, 2, "end", 0.15, 2, "llama3", torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])) + f"-{c[7]}")
def test_triton_cascade_equals_materialized(case: tuple) -> None:
    *shape, dtype = case
    p = make_problem(*shape, dtype=dtype)
    assert shape[-1] in ROPES
    got = cascade_attention(p.siblings, p.segments, p.scale, p.inv_freq, backend="triton")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, ground_truth(p), strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w.to(dtype).float(), rtol=0, atol=tol)


def test_self_check_passes_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_self_check("triton", "cpu") is None
    assert run_self_check("torch", "cpu", torch.bfloat16) is None
    import kmesh_blend.attention.cascade as cascade

    def wrong_merge(va, sa, vb, sb, backend="torch"):  # type: ignore[no-untyped-def]
        return merge_state(va, sa, vb, sb - 1.0, backend=backend)  # B under-weighted by half

    monkeypatch.setattr(cascade, "merge_state", wrong_merge)
    assert "differs from the reference" in (run_self_check("torch", "cpu") or "")
    assert run_self_check("flashinfer", "cpu") is not None  # no CUDA here: refused, with a reason


def test_kernel_self_checks_pass_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-kernel checks registered with `kmesh_blend.ops.dispatch` (used by "auto")."""
    for kernel in ("level_attention_kernel", "merge_state_kernel"):
        assert dispatch.run_self_check(kernel, "cpu") is None
    import kmesh_blend.attention.reference as ref

    true_level = ref.level_state_reference

    def wrong_level(*args, **kwargs):  # type: ignore[no-untyped-def]
        v, s = true_level(*args, **kwargs)
        return v, s + 1e-3  # a small error in the log2-sum-exp only

    monkeypatch.setattr(ref, "level_state_reference", wrong_level)
    failure = dispatch.run_self_check("level_attention_kernel", "cpu") or ""
    assert failure.startswith("level_attention_kernel: level log2-sum-exp differs")


def test_auto_on_cpu_takes_the_reference_and_backends_are_validated() -> None:
    va, sa, vb, sb = _states(5, 2)
    auto = merge_state(va, sa, vb, sb, backend="auto")
    want = merge_state(va, sa, vb, sb, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(auto, want, strict=True))
    with pytest.raises(ValueError, match="valid: 'auto', 'torch', 'triton', 'flashinfer'"):
        merge_state(va, sa, vb, sb, backend="cuda")  # type: ignore[arg-type]
