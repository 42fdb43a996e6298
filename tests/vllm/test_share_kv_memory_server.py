"""``kmesh.share_kv_memory`` behind vLLM's OpenAI-compatible server (tiny model, fp32): 32 agents
in 4 families sent at once, in a KV budget under which stock vLLM preempts. KMesh serves them
with no preemption (vLLM's own ``vllm:num_preemptions`` on ``/metrics``), every answer equal to
the answer of KMesh without sharing (with room for all), and its reuse metrics say what it gave
back and what it holds next to the budget.
"""

from __future__ import annotations

import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.cpu import cpu_kernel_expected
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import kv_transfer_config
from tests.segments.conftest import _free_port, _stop
from tests.vllm.test_metrics import _metric, start_openai_server

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not cpu_kernel_expected(), reason="blocks go back only on the CPU kernel"),
]

FAMILIES, SIZE, DOC_LEN, MAX_TOKENS, BLOCKS = 4, 8, 300, 24, 160


def _families() -> list[tuple[tuple[list[int], int], list[tuple[list[int], int]]]]:
    """Per family: its first reader and its 8 agents, each (token ids, where its document
    starts); each family reads a document of its own."""
    gen = torch.Generator().manual_seed(17)
    vocab = TINY_LLAMA.vocab_size
    out = []
    for _ in range(FAMILIES):
        doc = torch.randint(3, vocab, (DOC_LEN,), generator=gen).tolist()
        prompts = []
        for i in range(SIZE + 1):
            head = torch.randint(3, vocab, (9 + 5 * i,), generator=gen).tolist()
            question = torch.randint(3, vocab, (6 + i % 4,), generator=gen).tolist()
            prompts.append((head + doc + question, len(head)))
        out.append((prompts[0], prompts[1:]))
    return out


def _run(tmp_path: Path, name: str, config: dict[str, Any] | None,
         blocks: int | None) -> tuple[list[str], list[dict[str, Any]], str]:  # fmt: skip
    """Each family's first reader, then all 32 agents at once: (answers, reports, /metrics)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from serve_client import _post, _wait_healthy

    model, port = str(build_checkpoint(TINY_LLAMA)), _free_port()
    extra = ["--block-size", "32", "--dtype", "float32"]
    if blocks is not None:
        extra += ["--num-gpu-blocks-override", str(blocks)]
    server = start_openai_server(model, port, config, tmp_path / f"{name}.log", *extra)
    url = f"http://127.0.0.1:{port}/v1/completions"

    def body(ids: list[int], start: int, family: int, max_tokens: int) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True}  # fmt: skip
        if config is not None:
            kmesh = {"segments": [[start, start + DOC_LEN]], "family": f"f{family}"}
            out["kv_transfer_params"] = {"kmesh": kmesh}
        return out

    try:
        _wait_healthy(port, server)
        families = _families()
        for f, (reader, _) in enumerate(families):
            _post(url, body(*reader, f, 1))
        agents = [body(*agent, f, MAX_TOKENS) for f, (_, group) in enumerate(families)
                  for agent in group]  # fmt: skip
        with ThreadPoolExecutor(len(agents)) as pool:
            replies = list(pool.map(lambda b: _post(url, b), agents))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
    finally:
        _stop(server)
    answers = [r["choices"][0]["text"] for r in replies]
    reports = [(r.get("kv_transfer_params") or {}).get("kmesh", {}) for r in replies]
    return answers, reports, metrics


def test_32_agents_share_a_budget_stock_vllm_must_preempt_in(tmp_path: Path) -> None:
    shared = kv_transfer_config(cascade_decode=True, share_kv_memory=True, drift_correction="off",
                                speed_guard="off")  # fmt: skip
    alone = kv_transfer_config(cascade_decode=True, drift_correction="off", speed_guard="off")
    answers, reports, metrics = _run(tmp_path, "shared", shared, BLOCKS)
    _, _, stock_metrics = _run(tmp_path, "stock", None, BLOCKS)
    want, _, _ = _run(tmp_path, "roomy", alone, None)
    assert _metric(stock_metrics, "vllm:num_preemptions_total") > 0
    assert _metric(metrics, "vllm:num_preemptions_total") == 0
    assert answers == want
    assert all(r["reused_tokens"] == DOC_LEN and r["released_blocks"] > 0 for r in reports)
    released = sum(r["released_blocks"] for r in reports)
    assert _metric(metrics, "vllm:kmesh_released_blocks_total") == released
