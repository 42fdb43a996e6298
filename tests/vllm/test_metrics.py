"""The connector's metrics on vLLM's own ``/metrics`` of the OpenAI-compatible server (HTTP).

A reader and three follow-ups of one document, plus one request with a bad annotation: the
counters on ``/metrics`` must equal the sums of the reports in the responses, and the registry
gauges show the published document.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from tests.segments.conftest import _free_port, _stop
from tests.vllm.family import DOC_LEN, kv_transfer_config, prompts

pytestmark = pytest.mark.vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from serve_client import _post, _wait_healthy  # noqa: E402


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, f"{name} {labels} not on /metrics"
    return total


def start_openai_server(
    model: str, port: int, config: dict[str, Any] | None, log_path: Path, *extra: str
) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI-compatible server on tiny settings with ``--kv-transfer-config config``
    (None: stock vLLM) and ``extra`` arguments, its output in ``log_path``; the caller waits for
    it (`_wait_healthy`) and stops it."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
        "--enforce-eager", *extra,
    ]  # fmt: skip
    if config is not None:
        cmd += ["--kv-transfer-config", json.dumps(config)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # An in-process engine of an earlier test may have set vLLM's Prometheus multiprocess
    # directory in this process: a server inheriting it would add up earlier servers' counters.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def test_reuse_counters_and_registry_sizes_on_vllm_metrics(tmp_path: Path) -> None:
    model, port = str(build_checkpoint(TINY_LLAMA)), _free_port()
    config = kv_transfer_config(store="cpu", recompute_ratio=0.15)
    server = start_openai_server(model, port, config, tmp_path / "server.log")
    try:
        _wait_healthy(port, server)
        reports: list[dict[str, Any]] = []
        family = prompts(seed=11)
        bodies = [{"segments": spans} for _, spans in family[:4]] + [{"segments": [[5, 2]]}]
        for (ids, _), kmesh in zip([*family[:4], family[4]], bodies, strict=True):
            body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0,
                    "kv_transfer_params": {"kmesh": kmesh}}  # fmt: skip
            reply = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            reports.append(reply["kv_transfer_params"]["kmesh"])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    finally:
        _stop(server)  # type: ignore[arg-type]
    assert [r["reused_tokens"] for r in reports] == [0, DOC_LEN, DOC_LEN, DOC_LEN, 0]
    for name in ("reused_tokens", "recomputed_tokens", "storage_reads"):
        assert _metric(text, f"vllm:kmesh_{name}_total") == sum(r[name] for r in reports)
    assert _metric(text, "vllm:kmesh_requests_total", outcome="reused") == 3
    assert _metric(text, "vllm:kmesh_requests_total", outcome="no_reuse") == 1
    assert _metric(text, "vllm:kmesh_fallbacks_total", reason="bad annotation") == 1
    assert _metric(text, "vllm:kmesh_published_segments") == 1
    assert _metric(text, "vllm:kmesh_plans") == 0  # every finished request's plan is gone
    assert _metric(text, "vllm:kmesh_indexed_segments") == 1
    assert _metric(text, "vllm:kmesh_store_up") == 1
    # What the seam found in vLLM and changed there, once, as an info metric.
    seam = [line for line in text.splitlines() if line.startswith("vllm:kmesh_vllm_seam_info{")]
    assert len(seam) == 1 and seam[0].endswith(" 1.0"), seam
    assert "vLLM: " in seam[0] and "model: " in seam[0], seam[0]
    assert "kv_load_failure_policy: recompute" in seam[0] or "load_model: wrapped" in seam[0]
