"""`KMeshStats` payloads: counters add up across the two sides, gauges take the latest value."""

from __future__ import annotations

from kmesh_blend.vllm.prom import KMeshStats
from kmesh_blend.vllm.stats import fallback_reason


def test_counters_add_and_gauges_take_the_latest() -> None:
    a = KMeshStats(
        {"counters": {"reused_tokens": 10, "fallbacks|load error": 1}, "gauges": {"plans": 3}}
    )
    b = KMeshStats({"counters": {"reused_tokens": 5, "store_reads|lm": 2}, "gauges": {"plans": 1}})
    merged = a.aggregate(b)
    assert a.data["counters"]["reused_tokens"] == 10  # the inputs are left as they were
    assert merged.data["counters"] == {
        "reused_tokens": 15,
        "fallbacks|load error": 1,
        "store_reads|lm": 2,
    }
    assert merged.reduce()["plans"] == 1 and not merged.is_empty()
    merged.reset()
    assert merged.is_empty() and KMeshStats().is_empty()


def test_fallback_reasons_are_short_labels() -> None:
    assert fallback_reason("load error: segment 1234 miss") == "load error"
    assert fallback_reason("bad annotation: segments='xxx'") == "bad annotation"
    assert len(fallback_reason("x" * 500)) == 40 and fallback_reason("") == "unknown"
    down = "kmesh.store lm://10.0.0.1:65432 unavailable: no answer within 0.50 s"
    assert fallback_reason(down) == "store unavailable"
    assert fallback_reason(f"load error: {down}") == "load error"


def test_finished_reports_count_cascade_steps_and_preemptions() -> None:
    from kmesh_blend.vllm.reports import count

    reports = [
        {"reused_tokens": 400, "cascade_steps": 31, "preemptions": 1, "fallback": None},
        {"reused_tokens": 400, "cascade_steps": 12, "released_blocks": 3, "fallback": None},
        {"reused_tokens": 0, "fallback": None},
    ]
    counters = count(reports)  # type: ignore[arg-type]
    assert counters["cascade_steps"] == 43 and counters["preemptions"] == 1
    assert counters["released_blocks"] == 3
    assert counters["requests|reused"] == 2 and counters["requests|no_reuse"] == 1
    from kmesh_blend.vllm.stats import COUNTERS

    assert {"cascade_steps", "preemptions"} <= set(COUNTERS)  # registered on /metrics
