"""The CPU cascade kernel (`kmesh_blend/cpu/cascade_decode.cpp`) against the fp32 reference of
the same math (`kmesh_blend.attention.decode.decode_cascade`), and its layouts
(`kmesh_blend.cpu.layout`). fp32: within 1e-5 (sums in another order). bf16 K/V, exact: products
as exact as fp32 (rotated queries and probabilities go in as bf16 pairs, fp32 sums); not exact:
rounded to bf16 once (about twice the mean error); the bf16 output rounding (2⁻⁸ relative)
dominates either way: within 1e-2 of the reference on N(0, 1) data."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from kmesh_blend.attention.decode import MASKED, MasterRows, OwnRows, decode_cascade
from kmesh_blend.cpu.layout import (
    chunk_rows,
    chunk_width,
    gemm_chunks,
    pair_value_rows,
    pair_values,
    tile_key_rows,
    tile_keys,
    unpair_values,
    untile_keys,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def test_layouts_round_trip_and_place_each_element() -> None:
    k_t, v = torch.randn(2, 3, 64, 37), torch.randn(2, 3, 37, 64)
    tiled, paired = tile_keys(k_t), pair_values(v)
    assert tiled.shape == (2, 3, 3, 32, 16, 2) and paired.shape == (2, 3, 19, 64, 2)
    assert torch.equal(untile_keys(tiled, 37), k_t) and torch.equal(unpair_values(paired, 37), v)
    flat_k, flat_v = tiled[1, 2].flatten(), paired[1, 2].flatten()
    for d, j in [(0, 0), (5, 20), (63, 36), (32, 17)]:
        assert flat_k[((j // 16) * 32 + d // 2) * 32 + (j % 16) * 2 + d % 2] == k_t[1, 2, d, j]
        assert flat_v[((j // 2) * 64 + d) * 2 + j % 2] == v[1, 2, j, d]
    assert not tiled[..., 2, :, 5:, :].any() and not paired[..., 18, :, 1].any()  # zero padding
    # from rows as stored ([S, Hkv, D]): the same tensors, in every dtype and odd sizes
    for dtype in (torch.float32, torch.bfloat16):
        for size in (37, 32, 1):
            k, v = torch.randn(2, size, 3, 64).to(dtype), torch.randn(2, size, 3, 64).to(dtype)
            assert torch.equal(tile_key_rows(k), tile_keys(k.permute(0, 2, 3, 1)))
            assert torch.equal(pair_value_rows(v), pair_values(v.transpose(1, 2)))


def _case(
    dtype: torch.dtype,
    n: int,
    heads: int,
    kv_heads: int,
    dim: int,
    own: int,
    sizes: list[int],
    own_read: bool = True,
    exact: bool = True,
) -> tuple[tuple[Any, ...], torch.Tensor, tuple[torch.Tensor, ...]]:
    """Kernel arguments, the reference output [n, H, D], and the own buffers after the step.

    The own rows sit in a pool of n + 2 slots, request r's in a shuffled slot: the two others
    hold rows no request reads (the kernel must neither read nor write them). ``own_read``
    False: every own column is masked but this step's (no own prompt rows)."""
    gen = torch.Generator().manual_seed(n * 1000 + dim + own)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    steps = n + 3
    tokens = torch.randperm(steps, generator=gen)[:n].contiguous()
    q, k, v = rand(steps, heads, dim), rand(steps, kv_heads, dim), rand(steps, kv_heads, dim)
    pool = n + 2
    slots = torch.randperm(pool, generator=gen)[:n].contiguous()
    own_k, own_v = rand(pool, kv_heads, dim, own), rand(pool, kv_heads, own, dim)
    pool_bias = torch.zeros(pool, own)
    pool_bias[torch.rand(pool, own, generator=gen) < (0.2 if own_read else 2.0)] = MASKED
    bias = torch.zeros(n, own + sum(sizes))
    bias[torch.rand(n, own + sum(sizes), generator=gen) < 0.2] = MASKED
    if len(sizes) > 1:
        bias[0, own + sizes[0] :] = MASKED  # request 0 reads nothing of the second master
    cols = torch.randint(0, own, (n,), generator=gen)
    masters = [(rand(kv_heads, dim, s), rand(kv_heads, s, dim)) for s in sizes]
    rotations = [
        torch.linalg.qr(torch.randn(n, dim, dim, generator=gen))[0].contiguous() for _ in sizes
    ]
    bias[:, :own] = pool_bias[slots]
    want_k, want_v, want_bias = own_k.clone(), own_v.clone(), pool_bias.clone()
    for r in range(n):
        want_k[slots[r], :, :, cols[r]] = k[tokens[r]]
        want_v[slots[r], :, cols[r]] = v[tokens[r]]
        want_bias[slots[r], cols[r]] = 0.0
        bias[r, cols[r]] = 0.0
    qf = q[tokens].float()
    rows = [
        MasterRows(mk.float(), mv.float(), torch.bmm(qf, rot))
        for (mk, mv), rot in zip(masters, rotations, strict=True)
    ]
    own_rows = OwnRows(want_k[slots].float(), want_v[slots].float())
    want = decode_cascade(qf, own_rows, rows, bias, 0.125)
    starts = [own]
    for s in sizes:
        starts.append(starts[-1] + s)
    args = (
        torch.zeros(steps, heads, dim, dtype=dtype), tokens, q, k, v,
        tile_keys(own_k), pair_values(own_v), pool_bias, slots, cols,
        [tile_keys(mk) for mk, _ in masters], [pair_values(mv) for _, mv in masters],
        [bias[:, a:b] for a, b in itertools.pairwise(starts)], rotations, 0.125, exact,
    )  # fmt: skip
    return args, want, (tile_keys(want_k), pair_values(want_v), want_bias)


