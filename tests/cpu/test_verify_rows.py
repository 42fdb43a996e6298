"""Arming's row check in one pass (`kmesh_blend/cpu/verify_rows.cpp`) against the torch ops it
replaces (`kmesh_blend.vllm.decode_plan`: V bit for bit, K within one rounding of the master key
rotated in fp32), on vLLM's CPU cache layouts, every dtype pair and both code paths (vector
code for bf16 at head sizes that are multiples of 32, scalar code otherwise)."""

from __future__ import annotations

import pytest
import torch

from kmesh_blend.cpu import verify_rows_op
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding, rotate
from kmesh_blend.vllm.decode_plan import _close, _same_bits, _tolerance
from kmesh_blend.vllm.paged import PagedLayout, _candidates, slot_mapping

HEADS, BLOCK, SIZE = 3, 16, 150


@pytest.fixture(scope="module")
def verify(kernel: object) -> object:
    op = verify_rows_op()
    assert op is not None  # loaded with the kernel
    return op


@pytest.mark.parametrize("layout_name", ["cpu_k_transposed", "cpu_rows"])
@pytest.mark.parametrize("dim", [64, 128, 48])
@pytest.mark.parametrize(
    ("cache_dtype", "master_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
     (torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
)  # fmt: skip
def test_the_one_pass_check_agrees_with_the_torch_ops_row_for_row(
    verify: object, layout_name: str, dim: int, cache_dtype: torch.dtype, master_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(dim)
    shape = torch.Size((16, HEADS, BLOCK, 2 * dim))
    layout = PagedLayout(layout_name, BLOCK, _candidates(shape, HEADS, dim, BLOCK)[layout_name])
    cache = torch.zeros(shape, dtype=cache_dtype)
    rope = RotaryEmbedding(RopeConfig(head_dim=dim))
    positions = torch.arange(2, 2 + SIZE)
    master_k = rope.apply(torch.randn(SIZE, HEADS, dim, generator=gen), positions).to(master_dtype)
    master_v = torch.randn(SIZE, HEADS, dim, generator=gen).to(master_dtype)
    slots = slot_mapping([9, 2, 14, 5, 0, 11, 7, 3, 12, 1], BLOCK, 5, 5 + SIZE)
    rotation = rope.tables(torch.tensor([7]), torch.float32)
    k = rotate(master_k.float(), rotation)
    v = master_v.float().clone()
    k[3, 1, 5] += 1.0  # beyond one rounding: not the master's
    v[10, 2, dim - 1] += 0.5  # a value changed: not the master's
    k[20, 0, 0] *= 1 + (2e-3 if cache_dtype == torch.bfloat16 else 1e-6)  # within one rounding
    k[40, 2, 7] += 0.3
    k[41] += 0.25
    layout.write(cache, k.to(cache_dtype), v.to(cache_dtype), slots)
    k_view, v_view = layout.views(cache)
    got = verify(k_view, v_view, slots, master_k, master_v, rotation.cos[0],
                 rotation.signed_sin[0], *_tolerance(cache_dtype))  # type: ignore[operator]  # fmt: skip
    read_k, read_v = layout.read(cache, slots)
    want = _same_bits(read_v, master_v.to(cache_dtype)) & _close(
        read_k, rotate(master_k.float(), rotation)
    )
    assert torch.equal(got, want)
    failed = (~got).nonzero().flatten().tolist()
    assert {3, 10, 40, 41} <= set(failed) and 20 not in failed, failed


def test_bad_arguments_are_refused_by_name(verify: object) -> None:
    views = torch.zeros(4, 2, 16, 64), torch.zeros(4, 2, 16, 64)
    rows = torch.zeros(5, 2, 64)
    table = torch.ones(64), torch.zeros(64)
    with pytest.raises(RuntimeError, match="slots"):
        verify(*views, torch.tensor([0, 1, 2, 3, 99]), rows, rows, *table, 0.0, 0.0)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="master_k"):
        verify(*views, torch.arange(5), rows[:, :1], rows[:, :1], *table, 0.0, 0.0)  # type: ignore[operator]
