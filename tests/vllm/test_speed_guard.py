"""The speed guard (``kmesh.speed_guard``): decided from the engine's own start-up timing.

Unit tests of the decision (plain Python), then real vLLM (tiny Llama, fp32): a cascade path made
slower than vLLM's kernel (a sleep injected into it) is kept out — every reader decodes on vLLM's
kernel and says why, the log line and the ``/metrics`` gauges say so, greedy tokens equal an
engine without cascade — and a cascade path that wins (vLLM's kernel slowed in the probe) is
kept: every follow-up decodes in cascade, to the same tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.vllm.speed_guard import SpeedGuard, Timing
from kmesh_blend.vllm.stats import GAUGES
from tests.vllm.test_cascade_decode import FP32_LOGPROB_BOUND, MAX_TOKENS, _serve


def _timing(family: float, alone: float) -> Timing:
    """Ratios cascade / vLLM of ``family`` and ``alone`` (vLLM's times 1 ms)."""
    return Timing(8, 1024, family * 1e-3, 1e-3, alone * 1e-3, 1e-3)


def test_a_family_slower_than_vllm_keeps_new_readers_out() -> None:
    guard = SpeedGuard.decide("auto", _timing(1.2, 2.0))
    assert not guard.admits and guard.reason is not None
    assert "speed guard" in guard.reason and "1.20x" in guard.reason
    assert guard.gauges() == {"cascade_guard_admits": 0, "cascade_guard_family_permille": 1200,
                              "cascade_guard_alone_permille": 2000}  # fmt: skip
    assert "new readers decode on vLLM's kernel" in guard.line()


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


def _slowed(real: Callable[..., Any]) -> Callable[..., Any]:
    def slow(*args: Any) -> Any:
        time.sleep(0.003)
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
    monkeypatch.setattr(cpu_attention, "stock_forward", lambda layer: _slowed(real(layer)))
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
