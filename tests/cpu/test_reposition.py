"""Stored keys moved to new positions in one pass (`kmesh_blend/cpu/reposition.cpp`) against the
fp32 torch reference (`reposition_reference`): the same bits in every dtype pair, with one shift
per row or one for all, into a strided slice of a larger frame; `reposition_keys` takes it on the
CPU once the kernels are loaded; bad arguments are refused by name. The same for drift
correction's in-place shift of stale rows (`shift_rows` against `shift_rows_reference`), and its
estimate (`drift_means`, within 1e-6 of `drift_means_reference`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.ops import drift_means, reference, reposition_keys, shift_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(n: int, dim: int, dtype: torch.dtype, shared: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n + dim)
    k = (torch.randn(n, 3, dim, generator=gen) * 4).to(dtype)
    delta = torch.full((n,), 517) if shared else torch.randint(-900, 3000, (n,), generator=gen)
    inv_freq = RotaryEmbedding(RopeConfig(head_dim=dim)).inv_freq
    return k, delta, inv_freq


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
def test_the_same_bits_as_the_reference(kernel: Any, dtype: torch.dtype,
                                        out_dtype: torch.dtype, shared: bool) -> None:  # fmt: skip
    op = torch.ops.kmesh_cpu.reposition
    for n, dim in ((1, 64), (193, 64), (70, 128), (9, 48)):
        k, delta, inv_freq = _inputs(n, dim, dtype, shared)
        want = torch.zeros(n, 3, dim, dtype=out_dtype)
        reference.reposition_reference(k, delta, inv_freq, want)
        frame = torch.full((n + 7, 3, dim), float("nan"), dtype=out_dtype)
        c, s = reference.signed_tables(delta, inv_freq)
        assert c.shape[0] == (1 if shared else n)
        op(k, c, s, frame[5 : 5 + n])
        assert torch.equal(_bits(frame[5 : 5 + n]), _bits(want))  # every row, bit for bit
        assert frame[:5].isnan().all() and frame[5 + n :].isnan().all()  # nothing else


def test_a_strided_input_and_the_launcher(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A master's layer is a view (``kv[layer, 0]``): strided input; `reposition_keys` on the
    CPU goes through the op (the torch reference is not called) and returns its bits."""
    k, delta, inv_freq = _inputs(130, 64, torch.bfloat16, False)
    pairs = torch.stack([k, k * 2], dim=1)  # [n, 2, H, D]
    view = pairs[:, 0]  # [n, H, D] with a row stride of 2·H·D
    assert not view.is_contiguous()
    want = reference.reposition_reference(view, delta, inv_freq)
    expected = reference.reposition_reference(view, delta, inv_freq, torch.empty(130, 3, 64))

    def not_here(*args: Any) -> None:
        raise AssertionError("the torch reference ran instead of the CPU op")

    monkeypatch.setattr(reference, "reposition_reference", not_here)
    assert torch.equal(_bits(reposition_keys(view, delta, inv_freq, "auto")), _bits(want))
    out = torch.empty(130, 3, 64, dtype=torch.float32)
    reposition_keys(view, delta, inv_freq, "auto", out)
    assert torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda k, c, s, o: (k, c.double(), s, o), "tables must be float32"),
        (
            lambda k, c, s, o: (k, c[:, :, :-2].contiguous(), s[:, :, :-2].contiguous(), o),
            "tables must be",
        ),
        (lambda k, c, s, o: (k, c, s, o[:-1]), "k and out must be"),
        (lambda k, c, s, o: (k.int(), c, s, o), "k must be float32"),
        (lambda k, c, s, o: (k[:2], c, s, o[:2]), "tables must have n rows or one"),
    ],
)
def test_bad_arguments_are_refused_by_name(kernel: Any, change: Any, message: str) -> None:
    k, delta, inv_freq = _inputs(5, 64, torch.bfloat16, False)
    c, s = reference.signed_tables(delta, inv_freq)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kmesh_cpu.reposition(*change(k, c, s, torch.empty_like(k)))


