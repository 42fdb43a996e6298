"""The speed guard (``kmesh.speed_guard``): decided from the engine's own timings.

Unit tests of the decision (plain Python), then real vLLM (tiny Llama, fp32): a cascade path made
slower than vLLM's kernel (a sleep injected into it) is kept out — every reader decodes on vLLM's
kernel and says why, the log line and the ``/metrics`` gauges say so, greedy tokens equal an
engine without cascade; a cascade path that wins (vLLM's kernel slowed in the probe) is kept:
every follow-up decodes in cascade, to the same tokens; and one that loses only under load (the
start-up figures say vLLM's kernel costs almost nothing per row) is switched off after its first
weighed steps: later readers decode on vLLM's kernel, saying why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.vllm.cascade_timing import RETRY
from kmesh_blend.vllm.memory_value import LEAST, StepFit
from kmesh_blend.vllm.speed_guard import (
    EVIDENCE,
    SpeedGuard,
    Timing,
    sign_needed,
    waits_for_blocks,
)
from kmesh_blend.vllm.stats import GAUGES
from tests.vllm.test_cascade_decode import FP32_LOGPROB_BOUND, MAX_TOKENS, _serve

SURE = next(n for n in range(1, EVIDENCE) if sign_needed(n) <= n)  # steps, every one lost


def _timing(family: float, alone: float) -> Timing:
    """Ratios cascade / vLLM of ``family`` and ``alone`` (vLLM's times 1 ms)."""
    return Timing(8, 1024, 1000, family * 1e-3, 1e-3, alone * 1e-3, 1e-3)


def test_a_family_slower_than_vllm_keeps_new_readers_out() -> None:
    guard = SpeedGuard.decide("auto", _timing(1.2, 2.0))
    assert not guard.admits and guard.reason is not None
    assert "speed guard" in guard.reason and "1.20x" in guard.reason
    assert guard.gauges() == {"cascade_guard_admits": 0, "cascade_guard_family_permille": 1200,
                              "cascade_guard_alone_permille": 2000,
                              "cascade_guard_load_permille": 0,
                              "cascade_guard_memory_short": 0,
                              "cascade_guard_freed_permille": 0,
                              "cascade_guard_added_permille": 0,
                              "cascade_guard_bought_permille": 0,
                              "cascade_guard_break_even_steps": 0,
                              "cascade_guard_retries": 0}  # fmt: skip
    assert "new readers decode on vLLM's kernel" in guard.line()
    # where requests wait for KV blocks, memory is the bottleneck: readers (and sharing) stay
    assert guard.note_memory(True) is not None and guard.admits and guard.memory_short


@pytest.mark.parametrize(("alone", "on_stock"), [(1.5, True), (0.9, False)])
def test_a_family_that_wins_is_kept_and_a_lone_reader_goes_where_it_is_faster(
    alone: float, on_stock: bool
) -> None:
    guard = SpeedGuard.decide("auto", _timing(0.7, alone))
    assert guard.admits and guard.reason is None and guard.alone_on_stock == on_stock
    assert "pays here" in guard.line() and "0.70x" in guard.line()


def test_off_and_an_untimed_path_trust_the_settings() -> None:
    off = SpeedGuard.decide("off", _timing(5.0, 5.0))
    assert off.admits and not off.alone_on_stock and off.timing is None
    assert "off" in off.line() and off.gauges()["cascade_guard_family_permille"] == 0
    failed = SpeedGuard.decide("auto", None, "RuntimeError: no scratch")
    assert failed.admits and "RuntimeError: no scratch" in failed.line()
    assert set(off.gauges()) <= set(GAUGES)  # registered on /metrics


def _step(cascade_ms: float, rows: int) -> Any:
    from kmesh_blend.vllm.cascade_clock import StepParts

    return StepParts(1, 4, 0, plan_s=0.0, cascade_s=cascade_ms * 1e-3, context_rows=rows)


def test_a_path_that_costs_more_under_load_is_switched_off_unless_memory_is_short() -> None:
    guard = SpeedGuard.decide("auto", _timing(0.5, 0.5))  # vLLM: 1 ms / (8 × 1000 rows), layer
    # a path that loses every step is off once that is unlikely by chance (sign test: 5 steps)
    lines = [guard.observe(_step(3.0, 8000), layers=2) for _ in range(SURE)]  # est. 2 ms
    assert lines[:-1] == [None] * (SURE - 1) and guard.load_ratio == pytest.approx(1.5)
    assert not guard.admits and "under this load" in (lines[-1] or "") and "1.50x" in lines[-1]
    assert guard.gauges()["cascade_guard_load_permille"] == 1500
    assert "requests wait for KV blocks" in (guard.note_memory(True) or "") and guard.admits
    for _ in range(200):  # a window without waiting requests, and cheap steps: on again
        guard.note_memory(False)
        guard.observe(_step(1.0, 8000), layers=2)
    assert guard.admits and guard.load_ratio == pytest.approx(0.5)


def test_steps_where_no_master_is_shared_are_weighed_apart_and_send_lone_readers_to_vllm() -> None:
    """Lone steps (every master read by one request) share nothing: losing ones send lone readers
    to vLLM's kernel and leave the weighing of the path (steps that share) untouched; lone steps
    that win keep them in cascade."""
    lone_loses, lone_wins = (SpeedGuard.decide("auto", _timing(0.5, 0.5)) for _ in range(2))
    assert not lone_loses.alone_on_stock and not lone_wins.alone_on_stock
    for guard, ms, steps in ((lone_loses, 3.0, SURE), (lone_wins, 1.0, EVIDENCE)):
        step = _step(ms, 8000)  # vLLM's estimate: 2 ms
        step.lone = True
        lines = [guard.observe(step, layers=2) for _ in range(steps)]
        assert guard.load_ratio is None and guard.admits  # the path itself: not weighed yet
        if guard is lone_loses:  # off for lone readers once surely slower (5 of 5): one line
            assert lines[:-1] == [None] * (SURE - 1) and "1.50x" in (lines[-1] or "")
            assert guard.alone_on_stock and "read on vLLM's kernel" in guard.line()
        else:
            assert set(lines) == {None} and not guard.alone_on_stock
    waiting = SpeedGuard.decide("auto", _timing(0.5, 0.5))
    waiting.note_memory(True)  # requests wait for blocks: lone readers' blocks count, weighed whole
    step = _step(3.0, 8000)
    step.lone = True
    for _ in range(SURE):
        waiting.observe(step, layers=2)
    assert not waiting.alone_on_stock and waiting.load_ratio == pytest.approx(1.5)
    for _ in range(EVIDENCE):  # steps that share pay: the path stays on, lone readers off it
        lone_loses.observe(_step(1.0, 8000), layers=2)
    assert lone_loses.admits and lone_loses.load_ratio == pytest.approx(0.5)
    assert lone_loses.alone_on_stock


def test_a_path_off_under_load_is_weighed_again_later_and_kept_where_it_pays() -> None:
    guard = SpeedGuard.decide("auto", _timing(0.5, 0.5))
    for _ in range(SURE):  # a workload's first steps: the path loses every one
        guard.observe(_step(3.0, 8000), layers=2)
    assert not guard.admits and guard.state == "load"

    def off_for(steps: int) -> list[str | None]:
        return [guard.note_memory(False) for _ in range(steps)]

    lines = off_for(RETRY)
    assert lines[:-1] == [None] * (RETRY - 1) and "weighed again" in (lines[-1] or "")
    assert guard.admits and guard.load_ratio is None and guard.retry.tries == 1
    assert guard.gives_back is not None  # blocks stay until the new weighing shows it pays
    for _ in range(SURE):  # it loses again: off, and the next try waits twice as long
        guard.observe(_step(3.0, 8000), layers=2)
    assert not guard.admits
    assert set(off_for(2 * RETRY - 1)) == {None} and not guard.admits
    assert "weighed again" in (off_for(1)[0] or "") and guard.retry.tries == 2
    assert guard.gauges()["cascade_guard_retries"] == 2
    for _ in range(EVIDENCE):  # the load changed (larger families): now it pays, and stays
        guard.observe(_step(1.0, 8000), layers=2)
    assert guard.admits and guard.load_ratio == pytest.approx(0.5) and guard.gives_back is None
    assert set(off_for(4 * RETRY)) == {None} and guard.retry.tries == 2


def test_where_requests_wait_for_blocks_sharing_stays_while_the_blocks_outweigh_its_cost() -> None:
    # vLLM's kernel: 2 ms a step for these requests; the path 3 ms, steps of 20 ms: it adds 1 ms
    # of 20 (5 %) to each step
    def weigh(freed: float, fixed: float | None = None, arm_ms: float = 0.0) -> SpeedGuard:
        guard = SpeedGuard.decide("auto", _timing(0.5, 0.5))
        guard.note_memory(True)
        if fixed is not None:  # engine steps: 10 ms fixed + 1 ms per token for ``fixed`` = 0.5
            for tokens in [5, 15] * 20:
                guard.note_step(tokens, (10 + tokens * (1 - fixed) / fixed) * 1e-3)
        step = _step(3.0, 8000)
        step.arm_s = step.plan_s = arm_ms * 1e-3
        step.period_s = 20e-3
        assert guard.gives_back is not None  # before the path is weighed, no block goes back
        for _ in range(EVIDENCE):
            guard.observe(step, layers=2, freed=freed)
        return guard

    pays = weigh(freed=0.10)  # a tenth of the pool given back: more requests in flight
    assert pays.state == "memory" and pays.admits and pays.gives_back is None
    assert pays.added == pytest.approx(0.05) and pays.keeps_out(1) is None
    assert "requests wait for KV blocks: sharing stays" in pays.line()
    costly = weigh(freed=0.02)  # 2 % of the pool does not buy 5 % of every step
    assert costly.state == "costly" and not costly.admits and costly.memory_short
    assert "adds 5.0% to each step's time" in (costly.reason or "")
    assert "2.0% of vLLM's pool" in (costly.reason or "") and costly.gives_back == costly.reason
    gauges = costly.gauges()
    assert gauges["cascade_guard_added_permille"] == 50
    assert gauges["cascade_guard_freed_permille"] == 20 and gauges["cascade_guard_admits"] == 0
    # arming is part of the blocks' price: 2 ms of it a step makes 15 %
    assert weigh(freed=0.10, arm_ms=2.0).state == "costly"
    # steps that grow with their tokens: only their fixed part is spread over more requests
    half = weigh(freed=0.12, fixed=0.5)
    assert half.fit.fixed_share == pytest.approx(0.5) and half.bought == pytest.approx(0.06)
    assert half.state == "memory"
    tenth = weigh(freed=0.12, fixed=0.1)  # a CPU's prefill chunks: 1.2 % bought, 5 % paid
    assert tenth.state == "costly" and "10% of a step's time not growing" in (tenth.reason or "")
    assert tenth.gauges()["cascade_guard_bought_permille"] == 12
    # before any step is weighed the wait decides, as before
    unweighed = SpeedGuard.decide("auto", _timing(1.2, 1.2))
    unweighed.note_memory(True)
    assert unweighed.state == "memory" and unweighed.added is None


def test_a_step_fit_finds_the_part_of_a_step_that_does_not_grow_with_its_tokens() -> None:
    fit = StepFit()
    for tokens in range(1, LEAST):
        fit.add(tokens, 0.030 + 0.002 * tokens)
    assert fit.fixed_share is None  # too few steps
    fit.add(LEAST, 0.030 + 0.002 * LEAST)
    mean = 0.030 + 0.002 * (LEAST + 1) / 2
    assert fit.fixed_share == pytest.approx(0.030 / mean)
    flat = StepFit()
    for _ in range(LEAST):
        flat.add(8, 0.05)
    assert flat.fixed_share is None  # every step of one size: no line
    for tokens in range(LEAST):
        flat.add(tokens + 1, 0.05)  # time that does not grow with tokens: all of it fixed
    assert flat.fixed_share == pytest.approx(1.0)
    flat.add(0, 1.0)  # (a step without tokens, or an idle gap, is not a sample)
    assert flat.fixed_share == pytest.approx(1.0)


def test_a_path_that_loses_only_some_steps_is_weighed_after_the_evidence() -> None:
    guard = SpeedGuard.decide("auto", _timing(0.5, 0.5))
    costs = [3.0, 1.9] * EVIDENCE  # it costs more on the whole, but wins every other step
    lines = [guard.observe(_step(ms, 8000), layers=2) for ms in costs[:EVIDENCE]]
    assert lines[:-1] == [None] * (EVIDENCE - 1) and guard.load_ratio == pytest.approx(1.225)
    assert not guard.admits and "under this load" in (lines[-1] or "")


def test_a_reader_too_short_to_repay_its_arming_is_not_armed() -> None:
    # the family gains (1 - 0.8) ms / 8 readers a step; arming one costs 0.5 ms: 20 steps
    timing = Timing(8, 1024, 1000, 0.8e-3, 1e-3, 1e-3, 1e-3, arm_s=0.5e-3)
    guard = SpeedGuard.decide("auto", timing)
    assert timing.break_even == pytest.approx(20) and guard.admits
    assert "repaid after 20 decode steps" in (guard.keeps_out(19) or "")
    assert guard.keeps_out(21) is None and guard.keeps_out(None) is None  # unknown: armed
    assert guard.gauges()["cascade_guard_break_even_steps"] == 20
    assert "repaid after 20 decode steps" in guard.line()
    guard.note_memory(True)  # requests wait for blocks: what sharing gives back is the payoff
    assert guard.keeps_out(1) is None
    never = SpeedGuard.decide("auto", Timing(8, 1024, 1000, 1e-3, 1e-3, 1e-3, 1e-3, arm_s=1e-4))
    assert "never repaid" in (never.keeps_out(10**6) or "")
    assert never.gauges()["cascade_guard_break_even_steps"] == -1
    assert SpeedGuard.decide("auto", _timing(0.5, 0.5)).keeps_out(1) is None  # arming untimed


def test_a_request_waits_for_blocks_only_where_the_pool_cannot_hold_its_next_chunk() -> None:
    assert waits_for_blocks([300], block_size=128, budget=2048, free=2)  # 3 blocks > 2
    assert not waits_for_blocks([300], block_size=128, budget=2048, free=3)
    assert not waits_for_blocks([5000], block_size=128, budget=256, free=2)  # one chunk: 2
    assert not waits_for_blocks([], block_size=128, budget=256, free=0)


def _slowed(real: Callable[..., Any], seconds: float = 0.003) -> Callable[..., Any]:
    def slow(*args: Any) -> Any:
        time.sleep(seconds)
        return real(*args)

    return slow


class _Lines(logging.Filter):
    """Records what a logger logs (a filter: vLLM's logging set-up clears our loggers'
    handlers at engine start, not their filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.lines.append(record.getMessage())
        return True


def _installed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The cascade paths engines install from now on (their guards)."""
    import kmesh_blend.vllm.worker_side as worker_side

    got: list[Any] = []
    real = worker_side.install_cascade

    def spy(*args: Any) -> Any:
        out = real(*args)
        got.append(out[0])
        return out

    monkeypatch.setattr(worker_side, "install_cascade", spy)
    return got


def _same_tokens(on: list[Any], off: list[Any]) -> None:
    for (tokens_on, lp_on, _), (tokens_off, lp_off, _) in zip(on, off, strict=True):
        assert tokens_on == tokens_off
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off, strict=True)) <= FP32_LOGPROB_BOUND


