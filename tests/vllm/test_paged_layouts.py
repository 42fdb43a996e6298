"""`PagedLayout.discover` finds the layout the backend's own write produces, and reads and writes
rows in it bit for bit — including vLLM CPU's AMX-packed bf16 blocks (K in tiles of 16 tokens ×
dimension pairs, V in tiles of 16 dimensions × token pairs), whose rows are no strided view."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kmesh_blend.vllm.paged import PagedLayout

pytestmark = pytest.mark.vllm

HEADS, DIM, BS, BLOCKS = 2, 64, 32, 3


def _pack(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """The AMX tile order element by element (the definition, not a view): cache
    [blocks, H, BS, 2·D]; per block and head K's BS·D elements, then V's."""
    flat = cache.view(cache.shape[0], HEADS, 2 * BS * DIM)
    for row, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, BS)
        for d in range(DIM):
            at_k = (t // 16) * 16 * DIM + (d // 2) * 32 + (t % 16) * 2 + d % 2
            at_v = BS * DIM + (d // 16) * 16 * BS + (t // 2) * 32 + (d % 16) * 2 + t % 2
            flat[block, :, at_k] = k[row, :, d]
            flat[block, :, at_v] = v[row, :, d]


def _layer(write: Any) -> Any:
    return SimpleNamespace(impl=SimpleNamespace(do_kv_cache_update=write))


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HEADS, DIM, generator=gen).to(torch.bfloat16),
            torch.randn(n, HEADS, DIM, generator=gen).to(torch.bfloat16))  # fmt: skip


def _check(layout: PagedLayout | None, write: Any) -> None:
    assert layout is not None and layout.name == "cpu_amx_packed" and layout.packed
    k, v = _rows(40, 1)
    slots = torch.randperm(BLOCKS * BS, generator=torch.Generator().manual_seed(2))[:40]
    theirs = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
    write(None, k, v, theirs, slots)
    got_k, got_v = layout.read(theirs, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    ours = torch.zeros_like(theirs)
    layout.write(ours, k, v, slots)
    assert torch.equal(ours, theirs)  # every element where the backend puts it, nothing else
    none = torch.zeros(0, dtype=torch.int64)
    assert [tuple(t.shape) for t in layout.read(theirs, none)] == [(0, HEADS, DIM)] * 2
    layout.write(ours, k[:0], v[:0], none)
    with pytest.raises(IndexError):
        layout.read(theirs, torch.tensor([BLOCKS * BS]))


def test_amx_packed_layout_by_its_definition() -> None:
    def write(_: Any, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
              slots: torch.Tensor) -> None:  # fmt: skip
        _pack(k, v, slots, cache)

    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
    _check(PagedLayout.discover(_layer(write), cache, HEADS, DIM, BS), write)


def test_amx_packed_layout_through_vllms_own_write() -> None:
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM's CPU backend does not pack bf16 blocks here")
    from vllm import _custom_ops as ops

    def write(_: Any, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
              slots: torch.Tensor) -> None:  # fmt: skip
        key_cache, value_cache = cache.view(cache.shape[0], HEADS, 2 * BS, DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "amx", k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip

    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
    _check(PagedLayout.discover(_layer(write), cache, HEADS, DIM, BS), write)