def _shift_inputs(n: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n * dim)
    k = (torch.randn(n, 3, dim, generator=gen) * 3).to(dtype)
    v = (torch.randn(n, 3, dim, generator=gen) * 3).to(dtype)
    shift_k, shift_v = torch.randn(3, dim, generator=gen), torch.randn(3, dim, generator=gen)
    rotation = RotaryEmbedding(RopeConfig(head_dim=dim)).tables(torch.arange(n) + 40, torch.float32)
    return k, v, shift_k, shift_v, rotation.cos, rotation.signed_sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_shift_rows_gives_the_references_bits_in_place(kernel: Any, dtype: torch.dtype) -> None:
    for n, dim in ((1, 64), (300, 64), (70, 128), (9, 48)):
        k, v, *rest = _shift_inputs(n, dim, dtype)
        want_k, want_v = k.clone(), v.clone()
        reference.shift_rows_reference(want_k, want_v, *rest)
        frame_k = torch.full((n + 6, 3, dim), float("nan"), dtype=dtype)
        frame_v = frame_k.clone()
        frame_k[4 : 4 + n], frame_v[4 : 4 + n] = k, v
        torch.ops.kmesh_cpu.shift_rows(frame_k[4 : 4 + n], frame_v[4 : 4 + n], *rest)
        assert torch.equal(_bits(frame_k[4 : 4 + n]), _bits(want_k))
        assert torch.equal(_bits(frame_v[4 : 4 + n]), _bits(want_v))
        assert frame_k[:4].isnan().all() and frame_v[4 + n :].isnan().all()  # nothing else
        assert not torch.equal(want_k, k)  # it did shift


def test_the_launcher_shifts_with_the_op(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    k, v, *rest = _shift_inputs(50, 64, torch.bfloat16)
    want_k, want_v = k.clone(), v.clone()
    reference.shift_rows_reference(want_k, want_v, *rest)

    def not_here(*args: Any) -> None:
        raise AssertionError("the torch reference ran instead of the CPU op")

    monkeypatch.setattr(reference, "shift_rows_reference", not_here)
    shift_rows(k, v, *rest)
    assert torch.equal(_bits(k), _bits(want_k)) and torch.equal(_bits(v), _bits(want_v))
    with pytest.raises(ValueError, match="signed_sin must be"):
        shift_rows(k, v, rest[0], rest[1], rest[2], rest[3][:-1])
    with pytest.raises(RuntimeError, match="shifts must be"):
        torch.ops.kmesh_cpu.shift_rows(k, v, rest[0][:2].contiguous(), rest[1][:2].contiguous(),
                                       rest[2], rest[3])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_drift_means_within_a_millionth_of_the_reference(kernel: Any, dtype: torch.dtype) -> None:
    """Drift correction's estimate (`drift_means`, summed in double) against the torch reference
    over the same rows, strided inputs included; the launcher takes the op."""
    for n, dim in ((1, 64), (374, 64), (70, 128), (9, 48)):
        gen = torch.Generator().manual_seed(n + dim)
        fresh = [(torch.randn(n, 3, dim, generator=gen) * 2).to(dtype) for _ in range(2)]
        stored = torch.stack([(torch.randn(n, 3, dim, generator=gen) * 2).to(dtype)] * 2, dim=1)
        back = RotaryEmbedding(RopeConfig(head_dim=dim)).tables(-torch.arange(n) - 7,
                                                                 torch.float32)  # fmt: skip
        rows = torch.randperm(n, generator=gen)[: max(1, n // 3)]
        args = (fresh[0], stored[:, 0], fresh[1], stored[:, 1], back.cos, back.signed_sin, rows)
        want_k, want_v = reference.drift_means_reference(*args)
        got_k, got_v = torch.ops.kmesh_cpu.drift_means(*args)
        torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_v, want_v, atol=1e-6, rtol=1e-6)
        assert torch.equal(drift_means(*args)[0], got_k)  # the launcher: the op's own result
    with pytest.raises(RuntimeError, match="rows out of range"):
        torch.ops.kmesh_cpu.drift_means(*args[:-1], torch.tensor([n]))
    with pytest.raises(ValueError, match="non-empty"):
        drift_means(*args[:-1], torch.tensor([], dtype=torch.int64))