def test_a_slower_cascade_path_is_kept_out_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from kmesh_blend.vllm.cascade_decode import CascadeDecode

    for name in ("_run_kernel", "_attend"):  # whichever implementation serves
        monkeypatch.setattr(CascadeDecode, name, _slowed(getattr(CascadeDecode, name)))
    installed = _installed(monkeypatch)
    lines = _Lines()
    logging.getLogger("vllm.kmesh_blend").addFilter(lines)
    try:
        path, doc_len = build_checkpoint(TINY_LLAMA), 300
        on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True,
                    share_kv_memory=True, speed_guard="auto")  # fmt: skip
    finally:
        logging.getLogger("vllm.kmesh_blend").removeFilter(lines)
    monkeypatch.undo()
    guard = installed[0].guard
    assert not guard.admits and guard.timing.family_ratio > 1.0, guard
    assert installed[0].gauges()["cascade_guard_admits"] == 0
    assert sum("speed guard" in line and "slower" in line for line in lines.lines) == 1
    for _, _, report in on[:-1]:
        assert "cascade_steps" not in report and "released_blocks" not in report, report
        assert report["cascade_off"] == guard.reason, report
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False))


def test_a_cascade_path_that_wins_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from kmesh_blend.vllm.seam import cpu_attention

    real = cpu_attention.stock_forward
    # 50 ms a call: also what the guard then expects vLLM's kernel to cost per step while
    # serving, far above what the tiny model's cascade steps cost (planning included)
    monkeypatch.setattr(cpu_attention, "stock_forward", lambda layer: _slowed(real(layer), 0.05))
    installed = _installed(monkeypatch)
    path, doc_len = build_checkpoint(TINY_LLAMA), 300
    on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True, speed_guard="auto")
    monkeypatch.undo()
    guard = installed[0].guard
    assert guard.admits and not guard.alone_on_stock and guard.timing.family_ratio < 1.0, guard
    assert installed[0].gauges()["cascade_guard_admits"] == 1
    for _, _, report in on[:-1]:
        assert report["cascade_steps"] == MAX_TOKENS["tiny"] - 1, report
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False))


