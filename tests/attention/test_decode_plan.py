"""DecodePlan.arm: which prompt rows of a blended request read the master in cascade decode is
decided by comparing its paged rows with the master, row by row and layer by layer (no vLLM);
on the CPU kernels' one-pass check (`kmesh_blend/cpu/verify_rows.cpp`) and on torch ops alike."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from kmesh_blend.cpu import cascade_decode_op, cpu_kernel_expected, verify_rows_op
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.vllm.decode_plan import DecodePlan, MasterUse, SharedMaster
from kmesh_blend.vllm.paged import PagedLayout, slot_mapping

HEADS, DIM, BLOCK, LAYERS = 2, 8, 4, 3


class _Master(NamedTuple):
    kv: torch.Tensor
    positions: torch.Tensor


def _layout() -> PagedLayout:
    def views(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        base = c.view(c.shape[0], HEADS, 2 * BLOCK, DIM)
        return base[:, :, :BLOCK], base[:, :, BLOCK:]

    return PagedLayout("cpu_rows", BLOCK, views)


@pytest.fixture(params=["kernel", "torch"])
def check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which implementation arms: the CPU kernels' check (where this machine builds them), or
    torch ops."""
    if request.param == "torch":
        monkeypatch.setattr("kmesh_blend.vllm.decode_plan.verify_rows_op", lambda: None)
    elif cascade_decode_op()[0] is None or verify_rows_op() is None:
        assert not cpu_kernel_expected(), "this machine should build the CPU kernels"
        pytest.skip("no CPU kernels here")
    return str(request.param)


Built = tuple[DecodePlan, list[torch.Tensor], tuple[PagedLayout, RotaryEmbedding, _Master]]


def _request(dtype: torch.dtype, replaced: dict[int, list[int]]) -> Built:
    """A 20-token prompt whose rows 5..15 copy a master computed at positions 2..12; in layer l
    the rows in ``replaced[l]`` (segment-relative) are the request's own."""
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(head_dim=DIM))
    size, first, offset, total = 10, 2, 5, 20
    master_k = torch.stack(
        [
            rope.apply(
                torch.randn(size, HEADS, DIM, generator=gen), torch.arange(first, first + size)
            )
            for _ in range(LAYERS)
        ]
    )
    master_v = torch.randn(LAYERS, size, HEADS, DIM, generator=gen)
    master = _Master(
        torch.stack((master_k, master_v), 1).to(dtype), torch.arange(first, first + size)
    )
    layout, blocks = _layout(), [3, 0, 5, 1, 2]
    caches = []
    for layer in range(LAYERS):
        k = torch.randn(total, HEADS, DIM, generator=gen)
        v = torch.randn(total, HEADS, DIM, generator=gen)
        moved = rope.apply(master.kv[layer, 0].float(), torch.full((size,), offset - first))
        k[offset : offset + size], v[offset : offset + size] = moved, master.kv[layer, 1].float()
        for row in replaced.get(layer, []):
            k[offset + row] += 0.5
            v[offset + row] += 0.5
        cache = torch.zeros(6, HEADS, BLOCK, 2 * DIM, dtype=dtype)
        layout.write(cache, k.to(dtype), v.to(dtype), slot_mapping(blocks, BLOCK, 0, total))
        caches.append(cache)
    slots = slot_mapping(blocks, BLOCK, 0, total)
    plan = DecodePlan("r", blocks, slots, [MasterUse("m", offset, offset + size, master)])
    return plan, caches, (layout, rope, master)


def test_rows_that_equal_the_master_are_shared_the_rest_are_own(check: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        plan, caches, (layout, rope, _) = _request(dtype, {0: [], 1: [0, 7], 2: [3]})
        assert plan.arm(layout, caches, rope) is None and plan.armed
        shared = plan.shared[0]
        assert shared.shape == (LAYERS, 10)
        assert shared[0].all() and (~shared[1]).nonzero().flatten().tolist() == [0, 7]
        assert (~shared[2]).nonzero().flatten().tolist() == [3]
        own = slot_mapping(plan.block_ids, BLOCK, 0, 20)
        # own rows: the 10 private ones, plus what the layer replaced
        assert [s.numel() for s in plan.own_slots] == [10, 12, 11]
        assert set(own[5:15][shared[1]].tolist()).isdisjoint(plan.own_slots[1].tolist())
        assert plan.shared_rows == round((10 + 8 + 9) / 3)


def test_keys_within_one_rounding_are_shared_keys_beyond_it_are_own(check: str) -> None:
    # The blend may round a re-positioned key differently from the check: such a row is still
    # the master's; a key moved further (its value kept) is the request's own.
    for dtype in (torch.float32, torch.bfloat16):
        plan, caches, (layout, rope, _) = _request(dtype, {})
        step = 1e-6 if dtype == torch.float32 else 4e-3  # relative: under one rounding's tolerance
        for row, factor in ((2, 1 + step), (4, 1.3), (6, 1 - step)):
            slot = plan.slots[5 + row : 6 + row]
            k, v = layout.read(caches[1], slot)
            nudged = (k.float() * factor).to(dtype)
            assert not torch.equal(nudged, k)
            layout.write(caches[1], nudged, v, slot)
        assert plan.arm(layout, caches, rope) is None
        assert (~plan.shared[0][1]).nonzero().flatten().tolist() == [4]
        assert plan.shared[0][0].all() and plan.shared[0][2].all()


def test_a_request_that_replaced_every_row_is_not_armed(check: str) -> None:
    plan, caches, (layout, rope, _) = _request(
        torch.float32, {i: list(range(10)) for i in range(3)}
    )
    reason = plan.arm(layout, caches, rope)
    assert reason is not None and "replaced" in reason and not plan.armed


def test_a_master_of_another_shape_is_refused() -> None:
    plan, caches, (layout, rope, master) = _request(torch.float32, {})
    plan.uses[0] = MasterUse("m", 5, 15, _Master(master.kv[:2], master.positions))
    assert "shape" in (plan.arm(layout, caches, rope) or "")


def test_shared_master_layout() -> None:
    _, _, (_, _, master) = _request(torch.bfloat16, {})
    shared = SharedMaster.of(master, torch.bfloat16)
    assert shared.k_t.shape == (LAYERS, HEADS, DIM, 10) and shared.v.shape == (
        LAYERS,
        HEADS,
        10,
        DIM,
    )
    assert torch.equal(shared.k_t[1, :, :, 4], master.kv[1, 0, 4])
    assert torch.equal(shared.v[2, :, 6], master.kv[2, 1, 6]) and shared.first == 2


def test_shared_master_tiled_layout_is_the_cpu_kernels() -> None:
    from kmesh_blend.cpu.layout import unpair_values, untile_keys

    _, _, (_, _, master) = _request(torch.bfloat16, {})
    plain = SharedMaster.of(master, torch.bfloat16)
    tiled = SharedMaster.of(master, torch.bfloat16, tiled=True)
    assert tiled.k_t.dtype == torch.bfloat16 and tiled.size == plain.size == 10
    assert tiled.k_t.shape == (LAYERS, HEADS, 1, DIM // 2, 16, 2)
    assert torch.equal(untile_keys(tiled.k_t, 10).float(), plain.k_t)
    assert torch.equal(unpair_values(tiled.v, 10).float(), plain.v)
