"""compose + decode_cascade against attention over the paged prompt, for prompts that read one
master more than once (adjacent, apart, beside a request that reads it once), no vLLM; and the
own-row pool: a request keeps its slot while the set around it changes.

Every use of a master is its own level (its own offset Δ and its own read mask), so a prompt
that holds the same document twice attends to both copies. fp32: ≤ 1e-5 absolute.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kmesh_blend.attention.decode import MASKED, MasterRows, decode_cascade
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.vllm.cascade_attend import gathered
from kmesh_blend.vllm.cascade_buffers import OwnPool, Sources, compose, partition
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


def _case(layouts: list[tuple[int, list[int]]], seed: int = 0,  # type: ignore[no-untyped-def]
          masters: int = 1):  # fmt: skip
    """Requests of ``total`` tokens holding a master at each offset of ``offsets`` (request r
    reads master ``m{r % masters}``); a few rows of each copy replaced by the request's own.
    Returns what compose needs and, per request, its paged prompt K/V per layer (the
    materialized context)."""
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(RopeConfig(head_dim=DIM))
    stored, layout = [_master(gen, rope) for _ in range(masters)], _layout()
    num_blocks = sum(-(-total // BLOCK) for total, _ in layouts)
    caches = [torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    plans, contexts, free = [], [], list(range(num_blocks))[::-1]
    for r, (total, offsets) in enumerate(layouts):
        master = stored[r % masters]
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
        uses = [MasterUse(f"m{r % masters}", o, o + SIZE, master) for o in offsets]
        plans.append(DecodePlan(f"r{r}", blocks, slots, uses))
        contexts.append(context)
    return plans, contexts, caches, layout, rope


def _attend(plans, contexts, caches, layout, rope):  # type: ignore[no-untyped-def]
    """(cascade, materialized) outputs [n, H, D] per layer, for one decode query per request
    at the position after its prompt."""
    gen = torch.Generator().manual_seed(1)
    for plan in plans:  # (a plan armed by the caller keeps what it verified then)
        assert plan.armed or plan.arm(layout, caches, rope) is None
    shared = {u.key: SharedMaster.of(u.master, torch.float32) for p in plans for u in p.uses}
    width = max(len(p.block_ids) for p in plans)
    table = torch.zeros(len(plans), width, dtype=torch.int64)
    for r, plan in enumerate(plans):
        table[r, : len(plan.block_ids)] = plan.blocks
    chosen = list(enumerate(plans))
    pool = OwnPool(LAYERS, (KV_HEADS, DIM), torch.float32, tiled=False)
    comp = compose(SimpleNamespace(block_table=table), chosen, [0] * len(plans), None, pool,
                   Sources(shared, caches, layout, rope))  # fmt: skip
    positions = torch.tensor([p.num_tokens for p in plans])
    q = rope.apply(torch.randn(len(plans), HEADS, DIM, generator=gen), positions)
    out = []
    for layer in range(LAYERS):
        got = torch.zeros(len(plans), HEADS, DIM)
        for group in comp.groups:
            own, bias = gathered(pool, group, layer)
            qg = q[group.rows]
            levels = [MasterRows(lv.master.k_t[layer], lv.master.v[layer],
                                 rope.apply(qg, lv.back)) for lv in group.levels]  # fmt: skip
            got[group.rows] = decode_cascade(qg, own, levels, bias, SCALE)
        want = []
        for r, context in enumerate(contexts):
            k, v = context[layer]
            group = HEADS // KV_HEADS
            scores = torch.einsum("hd,shd->hs", q[r], k.repeat_interleave(group, 1)) * SCALE
            want.append(torch.einsum("hs,shd->hd", scores.softmax(-1),
                                     v.repeat_interleave(group, 1)))  # fmt: skip
        out.append((got, torch.stack(want)))
    return out, (comp, pool)


LAYOUTS = {
    "apart": [(5 + SIZE + 9 + SIZE + 4, [5, 5 + SIZE + 9])],
    "adjacent": [(2 + 2 * SIZE + 3, [2, 2 + SIZE])],
    "three_copies": [(1 + 3 * SIZE + 8, [1, 1 + SIZE + 4, 1 + 2 * SIZE + 4])],
    "beside_a_single_reader": [(12 + SIZE + 3 + SIZE + 6, [12, 12 + SIZE + 3]), (7 + SIZE, [3])],
    "single_reader_first": [(4 + SIZE + 2, [4]), (20 + SIZE + 40 + SIZE + 2, [20, 70])],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_use_of_a_master_is_attended(name: str) -> None:
    out, (comp, _) = _attend(*_case(LAYOUTS[name]))
    assert len(comp.groups) == 1  # one master: one family
    assert len(comp.groups[0].levels) == max(len(offsets) for _, offsets in LAYOUTS[name])
    for got, want in out:
        assert float((got - want).abs().max()) <= 1e-5


def test_families_decoding_together_score_only_their_own_master() -> None:
    """Requests of two families in one set: two groups, each with its master's level only
    (no request scores rows it cannot read), and every output as over its paged prompt."""
    layouts = [(5 + SIZE + 3, [5]), (2 + SIZE + 6, [2]), (9 + SIZE, [9]), (1 + 2 * SIZE, [1])]
    out, (comp, _) = _attend(*_case(layouts, masters=2))
    assert [g.rows.tolist() for g in comp.groups] == [[0, 2], [1, 3]]
    assert [len(g.levels) for g in comp.groups] == [1, 1]
    assert comp.groups[0].levels[0].master is not comp.groups[1].levels[0].master
    for got, want in out:
        assert float((got - want).abs().max()) <= 1e-5


def test_partition_joins_plans_through_any_master_they_share() -> None:
    def plan(*keys: str) -> SimpleNamespace:
        return SimpleNamespace(uses=[SimpleNamespace(key=k) for k in keys])

    plans = [plan("a"), plan("b"), plan("c", "a"), plan("d"), plan("b", "c"), plan("e")]
    assert partition(plans) == [[0, 1, 2, 4], [3], [5]]  # type: ignore[arg-type]
    assert partition([]) == []


def test_a_lost_copy_is_caught() -> None:
    """The comparison can fail: with the second copy's level masked (as when one level per
    master kept only the last use) the output moves far past the bound."""
    plans, contexts, caches, layout, rope = _case(LAYOUTS["apart"])
    out, (comp, pool) = _attend(plans, contexts, caches, layout, rope)
    assert float((out[0][0] - out[0][1]).abs().max()) <= 1e-5
    group = comp.groups[0]
    group.levels[1].bias[0] = MASKED
    own, bias = gathered(pool, group, 0)
    q = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    q = rope.apply(q, torch.tensor([plans[0].num_tokens]))
    levels = [MasterRows(lv.master.k_t[0], lv.master.v[0], rope.apply(q, lv.back))
              for lv in group.levels]  # fmt: skip
    got = decode_cascade(q, own, levels, bias, SCALE)
    assert float((got - out[0][0]).abs().max()) > 1e-3


def _rows(pool: OwnPool, slot: int, layer: int = 0) -> tuple[torch.Tensor, ...]:
    return pool.k[layer][slot].clone(), pool.v[layer][slot].clone(), pool.bias[layer, slot].clone()


@pytest.mark.parametrize("tiled", [False, True])
def test_a_request_keeps_its_slot_while_the_set_changes(tiled: bool) -> None:
    """When the set of decoding requests changes, a request that decoded in the last set keeps
    its slot and its rows are not read again (a mark put there stays); a newcomer's slot holds
    what a fresh pool reads for it; a request whose rows are not current (it decoded elsewhere
    meanwhile) is read again; the pool holds nothing once every request left."""
    plans, _, caches, layout, rope = _case(LAYOUTS["beside_a_single_reader"] + [(30, [6])])
    for plan in plans:
        assert plan.arm(layout, caches, rope) is None
    shared = {"m0": SharedMaster.of(plans[0].uses[0].master, torch.float32, tiled=tiled)}
    width = max(len(p.block_ids) for p in plans)
    table = torch.zeros(len(plans), width, dtype=torch.int64)
    for r, plan in enumerate(plans):
        table[r, : len(plan.block_ids)] = plan.blocks
    batch = SimpleNamespace(block_table=table)
    src = Sources(shared, caches, layout, rope)
    dtype = caches[0].dtype

    def new_pool() -> OwnPool:
        return OwnPool(LAYERS, (KV_HEADS, DIM), dtype, tiled=tiled)

    pool = new_pool()
    before = compose(batch, list(enumerate(plans[:2])), [0, 0], None, pool, src)
    kept = int(before.slots[1])
    pool.v[0][kept].add_(1.0)  # a mark: gone if its rows were read again
    marked = _rows(pool, kept)
    now = compose(batch, [(1, plans[1]), (2, plans[2])], [0, 0], before, pool, src)
    assert int(now.slots[0]) == kept
    assert all(torch.equal(a, b) for a, b in zip(_rows(pool, kept), marked, strict=True))
    fresh_pool = new_pool()
    fresh = compose(batch, [(2, plans[2])], [0], None, fresh_pool, src)
    got, want = _rows(pool, int(now.slots[1])), _rows(fresh_pool, int(fresh.slots[0]))
    columns = want[2].numel()  # the pools' widths may differ: compare the fresh one's columns
    assert torch.equal(got[2][:columns], want[2]) and not bool((got[2][columns:] == 0).any())
    if tiled:
        assert torch.equal(got[0][:, : columns // 16], want[0])
        assert torch.equal(got[1][:, : columns // 2], want[1])
    else:
        assert torch.equal(got[0][..., :columns], want[0])
        assert torch.equal(got[1][:, :columns], want[1])
    assert torch.equal(now.groups[0].first_free[:, 1], fresh.groups[0].first_free[:, 0])
    # not current: request 1 holds no generated row, it is asked for one (read from its blocks)
    compose(batch, [(1, plans[1])], [1], now, pool, src)
    assert not torch.equal(_rows(pool, kept)[1], marked[1])
    for plan in plans:
        pool.release(plan.req_id)
    assert pool.size == 0 and pool.nbytes == 0


def test_a_set_composed_again_builds_each_readers_level_part_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A set is composed again whenever a request joins or leaves: each reader's read mask and
    query rotation (−Δ) are built once per plan and use, and a group's levels hold them as if
    built afresh (identity and all rows masked for a request without that level)."""
    plans, _, caches, layout, rope = _case(LAYOUTS["beside_a_single_reader"] + [(30, [6])])
    for plan in plans:
        assert plan.arm(layout, caches, rope) is None
    shared = {"m0": SharedMaster.of(plans[0].uses[0].master, torch.float32, tiled=True)}
    table = torch.zeros(len(plans), max(len(p.block_ids) for p in plans), dtype=torch.int64)
    for r, plan in enumerate(plans):
        table[r, : len(plan.block_ids)] = plan.blocks
    batch, src = SimpleNamespace(block_table=table), Sources(shared, caches, layout, rope)
    pool = OwnPool(LAYERS, (KV_HEADS, DIM), caches[0].dtype, tiled=True)
    calls = []
    apply = RotaryEmbedding.apply
    monkeypatch.setattr(RotaryEmbedding, "apply",
                        lambda self, x, p: calls.append(p) or apply(self, x, p))  # fmt: skip
    first = compose(batch, list(enumerate(plans[:2])), [0, 0], None, pool, src)
    assert len(calls) == 3  # request 0 reads the master twice, request 1 once
    now = compose(batch, [(1, plans[1]), (2, plans[2])], [0, 0], first, pool, src)
    assert len(calls) == 4  # the newcomer's only
    eye = torch.eye(DIM)[None]
    for comp, members in ((first, plans[:2]), (now, plans[1:])):
        (group,) = comp.groups
        for k, (level, rotation) in enumerate(zip(group.levels, group.rotations, strict=True)):
            for j, plan in enumerate(members):
                if k < len(plan.uses):
                    back = torch.tensor([FIRST - plan.uses[k].start])
                    assert torch.equal(rotation[j], apply(rope, eye, back)[0])
                    assert torch.equal(level.bias[:, j], torch.where(plan.shared[k], 0.0, MASKED))
                else:
                    assert torch.equal(rotation[j], eye[0])
                    assert bool((level.bias[:, j] == MASKED).all())