def test_readers_whose_decode_cannot_repay_arming_stay_on_vllm_s_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kmesh_blend.vllm.cascade_install as cascade_install

    # the family wins per step, but arming a reader costs 8,000 of its gains: never repaid here
    timing = Timing(8, 1024, 1089, 1e-3, 2e-3, 1e-3, 2e-3, arm_s=1.0)
    monkeypatch.setattr(cascade_install, "probe", lambda *args, **kwargs: timing)
    installed = _installed(monkeypatch)
    path, doc_len = build_checkpoint(TINY_LLAMA), 300
    on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True, share_kv_memory=True,
                speed_guard="auto")  # fmt: skip
    monkeypatch.undo()
    guard = installed[0].guard
    assert guard.admits and installed[0].gauges()["cascade_guard_break_even_steps"] == 8000
    for _, _, report in on[:-1]:
        assert "released_blocks" not in report and report.get("cascade_steps", 0) == 0, report
        assert "repaid after 8000 decode steps" in report["cascade_off"], report
        assert f"at most {MAX_TOKENS['tiny'] - 1} more" in report["cascade_off"], report
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False))


def test_readers_sharing_fewer_rows_than_their_own_stay_on_vllm_s_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kmesh_blend.vllm.cascade_install as cascade_install

    # the family wins and arming is repaid at once; but each follow-up recomputes 80 % of its
    # document, so it reads fewer prompt rows from the master than of its own
    timing = Timing(8, 1024, 1089, 1e-3, 2e-3, 1e-3, 2e-3, arm_s=1e-6)
    monkeypatch.setattr(cascade_install, "probe", lambda *args, **kwargs: timing)
    installed = _installed(monkeypatch)
    path, doc_len = build_checkpoint(TINY_LLAMA), 300
    on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True, share_kv_memory=True,
                speed_guard="auto", recompute_ratio=0.8)  # fmt: skip
    monkeypatch.undo()
    assert installed[0].guard.timing is timing and not installed[0].clock.steps  # none in cascade
    for _, _, report in on[:-1]:
        assert "released_blocks" not in report and report.get("cascade_steps", 0) == 0, report
        assert "read from masters, fewer than its own" in report["cascade_off"], report
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False,
                            recompute_ratio=0.8))  # fmt: skip


