"""Multi-agent All-Gather through vLLM with KMesh: each round's outputs become shared segments.

N agents discuss for R rounds. In round r every agent's prompt is its own role text, then the N
outputs of round r−1 (each one a shared segment), then a question. Before the agents of a round
start, the application sends one request (the notice) holding those N outputs as segments, so
their KV is computed and stored once and held for the round's family (the last agent closes it);
the N agents then each reuse all of it (their outputs sit at different offsets after different
role texts). Per round it prints the agents' reuse and the
latency of the notice request and of the agents' batch.

Run: ``.venv/bin/python examples/all_gather.py [--agents 4] [--rounds 3] [--model PATH]``
(default model: the embedded tiny Llama; any local Llama/Qwen2/Qwen3 checkpoint works).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import make_llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="tokens each agent writes per round")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny Llama)")
    parser.add_argument("--ratio", type=float, default=0.15, help="kmesh.recompute_ratio")
    args = parser.parse_args()
    from vllm import SamplingParams

    model = args.model or str(build_checkpoint(TINY_LLAMA))
    llm = make_llm(
        model,
        kv_transfer_config={
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "kmesh.store": "cpu",
                "kmesh.recompute_ratio": args.ratio,
            },
        },
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    roles = [toks(24 + 5 * i) for i in range(args.agents)]
    question = toks(10)
    outputs = [toks(args.tokens) for _ in range(args.agents)]  # round 0: the agents' briefs
    for rnd in range(1, args.rounds + 1):
        shared, spans = _concat(outputs, start=0)
        t0 = time.perf_counter()
        prep = llm.generate(
            [{"prompt_token_ids": shared + question}],
            _params(SamplingParams, spans, rnd, max_tokens=1),
            use_tqdm=False,
        )[0]
        prepare_s = time.perf_counter() - t0
        prompts, all_spans = [], []
        for role in roles:
            body, body_spans = _concat(outputs, start=len(role))
            prompts.append(role + body + question)
            all_spans.append(body_spans)
        t0 = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [
                _params(SamplingParams, s, rnd, max_tokens=args.tokens, close=i == len(roles) - 1)
                for i, s in enumerate(all_spans)
            ],
            use_tqdm=False,
        )
        agents_s = time.perf_counter() - t0
        reused = [o.kv_transfer_params["kmesh"]["reused_tokens"] for o in outs]
        print(
            f"round {rnd}: prepare {prepare_s * 1e3:.0f} ms "
            f"(stored {len(spans)} segments, report {prep.kv_transfer_params['kmesh']}); "
            f"{args.agents} agents {agents_s * 1e3:.0f} ms, reused tokens per agent {reused} "
            f"of {[len(p) for p in prompts]}"
        )
        outputs = [list(o.outputs[0].token_ids) or toks(1) for o in outs]


def _concat(parts: list[list[int]], start: int) -> tuple[list[int], list[list[int]]]:
    ids: list[int] = []
    spans = []
    for part in parts:
        spans.append([start + len(ids), start + len(ids) + len(part)])
        ids += part
    return ids, spans


def _params(
    cls: Any,
    spans: list[list[int]],
    rnd: int,
    max_tokens: int,
    close: bool = False,
) -> Any:
    """One family per round: its first request (the notice) holds the round's outputs in host
    RAM for the agents; the last agent closes it, and rounds older than
    ``kmesh.round_lifetime`` (default 2) are deleted from the store."""
    kmesh = {"segments": spans, "family": f"round-{rnd}", "round": rnd, "close": close}
    return cls(
        temperature=0.0, max_tokens=max_tokens, extra_args={"kv_transfer_params": {"kmesh": kmesh}}
    )


if __name__ == "__main__":
    main()
