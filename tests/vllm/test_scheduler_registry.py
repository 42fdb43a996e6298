"""The scheduler side's registries without an engine: bounded, consistent, asked once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kmesh_blend.vllm.scheduler_side as scheduler_module
from kmesh_blend.config import KMeshConfig
from kmesh_blend.segments.identity import make_namespace
from kmesh_blend.vllm.meta import KMeshWorkerMetadata
from kmesh_blend.vllm.registry import LruDict, LruSet
from kmesh_blend.vllm.scheduler_side import SchedulerSide
from kmesh_blend.vllm.seam.blocks import step_requests


def _side() -> SchedulerSide:
    ns = make_namespace("m", torch.float32, num_layers=2, num_kv_heads=1, head_dim=32, rope={})
    return SchedulerSide(KMeshConfig(), ns, max_model_len=4096)


def _request(req_id: str, spans: list[list[int]] | None, n: int = 64, **kw: Any) -> Any:
    params = {"kmesh": {"segments": spans, **kw}} if spans is not None else None
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params,
                           prompt_token_ids=list(range(3, 3 + n)), cache_salt=None)  # fmt: skip


def test_a_request_waiting_for_memory_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    side, calls = _side(), []
    real = scheduler_module.segment_ids
    monkeypatch.setattr(scheduler_module, "segment_ids", lambda *a: calls.append(1) or real(*a))
    req = _request("r", [[4, 40]])
    assert side.num_matched(req, 0) == 0  # nothing stored yet
    assert side.num_matched(req, 0) == 0 and len(calls) == 1  # asked again: same answer
    assert side.num_matched(req, 32) == 0 and len(calls) == 2  # another prefix hit: re-planned


def test_lost_masters_are_unpublished_and_the_failed_request_stores_them() -> None:
    side = _side()
    req = _request("r", [[4, 40]])
    side.num_matched(req, 0)
    segment = side.plans["r"].segments[0].segment_id
    side.segments.published.add(segment)
    assert side.num_matched(_request("f", [[4, 40]]), 0) == 40  # up to the segment's end
    side.after_alloc("f", 40)
    side.plans["f"].blocks = [0, 1]  # scheduled
    out = KMeshWorkerMetadata(reports={"f": {"fallback": "load error: miss"}}, lost=[segment])
    side.on_worker_output(out)
    assert segment not in side.segments.published
    assert side.plans["f"].saves[0].segment_id == segment and not side.plans["f"].saved


def test_registries_are_bounded() -> None:
    s: LruSet[int] = LruSet(3)
    s.update([1, 2, 3])
    assert 1 in s  # checking makes it the newest
    s.add(4)
    assert 2 not in s and 1 in s and len(s) == 3
    evicted: list[tuple[int, str]] = []
    d: LruDict[int, str] = LruDict(2, on_evict=lambda k, v: evicted.append((k, v)))
    d[1], d[2], d[3] = "a", "b", "c"
    assert evicted == [(1, "a")] and d.get(2) == "b" and len(d) == 2
    with pytest.raises(ValueError, match="capacity"):
        LruSet(0)


def test_evicted_turn_records_leave_no_lookup_behind() -> None:
    from kmesh_blend.vllm.turn_registry import TurnRegistry, _Record

    turns = TurnRegistry(2)
    for i in range(3):
        record, head = f"t{i}", (i,) * 16
        turns._keeping[record] = _Record(100 + i, [], head)
        turns.stored([record])
    assert len(turns.records) == 2 and "t0" not in turns.records
    assert (0,) * 16 not in turns._lengths and turns._lengths[(2,) * 16] == {102: 1}


def test_keeps_of_finished_requests_that_were_never_stored_are_dropped() -> None:
    side = _side()
    req = _request("r", [[4, 40]], keep=True)
    side.num_matched(req, 0)
    side.plans["r"].keep = side.turns.keep(side.namespace, list(range(64)), [])
    assert side.turns.num_pending == 1
    side.finished(req.request_id)
    side.build_meta([])
    assert side.turns.num_pending == 0


def _empty_step() -> Any:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                             resumed_req_ids=set())  # fmt: skip
    return SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=cached)  # fmt: skip


def test_rounds_and_closes_reach_the_worker_until_it_applied_them() -> None:
    side = _side()
    assert side.build_meta([]).rounds == {}  # no round announced yet
    side.num_matched(_request("a", [[4, 40]], round=3, family="f", close=True), 0)
    side.num_matched(_request("b", [[4, 40]], round=1), 0)  # rounds only move forward
    assert side.build_meta([]).rounds == {"": 3}
    assert side.build_meta([]).rounds == {"": 3}  # sent again: no answer yet
    side.on_worker_output(KMeshWorkerMetadata(rounds={"": 3}))
    assert side.build_meta([]).rounds == {}
    side.finished("a")
    assert side.build_meta([]).closes == [(1, '["", "f"]')]
    assert side.build_meta([]).closes == [(1, '["", "f"]')]  # sent again
    side.on_worker_output(KMeshWorkerMetadata(closed_upto=1))
    assert side.build_meta([]).closes == []


def test_a_retired_segment_is_reported_and_stored_again() -> None:
    side = _side()
    side.num_matched(_request("r", [[4, 40]], round=0), 0)
    segment = side.plans["r"].segments[0].segment_id
    side.segments.published.add(segment)
    side.on_worker_output(KMeshWorkerMetadata(retired={segment: 0}))
    assert segment not in side.segments.published
    assert side.num_matched(_request("f", [[4, 40]], round=2), 0) == 0  # computes it
    report = side.plans["f"].report
    assert report["fallback"].startswith(f"master retired: segment {segment[:16]}")
    assert [r.segment_id for r in side.plans["f"].saves] == [segment]  # stores it again
    side.on_worker_output(KMeshWorkerMetadata(published=[segment]))
    assert segment in side.segments.published and segment not in side.segments.retired


def test_rounds_and_families_are_per_tenant() -> None:
    side = _side()
    side.num_matched(_request("a", [[4, 40]], round=5, family="f"), 0)
    salted = _request("b", [[4, 40]], round=60, family="f")
    salted.cache_salt = "tenant-b"
    side.num_matched(salted, 0)
    rounds = side.build_meta([]).rounds
    assert rounds == {"": 5, "tenant-b\x00": 60}  # each tenant's own clock
    assert side.plans["a"].family != side.plans["b"].family  # one name, two families


def test_a_round_too_far_ahead_is_refused_naming_the_field() -> None:
    side = _side()  # kmesh.max_round_jump: 64
    side.num_matched(_request("a", [[4, 40]], round=64), 0)
    side.num_matched(_request("b", [[4, 40]], round=2**62), 0)
    report = side.plans["b"].report
    assert report["fallback"] is not None and report["fallback"].startswith("round refused: round=")
    assert "kmesh.max_round_jump" in report["fallback"]
    assert side.build_meta([]).rounds == {"": 64}  # the refused one moved nothing
    side.num_matched(_request("c", [[4, 40]], round=128), 0)  # 64 past the new round: fine
    assert side.plans["c"].report["fallback"] is None


def test_a_preempted_request_keeps_what_it_reused() -> None:
    side = _side()
    req = _request("r", [[4, 40]])
    side.num_matched(req, 0)
    side.segments.published.add(side.plans["r"].segments[0].segment_id)
    assert side.num_matched(req, 0) == 0  # planned before the segment was stored: same answer
    side.plans.pop("r")
    assert side.num_matched(req, 0) == 40
    side.after_alloc(req.request_id, 40)
    side.plans["r"].blocks = [0, 1]  # scheduled, blended:
    side.on_worker_output(
        KMeshWorkerMetadata(
            reports={
                "r": {
                    "reused_tokens": 30,
                    "recomputed_tokens": 6,
                    "storage_reads": 1,
                    "cascade_steps": 3,
                }
            }
        )
    )
    # preempted; asked again: this time its own blocks are in the prefix cache
    assert side.num_matched(req, 32) == 8
    side.on_worker_output(KMeshWorkerMetadata(reports={"r": {
        "reused_tokens": 10, "recomputed_tokens": 4, "storage_reads": 0, "cascade_steps": 2,
        "cascade_off": "its blocks changed (preempted and rescheduled)"}}))  # fmt: skip
    report = side.finished(req.request_id)["kmesh"]  # type: ignore[index]
    assert report["preemptions"] == 1 and report["fallback"] is None
    assert (report["reused_tokens"], report["recomputed_tokens"]) == (40, 10)
    assert (report["storage_reads"], report["cascade_steps"]) == (1, 5)
    assert report["cascade_off"] == "its blocks changed (preempted and rescheduled)"


def test_cascade_off_names_every_reason_once() -> None:
    side = _side()
    req = _request("r", [[4, 40]])
    side.num_matched(req, 0)
    for why in ("a", "b", "a"):
        side.on_worker_output(KMeshWorkerMetadata(reports={"r": {"cascade_off": why}}))
    assert side.plans["r"].report["cascade_off"] == "a; b"


def test_a_resumed_request_is_loaded_into_its_new_blocks() -> None:
    """vLLM brings a preempted request back among the cached requests (``resumed_req_ids``),
    with all its blocks anew: the tokens matched for it must be loaded there."""
    side = _side()
    req = _request("r", [[4, 40]])
    side.num_matched(req, 0)
    side.segments.published.add(side.plans["r"].segments[0].segment_id)
    side.plans.pop("r")
    new = SimpleNamespace(req_id="r", block_ids=([0, 1],), num_computed_tokens=0)
    step = _empty_step()
    step.scheduled_new_reqs = [new]
    assert side.num_matched(req, 0) == 40
    side.after_alloc(req.request_id, 40)
    assert [load.block_ids for load in side.build_meta(step_requests(step)).loads] == [[0, 1]]
    assert side.num_matched(req, 0) == 40  # preempted, asked again
    side.after_alloc(req.request_id, 40)
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[([5, 6],)], num_computed_tokens=[0],
                             resumed_req_ids={"r"})  # fmt: skip
    step = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=cached)  # fmt: skip
    loads = side.build_meta(step_requests(step)).loads
    assert [(load.req_id, load.block_ids) for load in loads] == [("r", [5, 6])]


@pytest.mark.parametrize(
    ("spans", "n", "settings", "matched", "end"),
    [
        ([[4, 40]], 64, {}, 40, 40),  # vLLM computes the 24 new tokens after the segment
        ([[4, 20], [30, 40]], 64, {}, 40, 40),  # the last loaded segment bounds the blend
        ([[4, 62]], 64, {}, 62, None),  # only vLLM's own tail left: the whole prompt
        ([[4, 40]], 64, {"recompute_ratio": 1.0}, 62, None),  # exact: one batch, stock's bits
        ([[4, 40]], 64, {"keep": True}, 62, None),  # its turn record needs every prompt token
        ([[4, 40]], 64, {"cascade": True}, 40, 40),  # cascade decode stops early too
    ],
)
def test_the_blend_stops_at_the_last_reused_segment(
    spans: list[list[int]], n: int, settings: dict[str, Any], matched: int, end: int | None
) -> None:
    side = _side()
    if settings.pop("cascade", False):
        side.config = KMeshConfig(cascade_decode=True)
    side.num_matched(_request("r", spans, n=n), 0)
    side.segments.published.update(ref.segment_id for ref in side.plans.pop("r").segments)
    req = _request("f", spans, n=n, **settings)
    assert side.num_matched(req, 0) == matched
    side.after_alloc("f", matched)
    new = SimpleNamespace(req_id="f", block_ids=([0, 1, 2, 3],), num_computed_tokens=0)
    step = _empty_step()
    step.scheduled_new_reqs = [new]
    (load,) = side.build_meta(step_requests(step)).loads
    assert load.end == end and load.blend_len == (n if end is None else end)
    assert load.tail == (2 if end is None else 0)  # rows written after vLLM's forward