def test_a_lone_reader_is_armed_only_where_the_path_is_surely_faster_alone_or_memory_pays(
) -> None:  # fmt: skip
    # a family wins; one alone about equal (5 of 11 paired runs lost): neither way is sure
    equal = Timing(8, 1024, 1000, 0.5e-3, 1e-3, 1.0e-3, 1e-3, runs=11, alone_lost=5)
    guard = SpeedGuard.decide("auto", equal)
    assert guard.admits and not guard.alone_on_stock and not guard.arms_alone
    assert guard.note_memory(True) is not None and guard.memory_pays and guard.arms_alone
    won = sign_needed(11)  # as many runs won as "slower" needs lost
    for ratio, lost, arms in ((0.8, 11 - won, True), (0.8, 12 - won, False), (1.01, 0, False)):
        alone = Timing(8, 1024, 1000, 0.5e-3, 1e-3, ratio * 1e-3, 1e-3, runs=11, alone_lost=lost)
        assert SpeedGuard.decide("auto", alone).arms_alone is arms, (ratio, lost)
    assert not SpeedGuard.decide("auto", _timing(0.7, 1.5)).arms_alone  # alone on vLLM's kernel
    assert SpeedGuard.decide("off", equal).arms_alone  # as configured
    assert SpeedGuard.decide("auto", None, "no scratch").arms_alone


