"""Triton kernels (under TRITON_INTERPRET=1 on the CPU) against their fp32 torch references.

Data movement (paged scatter/gather) must be exact; float math has stated tolerances:
re-positioning — sin/cos implementations differ by ulps (fp32 ≤ 2e-5 on |k| ≈ 3; fp16/bf16 one
ulp of the output); deviation — summation order differs (fp32 relative 1e-5).
"""

import pytest
import torch

from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.ops import gather_paged, reposition_keys, scatter_paged, token_deviation
from kmesh_blend.ops.reference import reposition_reference
from kmesh_blend.ops.selfcheck import run_self_check

GEN = torch.Generator().manual_seed(0)
ROPES = {
    "default": RopeConfig(head_dim=64),
    "llama3": RopeConfig(
        head_dim=64, theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=256
    ),
}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def _keys(n: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, heads, dim, generator=GEN).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
@pytest.mark.parametrize("heads", [1, 2, 3])
def test_reposition_kernel_matches_reference(
    rope: RopeConfig, dtype: torch.dtype, heads: int
) -> None:
    inv_freq = RotaryEmbedding(rope).inv_freq
    k = _keys(19, heads, 64, dtype)
    delta = torch.randint(-3000, 3000, (19,), generator=GEN)
    delta[0] = 0  # zero shift is the identity
    got = reposition_keys(k, delta, inv_freq, backend="triton")
    want = reposition_reference(k, delta, inv_freq)
    assert got.dtype == dtype and got.shape == k.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype] * 3)
    torch.testing.assert_close(got[0].float(), k[0].float(), rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_reposition_equals_rotating_at_the_new_position(rope: RopeConfig) -> None:
    """Moving keys rotated at p to p + d equals rotating the raw keys at p + d."""
    r = RotaryEmbedding(rope)
    raw = _keys(40, 2, 64, torch.float32)
    old = torch.arange(40) * 7
    new = torch.arange(40) + 1000
    moved = reposition_keys(r.apply(raw, old), new - old, r.inv_freq, backend="torch")
    # fp32 angles near 1e3 rad carry ≈ 6e-5 rad of rounding, so |k| ≈ 3 allows ≈ 2e-4.
    torch.testing.assert_close(moved, r.apply(raw, new), rtol=0, atol=3e-4)


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_reposition_matches_lmcache_torch_fallback(rope: RopeConfig) -> None:
    """Independent cross-check: LMCache 0.5.6's undo/redo RoPE fallback, fed our frequencies."""
    from lmcache.v1.platform.torch_ops.pos_kernels import rotary_embedding_k_fused

    from kmesh_blend.compat import guard_llvmlite

    guard_llvmlite()  # this import loads llvmlite; later vLLM starts in this process

    r = RotaryEmbedding(rope)
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * r.inv_freq[None, :]
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [positions, D]
    k = _keys(33, 2, 64, torch.float32)
    old = torch.randint(0, 1024, (33,), generator=GEN)
    new = torch.randint(0, 2048, (33,), generator=GEN)
    theirs = k.clone()
    rotary_embedding_k_fused(old, new, theirs, 64, cos_sin_cache, True)
    ours = reposition_keys(k, new - old, r.inv_freq, backend="triton")
    torch.testing.assert_close(
        ours, theirs, rtol=0, atol=5e-4
    )  # two fp32 rotations at angles up to 2e3 rad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 32), (17, 2, 64), (5, 3, 48)])
def test_deviation_kernel_matches_reference(
    shape: tuple[int, int, int], dtype: torch.dtype
) -> None:
    a, b = _keys(*shape, dtype), _keys(*shape, dtype)
    got = token_deviation(a, b, backend="triton")
    want = token_deviation(a, b, backend="torch")
    assert got.dtype == torch.float32 and got.shape == (shape[0],)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(token_deviation(a, a, backend="triton"), torch.zeros(shape[0]))


def _layouts(blocks: int, heads: int, bs: int, dim: int, dtype: torch.dtype) -> dict:
    """[block, head, offset, dim] views of the paged layouts we write into."""
    nhd = torch.zeros(blocks, bs, heads, dim, dtype=dtype)  # CUDA flash layout (K or V)
    hnd = torch.zeros(blocks, heads, bs, dim, dtype=dtype)
    k_transposed = torch.zeros(blocks, heads, dim, bs, dtype=dtype)  # vLLM CPU K, fp32
    return {
        "nhd": nhd.permute(0, 2, 1, 3),
        "hnd": hnd,
        "cpu_k_transposed": k_transposed.permute(0, 1, 3, 2),
    }


@pytest.mark.parametrize("layout", ["nhd", "hnd", "cpu_k_transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [0, 1, 45])
def test_paged_scatter_gather_exact(layout: str, dtype: torch.dtype, n: int) -> None:
    bs = 16
    rows = _keys(n, 2, 32, dtype)
    slots = torch.randperm(3 * bs, generator=GEN)[:n]  # partial last block included
    triton_cache = _layouts(3, 2, bs, 32, dtype)[layout]
    torch_cache = _layouts(3, 2, bs, 32, dtype)[layout]
    scatter_paged(rows, triton_cache, slots, bs, backend="triton")
    scatter_paged(rows, torch_cache, slots, bs, backend="torch")
    assert torch.equal(triton_cache, torch_cache)
    assert torch.equal(gather_paged(triton_cache, slots, bs, backend="triton"), rows)
    untouched = torch.ones(3 * bs, dtype=torch.bool)
    untouched[slots] = False
    other = gather_paged(torch_cache, untouched.nonzero().squeeze(1), bs, backend="torch")
    assert torch.equal(other, torch.zeros_like(other))


def test_launchers_validate_inputs() -> None:
    k = _keys(4, 2, 64, torch.float32)
    inv = RotaryEmbedding(ROPES["default"]).inv_freq
    with pytest.raises(ValueError, match="delta"):
        reposition_keys(k, torch.zeros(3, dtype=torch.int64), inv)
    with pytest.raises(ValueError, match="inv_freq"):
        reposition_keys(k, torch.zeros(4, dtype=torch.int64), inv[:5])
    with pytest.raises(ValueError, match="dims"):
        token_deviation(k[0], k[0])
    with pytest.raises(ValueError, match="stored"):
        token_deviation(k, k[:2])
    cache = _layouts(2, 2, 16, 64, torch.float32)["hnd"]
    with pytest.raises(ValueError, match="slots out of range"):
        scatter_paged(k, cache, torch.tensor([0, 1, 2, 32]), 16)
    with pytest.raises(ValueError, match="block_size"):
        scatter_paged(k, cache, torch.arange(4), 8)
    with pytest.raises(ValueError, match="backend"):
        token_deviation(k, k, backend="cuda")  # type: ignore[arg-type]


def test_self_check_passes_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_self_check("cpu") is None
    import kmesh_blend.ops.reference as ref

    monkeypatch.setattr(ref, "deviation_reference", lambda a, b: torch.zeros(a.shape[0]))
    assert "deviation_kernel" in (run_self_check("cpu") or "")
