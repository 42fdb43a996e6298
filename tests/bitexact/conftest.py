"""Storage-server fixtures for the vLLM matrix, and the summary table printed after the run."""

from __future__ import annotations

from typing import Any

from tests.bitexact.vllm_matrix import SUMMARY
from tests.segments.conftest import lm_server, redis_server

__all__ = ["lm_server", "pytest_terminal_summary", "redis_server"]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not SUMMARY:
        return
    width = max(len(row[0]) for row in SUMMARY)
    terminalreporter.section("kmesh bit-exactness through vLLM")
    terminalreporter.write_line(f"{'case':<{width}}  {'compared with':<24} {'n':>3}  result")
    for case, against, n, result in SUMMARY:
        terminalreporter.write_line(f"{case:<{width}}  {against:<24} {n:>3}  {result}")