def test_a_reader_alone_with_its_master_waits_for_a_sibling_while_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kmesh_blend.vllm.cascade_install as cascade_install

    # the family wins by far (vLLM's kernel a second per layer: the weighing under load keeps it
    # on); one reader alone costs what vLLM's kernel does: arming it alone would buy nothing
    timing = Timing(8, 1024, 1089, 1e-3, 1.0, 1.0, 1.0, runs=11, alone_lost=5)
    monkeypatch.setattr(cascade_install, "probe", lambda *args, **kwargs: timing)
    installed = _installed(monkeypatch)
    path, doc_len = build_checkpoint(TINY_LLAMA), 300
    on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True, speed_guard="auto")
    monkeypatch.undo()
    guard = installed[0].guard
    assert guard.admits and not guard.alone_on_stock and not guard.arms_alone, guard
    lone, families = on[0][2], [report for _, _, report in on[1:-1]]
    assert lone["cascade_steps"] == 0 and "cascade_off" not in lone, lone  # on vLLM's kernel
    assert all(r["cascade_steps"] == MAX_TOKENS["tiny"] - 1 for r in families), families
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False))


def test_a_path_that_loses_under_load_is_switched_off_while_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kmesh_blend.vllm.cascade_install as cascade_install

    # start-up: the family and a lone reader win, but vLLM's kernel costs ~nothing per row
    timing = Timing(8, 1024, 1089, 1e-9, 2e-9, 1e-9, 2e-9)
    monkeypatch.setattr(cascade_install, "probe", lambda *args, **kwargs: timing)
    installed = _installed(monkeypatch)
    lines = _Lines()
    logging.getLogger("vllm.kmesh_blend").addFilter(lines)
    try:
        path, doc_len = build_checkpoint(TINY_LLAMA), 300
        on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True, speed_guard="auto")
    finally:
        logging.getLogger("vllm.kmesh_blend").removeFilter(lines)
    monkeypatch.undo()
    guard = installed[0].guard
    assert not guard.admits and guard.load_ratio > 1.0 and "under this load" in guard.reason
    assert installed[0].gauges()["cascade_guard_load_permille"] > 1000
    assert sum("under this load" in line for line in lines.lines) == 1, lines.lines
    # the family of 1 decodes first, in cascade, its steps weighed apart (no master shared):
    # once they lose it goes on on vLLM's kernel with its blocks, a lone reader; the family of
    # 4 shares its master and is weighed: once the weighing turns the path off it leaves for
    # vLLM's kernel too; the family of 8 after it is out
    lone, family, later = on[0][2], [r for _, _, r in on[1:5]], [r for _, _, r in on[5:-1]]
    assert sum("every master has one reader" in line for line in lines.lines) == 1, lines.lines
    assert lone["cascade_steps"] == SURE < MAX_TOKENS["tiny"] - 1 and "cascade_off" not in lone
    assert all(r["cascade_steps"] == SURE and "under this load" in r["cascade_off"]
               for r in family), family  # fmt: skip
    assert all("cascade_steps" not in r and "under this load" in r["cascade_off"] for r in later)
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False))


