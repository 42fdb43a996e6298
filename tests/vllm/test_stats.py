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
