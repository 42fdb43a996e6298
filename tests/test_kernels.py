"""Triton kernels (under TRITON_INTERPRET=1 on the CPU) against their fp32 torch references.

Data movement (paged scatter/gather) must be exact; float math has stated tolerances:
re-positioning — sin/cos implementations differ by ulps (fp32 ≤ 2e-5 on |k| ≈ 3; fp16/bf16 one
ulp of the output); deviation — summation order differs (fp32 relative 1e-5).
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.ops import dispatch, gather_paged, reposition_keys, scatter_paged, token_deviation
from kmesh_blend.ops.reference import reposition_reference
from kmesh_blend.ops.selfcheck import KERNELS, run_self_check

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


@pytest.mark.parametrize("layout", ["nhd", "hnd", "cpu_k_transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plain_torch_gather_reads_what_the_reference_reads(layout: str, dtype: torch.dtype) -> None:
    bs, blocks = 16, 5
    cache = _layouts(blocks, 3, bs, 32, dtype)[layout]
    cache.copy_(torch.randn(cache.shape, generator=GEN).to(dtype))
    last = blocks * bs - 1
    for slots in (torch.randperm(blocks * bs, generator=GEN)[:57], torch.arange(19, 67),
                  torch.tensor([last, 0]), torch.zeros(0, dtype=torch.int64)):  # fmt: skip
        want = gather_paged(cache, slots, bs, backend="torch")  # the reference
        assert torch.equal(gather_paged(cache, slots, bs), want)
    # a view into a larger tensor (K and V of one cache): offsets stay the view's own
    both = torch.randn(2, blocks, 3, bs, 32, generator=GEN).to(dtype)
    for slots in (torch.randperm(blocks * bs, generator=GEN)[:40], torch.tensor([last, 0, 3])):
        want = gather_paged(both[1], slots, bs, "torch")  # whole blocks, then scattered rows
        assert torch.equal(gather_paged(both[1], slots, bs), want)


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


def test_each_ops_kernel_has_a_passing_self_check() -> None:
    assert set(KERNELS) <= set(dispatch.registered_kernels())
    for kernel in KERNELS:
        assert dispatch.run_self_check(kernel, "cpu") is None, kernel


# --- the shared self-check registry, with a deliberately wrong kernel ---------------------------


@triton.jit
def _scale_kernel(x_ptr, out_ptr, N: tl.constexpr, FACTOR: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(x_ptr + i) * FACTOR)


_FACTOR = {"good_double_kernel": 2.0, "wrong_double_kernel": 3.0, "broken_double_kernel": 2.0}


def _double(x: torch.Tensor, kernel: str, backend: str = "auto") -> torch.Tensor:
    """A launcher in the shared pattern: x [16] fp32 → 2·x (the wrong kernel gives 3·x)."""
    if dispatch.use_triton(backend, x, kernel):
        if kernel == "broken_double_kernel":
            raise RuntimeError("no such device function")  # a failed compile, say
        out = torch.empty_like(x)
        _scale_kernel[(1,)](x, out, N=x.numel(), FACTOR=_FACTOR[kernel])
        return out
    return x * 2.0  # the fp32 reference


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The registry with three test kernels; "auto" considers Triton on the CPU (interpreter)."""
    monkeypatch.setattr(dispatch, "_CHECKS", dict(dispatch._CHECKS))
    monkeypatch.setattr(dispatch, "KERNEL_DEVICES", ("cuda", "cpu"))
    for name in _FACTOR:

        @dispatch.self_check(name)
        def check(device: torch.device, name: str = name) -> None:
            x = torch.arange(16, dtype=torch.float32)
            dispatch.expect_close("doubled", _double(x.to(device), name, "triton"), x * 2.0)

    dispatch.reset_self_checks()
    yield
    dispatch.reset_self_checks()


@pytest.mark.usefixtures("registry")
def test_shared_self_check_disables_a_wrong_kernel(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.arange(16, dtype=torch.float32)
    assert "wrong_double_kernel: doubled differs" in (
        dispatch.run_self_check("wrong_double_kernel", "cpu") or ""
    )
    assert torch.equal(_double(x, "wrong_double_kernel", "triton"), 3.0 * x)  # guard: it is wrong
    with caplog.at_level(logging.INFO, logger="kmesh_blend.ops"):
        for _ in range(3):  # checked once: one log line per (kernel, device)
            assert torch.equal(_double(x, "wrong_double_kernel"), 2.0 * x)  # the reference path
            assert torch.equal(_double(x, "good_double_kernel"), 2.0 * x)  # the kernel
    assert not dispatch.kernel_ok("wrong_double_kernel", torch.device("cpu"))
    assert dispatch.kernel_ok("good_double_kernel", torch.device("cpu"))
    ours = [r for r in caplog.records if r.name == "kmesh_blend.ops"]
    warnings = [r for r in ours if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and len(ours) == 2  # one warning, one "passed" line
    assert "wrong_double_kernel disabled on cpu" in warnings[0].getMessage()
    assert "max |error| 15" in warnings[0].getMessage()  # 3·15 − 2·15: the error is named


@pytest.mark.usefixtures("registry")
def test_shared_self_check_disables_a_kernel_that_raises(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.arange(16, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="kmesh_blend.ops"):
        assert torch.equal(_double(x, "broken_double_kernel"), 2.0 * x)
    assert "broken_double_kernel disabled on cpu" in caplog.text
    assert "RuntimeError: no such device function" in caplog.text
    with pytest.raises(KeyError):
        dispatch.run_self_check("unregistered_kernel", "cpu")
    with pytest.raises(ValueError, match="valid: 'auto', 'torch', 'triton'"):
        dispatch.resolve("cuda", x, "good_double_kernel")
    assert dispatch.resolve("flashinfer", x, "good_double_kernel", ("flashinfer",)) == "flashinfer"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_gpu_check_without_cuda_exits_2(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "r.json")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr and not (tmp_path / "r.json").exists()


def test_rotation_tables_are_kept_per_shift_tensor_and_within_a_byte_budget() -> None:
    """The blend passes each segment use's shift tensor again layer after layer: with several
    segments in a prompt, each keeps its tables (one entry thrashed); old ones go past the
    budget."""
    from kmesh_blend.ops import reference

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    a, b = torch.arange(7), torch.full((7,), 3)
    first = reference.rope_tables(a, inv_freq), reference.rope_tables(b, inv_freq)
    again = reference.rope_tables(a, inv_freq), reference.rope_tables(b, inv_freq)
    assert all(x[0] is y[0] and x[1] is y[1] for x, y in zip(first, again, strict=True))
    k = torch.randn(7, 2, 64)
    moved = reference.reposition_reference(k, b, inv_freq)
    assert torch.equal(moved, reference.reposition_reference(k, b.clone(), inv_freq))
    big = [torch.arange(4096) + i for i in range(40)]  # 1 MiB of tables each
    for delta in big:
        reference.rope_tables(delta, inv_freq)
    memo = reference._TABLES
    assert memo.held <= memo.BYTES and memo.get(big[-1], inv_freq) is not None
    assert memo.get(a, inv_freq) is None  # the oldest went first