def test_where_requests_wait_for_blocks_a_path_dearer_than_its_blocks_is_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kmesh_blend.vllm.cascade_install as cascade_install
    from kmesh_blend.vllm.cascade_decode import CascadeDecode

    timing = Timing(8, 1024, 1089, 1e-9, 2e-9, 1e-9, 2e-9)  # loses under load, as above
    monkeypatch.setattr(cascade_install, "probe", lambda *args, **kwargs: timing)
    # every step reaches the worker saying a request waits for blocks (the scheduler's signal,
    # `waits_for_blocks`, is tested above); the tiny model's readers give back a sliver of its
    # large pool, which buys far less than the path costs
    note = CascadeDecode.note_memory
    monkeypatch.setattr(CascadeDecode, "note_memory",
                        lambda self, short, tokens=0: note(self, True, tokens))  # fmt: skip
    installed = _installed(monkeypatch)
    lines = _Lines()
    logging.getLogger("vllm.kmesh_blend").addFilter(lines)
    try:
        path, doc_len = build_checkpoint(TINY_LLAMA), 300
        on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True, share_kv_memory=True,
                    speed_guard="auto")  # fmt: skip
    finally:
        logging.getLogger("vllm.kmesh_blend").removeFilter(lines)
    monkeypatch.undo()
    guard = installed[0].guard
    assert guard.state == "costly" and not guard.admits, guard.line()
    assert guard.added is not None and guard.bought < guard.added, guard.line()
    gauges = installed[0].gauges()
    assert gauges["cascade_guard_memory_short"] == 1 and gauges["cascade_guard_admits"] == 0
    assert gauges["cascade_guard_added_permille"] > gauges["cascade_guard_bought_permille"]
    costly = "requests wait for KV blocks, but the path adds"
    assert sum(costly in line for line in lines.lines) == 1, lines.lines
    # memory short and not weighed yet: the first reader is armed; once weighed, the path
    # costs more than the blocks buy, so it leaves with its blocks and the families after
    # it stay out
    first, later = on[0][2], [r for _, _, r in on[1:-1]]
    assert 0 < first["cascade_steps"] < MAX_TOKENS["tiny"] - 1, first
    assert costly in first["cascade_off"] and "released_blocks" not in first, first
    assert all("cascade_steps" not in r and costly in r["cascade_off"] for r in later), later
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False))


