"""Which shared level the CPU kernel runs (`kmesh_blend.cpu.level`), and the cache eviction its
timings start from (`kmesh_blend.cpu.caches`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kmesh_blend.cpu.caches import last_level_cache_bytes
from kmesh_blend.cpu.level import LevelTiming, choose_level, time_levels

HEADS = (9, 3, 64)  # SmolLM2's query heads, KV heads, head size


def test_settings_choose_the_level_or_name_the_bad_value(kernel: Any) -> None:
    assert choose_level("loops", kernel, torch.bfloat16, HEADS)[0] is False
    assert choose_level("gemm", kernel, torch.bfloat16, HEADS)[0] is True
    gemm, why = choose_level("gemm", kernel, torch.float32, HEADS)
    assert gemm is False and "bfloat16" in why  # matrix products read bf16 only
    with pytest.raises(ValueError, match=r"kmesh\.cascade_level"):
        choose_level("fastest", kernel, torch.bfloat16, HEADS)


def test_auto_keeps_the_level_its_timing_found_faster(
    kernel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    timing = time_levels(kernel, HEADS, family=8, rows=512, reps=3)
    assert timing.loops_s > 0 and timing.gemm_s > 0 and timing.family == 8
    assert timing.gemm == (timing.gemm_s < timing.loops_s)
    for loops_s, gemm_s in ((2e-4, 1e-4), (1e-4, 2e-4)):
        made = LevelTiming(loops_s, gemm_s, 8, 1024)
        monkeypatch.setattr("kmesh_blend.cpu.level.time_levels", lambda *a, **k: made)  # noqa: B023
        gemm, line = choose_level("auto", kernel, torch.bfloat16, HEADS)
        assert gemm == (gemm_s < loops_s)
        assert ("matrix products (" in line) == gemm and "0.100 ms" in line and "0.200 ms" in line


def test_the_eviction_reads_past_the_last_level_cache() -> None:
    assert last_level_cache_bytes() >= 32 << 20
