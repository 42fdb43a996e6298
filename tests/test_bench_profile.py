"""bench/blend_profile.py's timers: each phase keeps its own time (nested phases subtracted), so
the phases of a request add up to its wall time; and its ``--docs`` layouts parse or say why."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


@pytest.fixture(scope="module")
def blend_profile() -> ModuleType:
    """The script as a module; the environment it sets for its engines (follow_up_ttft's) is
    put back, so later tests' engines start as they would have."""
    saved = dict(os.environ)
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module("blend_profile")
    finally:
        sys.path.remove(BENCH)
        os.environ.clear()
        os.environ.update(saved)


def test_nested_phases_keep_their_own_time_and_add_up_to_the_whole(
    blend_profile: ModuleType,
) -> None:
    def inner() -> None:
        time.sleep(0.02)

    def outer() -> None:
        time.sleep(0.01)
        calls.inner()
        calls.inner()

    calls = SimpleNamespace(outer=outer, inner=inner)
    timers = blend_profile.Timers()
    timers.wrap(calls, "inner", "inner")
    timers.wrap(calls, "outer", "outer")
    start = time.perf_counter()
    calls.outer()
    wall = time.perf_counter() - start
    own = timers.take()
    assert own["inner"] >= 0.04 and 0.01 <= own["outer"] < 0.03, own
    assert sum(own.values()) == pytest.approx(wall, abs=2e-3)
    assert timers.take() == {}  # taken: the next request starts from nothing


def test_a_layout_is_documents_times_tokens(blend_profile: ModuleType) -> None:
    assert blend_profile.layout("4x192") == (4, 192)
    for bad in ("192", "0x192", "4x8", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match="--docs wants NxM"):
            blend_profile.layout(bad)


def test_the_markdown_table_has_a_row_per_measured_phase_and_a_column_per_ratio(
    blend_profile: ModuleType,
) -> None:
    phases = dict.fromkeys(blend_profile.PHASES, 0.0)
    rows = [{"layout": "4x192", "ratio": r, "ttft_ms": t, "stock_ms": 100.0, "vs_stock": t / 100,
             "phases_ms": {**phases, "engine": t - 5.0, "qkv": 5.0},
             "stock_phases_ms": {**phases, "attention": 40.0, "engine": 60.0}}
            for r, t in ((0.0, 20.0), (1.0, 105.0))]  # fmt: skip
    lines = blend_profile.markdown(rows).splitlines()
    assert lines[0] == "| 4x192, ms | ratio 0 | ratio 1 | stock |"
    assert "| engine | 15.0 | 100.0 | 60.0 |" in lines and "| qkv | 5.0 | 5.0 | 0.0 |" in lines
    assert (
        "| attention | 0.0 | 0.0 | 40.0 |" in lines
        and "| **TTFT** | 20.0 | 105.0 | 100.0 |" in lines
    )
    assert not any(line.startswith("| drift") for line in lines)  # never measured: left out
    assert "| TTFT / stock | 0.200 | 1.050 | 1 |" in lines