def test_sign_needed_is_the_one_sided_binomial_bound() -> None:
    assert [sign_needed(n) for n in (3, 4, 5, 11, 21)] == [4, 5, 5, 9, 15]
    # P(X >= 9 | 11 fair coins) = 67/2048 < 0.05; P(X >= 8) = 232/2048 > 0.05
    assert sign_needed(11, level=0.12) == 8 and sign_needed(0) == 1


@pytest.mark.parametrize(("lost", "slower"), [(11, True), (9, True), (8, False), (3, False)])
def test_a_start_up_slower_must_beat_the_noise(lost: int, slower: bool) -> None:
    # the fastest run says 1.2x; whether that stands depends on how many paired runs it lost
    timing = Timing(8, 1024, 1000, 1.2e-3, 1e-3, 1.5e-3, 1e-3, runs=11, family_lost=lost,
                    alone_lost=lost)  # fmt: skip
    guard = SpeedGuard.decide("auto", timing)
    assert guard.admits is not slower and guard.alone_on_stock is slower
    assert (guard.state == "slower") is slower and f"{lost} and {lost} of 11" in guard.line()
    # a fastest run that wins is never "slower", whatever the count
    wins = Timing(8, 1024, 1000, 0.9e-3, 1e-3, 0.9e-3, 1e-3, runs=11, family_lost=11,
                  alone_lost=11)  # fmt: skip
    assert SpeedGuard.decide("auto", wins).admits


def test_blocks_go_back_only_where_the_path_is_shown_to_pay_or_memory_is_short() -> None:
    guard = SpeedGuard.decide("auto", _timing(0.5, 0.5))  # vLLM: 1 ms / (8 × 1000 rows), layer
    assert guard.admits and "0 of 16 steps weighed" in (guard.gives_back or "")
    assert guard.note_memory(True) is not None and guard.admits  # requests wait: readers armed,
    assert "0 of 16 steps weighed" in (guard.gives_back or "")  # blocks back once weighed
    guard.note_memory(False)
    for _ in range(200):  # the window forgets the wait; cheap steps: the path pays
        guard.note_memory(False)
        guard.observe(_step(1.0, 8000), layers=2)
    assert guard.state == "pays" and guard.gives_back is None
    for _ in range(200):  # dear steps: off, and no block goes back
        guard.observe(_step(3.0, 8000), layers=2)
    assert not guard.admits and "under this load" in (guard.gives_back or "")
    assert SpeedGuard.decide("off", None).gives_back is None  # off trusts the settings


def test_readers_whose_blocks_went_back_stay_when_the_path_is_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kmesh_blend.vllm.cascade_install as cascade_install
    from kmesh_blend.cpu import cpu_kernel_expected

    if not cpu_kernel_expected():
        pytest.skip("blocks go back only on the CPU kernel")
    timing = Timing(8, 1024, 1089, 1e-9, 2e-9, 1e-9, 2e-9)  # loses under load, as above
    monkeypatch.setattr(cascade_install, "probe", lambda *args, **kwargs: timing)
    # blocks go back from the first reader on (as where requests wait for blocks)
    monkeypatch.setattr(SpeedGuard, "gives_back", property(lambda self: None))
    installed = _installed(monkeypatch)
    path, doc_len = build_checkpoint(TINY_LLAMA), 300
    on = _serve(path, "float32", "tiny", doc_len, cascade_decode=True, share_kv_memory=True,
                speed_guard="auto")  # fmt: skip
    monkeypatch.undo()
    assert not installed[0].guard.admits
    first = on[0][2]  # its blocks went back: only the cascade path can read it, to the end
    assert first["released_blocks"] > 0 and first["cascade_steps"] == MAX_TOKENS["tiny"] - 1
    assert "cascade_off" not in first, first
    _same_tokens(on, _serve(path, "float32", "tiny", doc_len, cascade_decode=False))
