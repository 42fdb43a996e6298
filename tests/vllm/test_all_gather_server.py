"""All-Gather through the OpenAI-compatible server: 20 rounds × 4 agents, ``round_lifetime`` 2.

In round r each agent's prompt is its own role, then the 4 outputs of round r−1 (each a shared
segment), then a question. A first request of the round's family (the notice) stores the outputs
once; the agents reuse them at their own offsets; the last agent closes the family. Checked over
HTTP and in Redis: reuse in every round; retired rounds' masters are gone from the store (at most
``lifetime`` rounds of outputs stay, plus the current one); the registry gauges on ``/metrics`` stay
within the same bound.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from tests.segments.conftest import _free_port, _stop
from tests.vllm.family import kv_transfer_config
from tests.vllm.test_metrics import _metric, start_openai_server

pytestmark = pytest.mark.vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from serve_client import _post, _wait_healthy  # noqa: E402

AGENTS, ROUNDS, LIFETIME, TOKENS = 4, 20, 2, 8


def test_all_gather_rounds_reuse_and_stay_bounded(redis_server: str, tmp_path: Path) -> None:
    import redis

    model, port = str(build_checkpoint(TINY_LLAMA)), _free_port()
    config = kv_transfer_config(store=redis_server, recompute_ratio=0.15, round_lifetime=LIFETIME)
    host, redis_port = redis_server.removeprefix("redis://").split(":")
    client = redis.Redis(host=host, port=int(redis_port))
    before = set(client.keys("kmesh-meta@*metadata"))  # other tests share this server
    gen = torch.Generator().manual_seed(31)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 2048, (n,), generator=gen).tolist()

    def complete(ids: list[int], kmesh: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "kv_transfer_params": {"kmesh": kmesh}}  # fmt: skip
        return _post(f"http://127.0.0.1:{port}/v1/completions", body)

    roles = [toks(24 + 5 * i) for i in range(AGENTS)]
    question = toks(10)
    outputs = [toks(TOKENS) for _ in range(AGENTS)]  # round 0: the agents' briefs
    reused, stored, shared_lens, gauges = [], [], [], []
    server = start_openai_server(model, port, config, tmp_path / "server.log")
    try:
        _wait_healthy(port, server)
        for rnd in range(1, ROUNDS + 1):
            family = f"round-{rnd}"
            shared = [t for out in outputs for t in out]
            shared_lens.append(len(shared))
            spans = _spans(outputs, 0)
            complete(shared + question, {"segments": spans, "family": family, "round": rnd}, 1)
            replies = []
            for i, role in enumerate(roles):
                kmesh = {"segments": _spans(outputs, len(role)), "family": family, "round": rnd,
                         "close": i == AGENTS - 1}  # fmt: skip
                replies.append(complete(role + shared + question, kmesh, TOKENS))
            reused.append([r["kv_transfer_params"]["kmesh"]["reused_tokens"] for r in replies])
            stored.append(len(set(client.keys("kmesh-meta@*metadata")) - before))
            # Each agent's answer is a shared segment of the next round.
            outputs = [list(r["choices"][0]["token_ids"]) for r in replies]
        with _open(f"http://127.0.0.1:{port}/metrics") as resp:
            text = resp.read().decode()
        gauges = [_metric(text, f"vllm:kmesh_{n}") for n in ("published_segments", "plans",
                                                              "indexed_segments")]  # fmt: skip
    finally:
        _stop(server)
        client.close()
    # Every agent of every round reused all of the round's shared outputs.
    assert reused == [[n] * AGENTS for n in shared_lens], (reused, shared_lens)
    bound = AGENTS * (LIFETIME + 1)  # the rounds still alive, and the current one
    assert max(stored) <= bound, stored
    assert stored[-1] >= AGENTS  # the last round's outputs are still there
    assert gauges[0] <= bound and gauges[1] == 0 and gauges[2] <= bound, gauges


def _spans(parts: list[list[int]], start: int) -> list[list[int]]:
    spans, at = [], start
    for part in parts:
        spans.append([at, at + len(part)])
        at += len(part)
    return spans


def _open(url: str) -> Any:
    import urllib.request

    return urllib.request.urlopen(url, timeout=30)
