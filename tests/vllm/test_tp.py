"""Tensor parallelism 2 on the CPU (vLLM's multiprocess executor, one worker per rank): each rank
blends its own shard of heads on vLLM's modules and stores masters under its own rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.family import DOC_LEN

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> list[Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.tp_engine", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def test_tp2_ratio_one_equals_stock_tp2_and_follow_ups_reuse(lm_server: str) -> None:
    stock = _run("stock")
    exact = _run("1.0")
    assert [row[:2] for row in exact] == [row[:2] for row in stock]  # tokens and every bit
    assert all(r["reused_tokens"] == DOC_LEN for *_, r in exact[1:])
    # A shared store: each rank's master lives under its own key; follow-ups select the same
    # tokens on both ranks (deviation summed over ranks) and reuse.
    blended = _run("0.15", lm_server)
    assert all(r["reused_tokens"] == DOC_LEN and r["fallback"] is None for *_, r in blended[1:])
    assert all(0 < r["recomputed_tokens"] < DOC_LEN for *_, r in blended[1:])
