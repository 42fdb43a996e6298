"""A reader's own rows into its pool slot in one pass (`kmesh_blend/cpu/fill_own.cpp`) against the
torch ops it replaces (`OwnPool.place`: gather, concatenate, tile), on vLLM's CPU cache layouts,
in bf16 and fp32, head sizes 64 / 128 / 48: the same pool bit for bit, the other slot untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kmesh_blend.cpu import fill_own_op
from kmesh_blend.vllm import cascade_buffers
from kmesh_blend.vllm.cascade_buffers import OwnPool, Sources
from kmesh_blend.vllm.decode_plan import DecodePlan
from kmesh_blend.vllm.kv_release import Release, take_mirror
from kmesh_blend.vllm.paged import PagedLayout, _candidates, slot_mapping

HEADS, BLOCK, LAYERS, PROMPT, GENERATED = 3, 16, 3, 70, 5


def _fill(layout: PagedLayout, caches: list[torch.Tensor], released: bool = False,
          intact: bool = False) -> OwnPool:  # fmt: skip
    """Two requests placed in a fresh tiled pool, each with its own rows per layer (a different
    set per layer) and GENERATED rows after its prompt; ``released``: two of their blocks went
    back (a mirror holds their rows), in this step when ``intact``."""
    dim, dtype = caches[0].shape[-1] // 2, caches[0].dtype
    pool = OwnPool(LAYERS, (HEADS, dim), dtype, tiled=True)
    names = frozenset({"r0", "r1"} if intact else ())
    src = Sources({}, caches, layout, None, names)  # type: ignore[arg-type]  # (no masters read)
    for r, blocks in enumerate(([3, 9, 0, 7, 12, 5], [1, 14, 2, 11, 6, 8])):
        gen = torch.Generator().manual_seed(r)
        slots = slot_mapping(blocks, BLOCK, 0, PROMPT)
        plan = DecodePlan(f"r{r}", blocks, slots, [])
        plan.own_slots = [slots[torch.rand(PROMPT, generator=gen) < 0.3 + 0.2 * layer]
                          for layer in range(LAYERS)]  # fmt: skip
        plan.armed = True
        if released:
            mirror = take_mirror(plan.own_slots, blocks[1:3], BLOCK, layout, caches)
            plan.release = Release([1, 2], blocks[1:3], mirror)
        pool.place(plan, torch.tensor(blocks), GENERATED, src)
    return pool


def _count_fills(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Route the pool's one-pass fill through a counter: one entry per call of the op."""
    calls: list[int] = []
    op = fill_own_op()

    def counted(*args: Any) -> Any:
        calls.append(1)
        return op(*args)  # type: ignore[misc]

    monkeypatch.setattr(cascade_buffers, "fill_own_op", lambda: counted)
    return calls


@pytest.mark.parametrize("layout_name", ["cpu_k_transposed", "cpu_rows"])
@pytest.mark.parametrize("dim", [64, 128, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_fill_equals_the_torch_ops(
    kernel: Any, monkeypatch: pytest.MonkeyPatch, layout_name: str, dim: int, dtype: torch.dtype
) -> None:
    assert fill_own_op() is not None  # loaded with the kernel
    shape = torch.Size((16, HEADS, BLOCK, 2 * dim))
    layout = PagedLayout(layout_name, BLOCK, _candidates(shape, HEADS, dim, BLOCK)[layout_name])
    gen = torch.Generator().manual_seed(dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS)]
    calls = _count_fills(monkeypatch)
    fast = _fill(layout, caches)
    assert len(calls) == 2  # the one pass served both requests
    monkeypatch.setattr(cascade_buffers, "fill_own_op", lambda: None)
    slow = _fill(layout, caches)
    for layer in range(LAYERS):
        assert torch.equal(fast.k[layer], slow.k[layer]), layer
        assert torch.equal(fast.v[layer], slow.v[layer]), layer
    assert torch.equal(fast.bias, slow.bias) and torch.equal(fast.first_free, slow.first_free)
    assert fast.bias.eq(0).any() and fast.k[0].ne(0).any()  # rows were written at all


def test_a_reader_whose_blocks_go_back_in_this_step_is_filled_from_them(
    kernel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = torch.Size((16, HEADS, BLOCK, 128))
    name = "cpu_k_transposed"
    layout = PagedLayout(name, BLOCK, _candidates(shape, HEADS, 64, BLOCK)[name])
    caches = [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]
    calls = _count_fills(monkeypatch)
    whole = _fill(layout, caches)
    assert len(calls) == 2
    this_step = _fill(layout, caches, released=True, intact=True)
    assert len(calls) == 4  # its blocks still hold its rows: one pass from them, the same pool
    for layer in range(LAYERS):
        assert torch.equal(this_step.k[layer], whole.k[layer])
        assert torch.equal(this_step.v[layer], whole.v[layer])
    assert torch.equal(this_step.bias, whole.bias)
    later = _fill(layout, caches, released=True)
    assert len(calls) == 4  # blocks gone: read from its mirror (torch ops)
    assert torch.equal(later.bias, whole.bias)  # the same rows held, in the mirror's order


def test_the_fill_refuses_a_slot_list_wider_than_the_pool(kernel: Any) -> None:
    op = fill_own_op()
    assert op is not None
    view = torch.zeros(4, HEADS, BLOCK, 64, dtype=torch.bfloat16)
    own_k = torch.zeros(2, HEADS, 1, 32, 16, 2, dtype=torch.bfloat16)
    own_v = torch.zeros(2, HEADS, 8, 64, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slots"):
        op([view], [view], [torch.arange(17)], [own_k], [own_v], 0)
    with pytest.raises(RuntimeError, match="slot within the pool"):
        op([view], [view], [torch.arange(3)], [own_k], [own_v], 2)