SHAPES = [
    # n, H, Hkv, D, own columns, master sizes
    (8, 9, 3, 64, 480, [2048]),  # SmolLM2's heads, a family of 8 over a 2,048-token document
    (1, 4, 2, 32, 48, [101, 33]),  # one request, two masters, odd sizes
    (3, 8, 2, 128, 32, [5, 301]),
    (21, 3, 1, 64, 16, [600]),  # 63 query rows on one KV head: the kernel's limit is 64
    (2, 4, 4, 64, 64, []),  # no master: own rows only
]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "rounded-once"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}-D{s[3]}-{len(s[5])}m")
def test_kernel_matches_the_reference(
    kernel: Any, dtype: torch.dtype, shape: tuple, exact: bool
) -> None:
    args, want, (want_k, want_v, want_bias) = _case(dtype, *shape, exact=exact)
    out, tokens = args[0], args[1]
    kernel(*args)
    err = float((out[tokens].float() - want).abs().max())
    assert err <= TOL[dtype], err
    # this step's K/V joined the own rows in place, and their bias reads them
    assert torch.equal(args[5], want_k) and torch.equal(args[6], want_v)
    assert torch.equal(args[7], want_bias)  # the pool's other slots untouched too
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[tokens] = False
    assert not out[others].any()  # rows of other tokens untouched


def test_a_masked_row_weighs_nothing(kernel: Any) -> None:
    """A master row masked for a request changes nothing of its output however large its
    score; unmasking it does."""
    args, _, _ = _case(torch.float32, 2, 4, 2, 64, 32, [64])
    master_k, bias = args[10][0], args[12][0]
    bias[0, 7] = MASKED
    kernel(*args)
    first = args[0].clone()
    master_k.view(2, 4, 32, 16, 2)[:, 0, :, 7, :] = 1e3  # key 7 of every head: a huge score
    kernel(*args)
    assert torch.equal(args[0][args[1][0]], first[args[1][0]])
    assert not torch.allclose(args[0][args[1][1]], first[args[1][1]])


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        (6, lambda t: t[..., :1].contiguous(), "own_v"),
        (7, lambda t: t.double(), "own_bias"),
        (8, lambda t: t.flip(0) * 0, "own_slots"),  # two requests in one slot
        (8, lambda t: t + 1000, "own_slots"),
        (9, lambda t: t + 1000, "cols"),
        (13, lambda ts: [t[:, :5] for t in ts], "rotation"),
    ],
)
def test_bad_arguments_are_refused_by_name(kernel: Any, field: int, bad: Any, message: str) -> None:
    args = list(_case(torch.float32, 2, 4, 2, 64, 32, [40])[0])
    args[field] = bad(args[field])
    with pytest.raises(RuntimeError, match=message):
        kernel(*args)


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kmesh_blend import cpu

    monkeypatch.setenv("KMESH_CPU_KERNELS", "0")
    assert cpu._load() == (None, "KMESH_CPU_KERNELS=0") and not cpu.cpu_kernel_expected()


