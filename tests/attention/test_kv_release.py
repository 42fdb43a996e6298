"""Which blocks a cascade reader gives back and its mirror (`kmesh_blend.vllm.kv_release`), no
vLLM: after a reader's segment-only blocks go back and are written over (another request got
them), its cascade decode still equals attention over its whole prompt — the blocks are never
read again, and the rows of its own they held come from its mirror.
"""

from __future__ import annotations

import pytest
import torch

from kmesh_blend.vllm.kv_release import Sharing, releasable_blocks
from tests.attention.test_compose import BLOCK, LAYOUTS, _attend, _case


@pytest.mark.parametrize(
    ("ranges", "first", "num_tokens", "want"),
    [
        ([(5, 19)], 0, 24, [2, 3]),  # blocks [8, 12) and [12, 16) lie inside [5, 19)
        ([(4, 12)], 0, 12, [1, 2]),  # a segment up to the prompt's end
        ([(4, 12)], 0, 11, [1]),  # the last, partial block stays (generated rows go there)
        ([(4, 12)], 6, 16, [2]),  # before `first`: maybe an exact prefix hit others share
        ([(0, 6), (6, 12)], 0, 16, [0, 1, 2]),  # adjacent uses cover the block between them
        ([(2, 9), (5, 14)], 0, 16, [1, 2]),  # overlapping uses
        ([(1, 3)], 0, 16, []),  # no block wholly inside
    ],
)
def test_releasable_blocks(ranges: list[tuple[int, int]], first: int, num_tokens: int,
                           want: list[int]) -> None:  # fmt: skip
    assert releasable_blocks(ranges, first, num_tokens, BLOCK, 100) == want


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_released_blocks_are_never_read_again(name: str) -> None:
    plans, contexts, caches, layout, rope = _case(LAYOUTS[name])
    sharing = Sharing(None)
    for plan in plans:
        assert plan.arm(layout, caches, rope) is None
        field, nbytes = sharing.consider(plan, BLOCK, layout, caches)
        assert field == "mirror_bytes" and plan.release is not None
        assert nbytes == plan.release.mirror.nbytes > 0  # one replaced row per copy and layer
    released = [b for plan in plans if plan.release for b in plan.release.block_ids]
    assert released and len(set(released)) == len(released)
    for cache in caches:  # another request's rows now
        cache[released] = torch.randn_like(cache[released]) * 100
    out, _ = _attend(plans, contexts, caches, layout, rope)
    for got, want in out:
        assert float((got - want).abs().max()) <= 1e-5
    pending = sharing.take()
    assert {r: [b for _, b in blocks] for r, blocks in pending.items()} == {
        plan.req_id: plan.release.block_ids for plan in plans if plan.release
    }


def test_overwritten_blocks_are_caught_without_the_mirror() -> None:
    """The check can fail: with the mirror dropped (its rows read from the overwritten blocks
    instead), the output moves far past the bound."""
    plans, contexts, caches, layout, rope = _case(LAYOUTS["apart"])
    sharing = Sharing(None)
    for plan in plans:
        assert plan.arm(layout, caches, rope) is None
        sharing.consider(plan, BLOCK, layout, caches)
        assert plan.release is not None
        released = plan.release.block_ids
        plan.release = None  # own rows read from the blocks again
    for cache in caches:
        cache[released] = torch.randn_like(cache[released]) * 100
    out, _ = _attend(plans, contexts, caches, layout, rope)
    assert max(float((got - want).abs().max()) for got, want in out) > 1e-2


def test_mirrors_stay_within_the_host_bytes_cap() -> None:
    """``kmesh.share_kv_host_bytes``: once the mirrors held would pass the cap, a reader keeps
    its blocks and says why; one that fits still gives its blocks back."""
    plans, _, caches, layout, rope = _case(LAYOUTS["beside_a_single_reader"])
    for plan in plans:
        assert plan.arm(layout, caches, rope) is None
    probe = Sharing(None)
    _, first = probe.consider(plans[0], BLOCK, layout, caches)
    plans[0].release = None
    sharing = Sharing(None, cap=int(first))
    assert sharing.consider(plans[0], BLOCK, layout, caches) == ("mirror_bytes", first)
    field, why = sharing.consider(plans[1], BLOCK, layout, caches)
    assert field == "kv_share_off" and "kmesh.share_kv_host_bytes" in str(why)
    assert plans[1].release is None and list(sharing.take()) == [plans[0].req_id]
