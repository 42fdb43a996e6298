"""compose + decode_cascade against attention over the paged prompt, for prompts that read one
master more than once (adjacent, apart, beside a request that reads it once), no vLLM.

Every use of a master is its own level (its own offset Δ and its own read mask), so a prompt
that holds the same document twice attends to both copies. fp32: ≤ 1e-5 absolute.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kmesh_blend.attention.decode import MASKED, MasterRows, decode_cascade
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.vllm.cascade_buffers import Sources, compose
from kmesh_blend.vllm.decode_plan import DecodePlan, MasterUse, SharedMaster
from kmesh_blend.vllm.paged import PagedLayout, slot_mapping

HEADS, KV_HEADS, DIM, BLOCK, LAYERS, SIZE, FIRST, SCALE = 4, 2, 8, 4, 2, 10, 2, 0.3


def _layout() -> PagedLayout:
    def views(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        base = c.view(c.shape[0], KV_HEADS, 2 * BLOCK, DIM)
        return base[:, :, :BLOCK], base[:, :, BLOCK:]

    return PagedLayout("cpu_rows", BLOCK, views)


def _master(gen: torch.Generator, rope: RotaryEmbedding) -> SimpleNamespace:
    pos = torch.arange(FIRST, FIRST + SIZE)
    k = torch.stack([rope.apply(torch.randn(SIZE, KV_HEADS, DIM, generator=gen), pos)
                     for _ in range(LAYERS)])  # fmt: skip
    v = torch.randn(LAYERS, SIZE, KV_HEADS, DIM, generator=gen)
    return SimpleNamespace(kv=torch.stack((k, v), 1), positions=pos)


def _case(layouts: list[tuple[int, list[int]]], seed: int = 0):  # type: ignore[no-untyped-def]
    """Requests of ``total`` tokens holding the master at each offset of ``offsets``; a few
    rows of each copy replaced by the request's own. Returns what compose needs and, per
    request, its paged prompt K/V per layer (the materialized context)."""
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(RopeConfig(head_dim=DIM))
    master, layout = _master(gen, rope), _layout()
    num_blocks = sum(-(-total // BLOCK) for total, _ in layouts)
    caches = [torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    plans, contexts, free = [], [], list(range(num_blocks))[::-1]
    for r, (total, offsets) in enumerate(layouts):
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        slots = slot_mapping(blocks, BLOCK, 0, total)
        context = []
        for layer, cache in enumerate(caches):
            k = rope.apply(torch.randn(total, KV_HEADS, DIM, generator=gen), torch.arange(total))
            v = torch.randn(total, KV_HEADS, DIM, generator=gen)
            for u, offset in enumerate(offsets):
                delta = torch.full((SIZE,), offset - FIRST)
                k[offset : offset + SIZE] = rope.apply(master.kv[layer, 0], delta)
                v[offset : offset + SIZE] = master.kv[layer, 1]
                own = (u + layer + r) % SIZE  # one row per copy is the request's own
                k[offset + own] += 0.5
                v[offset + own] -= 0.5
            layout.write(cache, k, v, slots)
            context.append((k, v))
        uses = [MasterUse("m", o, o + SIZE, master) for o in offsets]
        plans.append(DecodePlan(f"r{r}", blocks, slots, uses))
        contexts.append(context)
    return plans, contexts, caches, layout, rope


def _attend(plans, contexts, caches, layout, rope):  # type: ignore[no-untyped-def]
    """(cascade, materialized) outputs [n, H, D] per layer, for one decode query per request
    at the position after its prompt."""
    gen = torch.Generator().manual_seed(1)
    for plan in plans:  # (a plan armed by the caller keeps what it verified then)
        assert plan.armed or plan.arm(layout, caches, rope) is None
    shared = {"m": SharedMaster.of(plans[0].uses[0].master, torch.float32)}
    width = max(len(p.block_ids) for p in plans)
    table = torch.zeros(len(plans), width, dtype=torch.int64)
    for r, plan in enumerate(plans):
        table[r, : len(plan.block_ids)] = plan.blocks
    chosen = list(enumerate(plans))
    comp = compose(SimpleNamespace(block_table=table), chosen, [0] * len(plans), None,
                   Sources(shared, caches, layout, rope), (KV_HEADS, DIM), tiled=False)  # fmt: skip
    positions = torch.tensor([p.num_tokens for p in plans])
    q = rope.apply(torch.randn(len(plans), HEADS, DIM, generator=gen), positions)
    out = []
    for layer in range(LAYERS):
        buffers = comp.layers[layer]
        levels = [MasterRows(m.k_t[layer], m.v[layer], rope.apply(q, back))
                  for m, back in comp.masters]  # fmt: skip
        got = decode_cascade(q, buffers.own, levels, buffers.bias, SCALE)
        want = []
        for r, context in enumerate(contexts):
            k, v = context[layer]
            group = HEADS // KV_HEADS
            scores = torch.einsum("hd,shd->hs", q[r], k.repeat_interleave(group, 1)) * SCALE
            want.append(torch.einsum("hs,shd->hd", scores.softmax(-1),
                                     v.repeat_interleave(group, 1)))  # fmt: skip
        out.append((got, torch.stack(want)))
    return out, comp


LAYOUTS = {
    "apart": [(5 + SIZE + 9 + SIZE + 4, [5, 5 + SIZE + 9])],
    "adjacent": [(2 + 2 * SIZE + 3, [2, 2 + SIZE])],
    "three_copies": [(1 + 3 * SIZE + 8, [1, 1 + SIZE + 4, 1 + 2 * SIZE + 4])],
    "beside_a_single_reader": [(12 + SIZE + 3 + SIZE + 6, [12, 12 + SIZE + 3]), (7 + SIZE, [3])],
    "single_reader_first": [(4 + SIZE + 2, [4]), (20 + SIZE + 40 + SIZE + 2, [20, 70])],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_use_of_a_master_is_attended(name: str) -> None:
    out, comp = _attend(*_case(LAYOUTS[name]))
    assert len(comp.masters) == max(len(offsets) for _, offsets in LAYOUTS[name])
    for got, want in out:
        assert float((got - want).abs().max()) <= 1e-5


def test_a_lost_copy_is_caught() -> None:
    """The comparison can fail: with the second copy's level masked (as when one level per
    master kept only the last use) the output moves far past the bound."""
    plans, contexts, caches, layout, rope = _case(LAYOUTS["apart"])
    out, comp = _attend(plans, contexts, caches, layout, rope)
    assert float((out[0][0] - out[0][1]).abs().max()) <= 1e-5
    layer = comp.layers[0]
    own_width = layer.own.k_t.shape[-1]
    layer.bias[:, own_width + SIZE :] = MASKED
    q = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    q = rope.apply(q, torch.tensor([plans[0].num_tokens]))
    levels = [MasterRows(m.k_t[0], m.v[0], rope.apply(q, back)) for m, back in comp.masters]
    got = decode_cascade(q, layer.own, levels, layer.bias, SCALE)
    assert float((got - out[0][0]).abs().max()) > 1e-3


@pytest.mark.parametrize("tiled", [False, True])
def test_a_new_set_copies_continuing_requests_rows(tiled: bool) -> None:
    """When the set of decoding requests changes, a request that decoded in the last set has its
    rows copied from there: the buffers equal those read afresh from the paged cache."""
    plans, _, caches, layout, rope = _case(LAYOUTS["beside_a_single_reader"] + [(30, [6])])
    for plan in plans:
        assert plan.arm(layout, caches, rope) is None
    shared = {"m": SharedMaster.of(plans[0].uses[0].master, torch.float32, tiled=tiled)}
    width = max(len(p.block_ids) for p in plans)
    table = torch.zeros(len(plans), width, dtype=torch.int64)
    for r, plan in enumerate(plans):
        table[r, : len(plan.block_ids)] = plan.blocks
    batch = SimpleNamespace(block_table=table)
    src = Sources(shared, caches, layout, rope)
    before = compose(batch, list(enumerate(plans[:2])), [0, 0], None, src, (KV_HEADS, DIM), tiled)
    now = [(1, plans[1]), (2, plans[2])]
    carried = compose(batch, now, [0, 0], before, src, (KV_HEADS, DIM), tiled)
    fresh = compose(batch, now, [0, 0], None, src, (KV_HEADS, DIM), tiled)
    for a, b in zip(carried.layers, fresh.layers, strict=True):
        assert torch.equal(a.own.k_t, b.own.k_t) and torch.equal(a.own.v, b.own.v)
        assert torch.equal(a.bias, b.bias) and torch.equal(a.first_free, b.first_free)
    # the copy is what made them equal: request 1's rows in `before` changed show up
    before.layers[0].own.v[1].add_(1.0)
    changed = compose(batch, now, [0, 0], before, src, (KV_HEADS, DIM), tiled)
    assert not torch.equal(changed.layers[0].own.v, fresh.layers[0].own.v)