def test_a_killed_build_s_lock_does_not_hang_the_next_load(tmp_path: Any) -> None:
    import os
    import time

    from kmesh_blend import cpu

    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    fresh.touch()
    stale.touch()
    old = time.time() - 2 * cpu._STALE_LOCK_S
    os.utime(stale, (old, old))
    cpu._drop_stale_lock(fresh)
    cpu._drop_stale_lock(stale)
    cpu._drop_stale_lock(tmp_path / "absent")
    assert fresh.exists() and not stale.exists()


def _in_chunks(args: tuple[Any, ...], sizes: list[int]) -> list[Any]:
    """The same kernel arguments with every master in the chunked layout of the matrix-product
    level (`gemm_chunks`)."""
    out = list(args)
    keys, values = [], []
    for tiled, paired, size in zip(args[10], args[11], sizes, strict=True):
        k_t, v = untile_keys(tiled, size), unpair_values(paired, size)  # [Hkv, D, S], [Hkv, S, D]
        k, v = gemm_chunks(k_t.permute(2, 0, 1)[None].contiguous(), v.transpose(0, 1)[None])
        keys.append(k[0])
        values.append(v[0])
    out[10], out[11] = keys, values
    return out


GEMM_SHAPES = [
    # n, H, Hkv, D, own columns, master sizes: GQA 3, 4, 1; head size 64, 128; families of 8,
    # 3, 1; masters of one short chunk, of several with a partial last one, of exact chunks
    (8, 9, 3, 64, 480, [2048]),
    (3, 8, 2, 128, 32, [5, 301]),
    (1, 4, 4, 64, 16, [700]),
    (3, 12, 4, 64, 16, [257, 512]),
]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "rounded-once"])
@pytest.mark.parametrize("own_read", [True, False], ids=["own-rows", "no-own-rows"])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"n{s[0]}-G{s[1] // s[2]}-D{s[3]}")
def test_the_matrix_product_level_matches_the_reference(
    kernel: Any, shape: tuple, own_read: bool, exact: bool
) -> None:
    """Masters in chunks, read by torch's bf16 GEMM: within the bf16 tolerance of the fp32
    reference, as the loops are."""
    args, want, _ = _case(torch.bfloat16, *shape, own_read=own_read, exact=exact)
    chunked = _in_chunks(args, shape[5])
    out, tokens = chunked[0], chunked[1]
    kernel(*chunked)
    err = float((out[tokens].float() - want).abs().max())
    assert err <= TOL[torch.bfloat16], err


def test_chunks_place_each_element() -> None:
    k, v = torch.randn(2, 37, 3, 64), torch.randn(2, 37, 3, 64)
    keys, values = chunk_rows(k, v, 16)
    assert keys.shape == (2, 3, 3, 64, 16) and values.shape == (2, 3, 3, 16, 64)
    for layer, j, h, d in [(0, 0, 0, 0), (1, 20, 2, 63), (1, 36, 1, 5), (0, 17, 0, 32)]:
        assert keys[layer, h, j // 16, d, j % 16] == k[layer, j, h, d]
        assert values[layer, h, j // 16, j % 16, d] == v[layer, j, h, d]
    assert not keys[:, :, 2, :, 5:].any() and not values[:, :, 2, 5:].any()  # zero padding
    assert chunk_width(37) == 48 and chunk_width(5000) == 256 and chunk_width(1) == 16


@pytest.mark.parametrize("gemm", [False, True], ids=["loops", "matrix-products"])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: f"n{s[0]}-D{s[3]}-{len(s[5])}m")
def test_exact_operands_halve_the_mean_error(kernel: Any, shape: tuple, gemm: bool) -> None:
    """``exact`` acts: the two-term operands' mean error against the fp32 reference is well
    under the once-rounded operands' (measured: about half)."""
    errors = []
    for exact in (True, False):
        args, want, _ = _case(torch.bfloat16, *shape, exact=exact)
        call = _in_chunks(args, shape[5]) if gemm else list(args)
        kernel(*call)
        errors.append(float((call[0][call[1]].float() - want).abs().mean()))
    assert errors[0] < 0.75 * errors[1], errors
