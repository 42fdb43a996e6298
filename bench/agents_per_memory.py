"""Agents per KV budget: KMesh sharing the document in the engine's memory vs stock vLLM.

Workload: SmolLM2-135M-Instruct (bf16; CPU, in-process engines), the chat prompts of
`follow_up_ttft --model smollm2` (`smollm2_prompts`): one real-text document D of 2,048 tokens
between each agent's own system prompt/preamble and question. 4 families of 8 agents (32) read
D; each generates 64 tokens (greedy, ``ignore_eos``). Every engine has the same fixed KV budget:
``--budget-agents`` (3) agents' worth of vLLM blocks (``--block-size``, 32), prefix caching on.
Three engines, one after another (vLLM's KV connector is process-global):

- stock vLLM: the 32 prompts unannotated;
- KMesh without sharing: ``kmesh.cascade_decode`` on, ``kmesh.share_kv_memory`` off;
- KMesh with sharing: both on. Each agent, once it decodes in cascade, gives its blocks that
  hold only D's rows back to vLLM's pool; D's master is held once next to vLLM's budget (host
  RAM), each agent's replaced rows (its mirror) beside it.

For the KMesh engines one first reader per family stores D's master first (not measured); then
all 32 agents are added at once and the engine is stepped by hand (`kmesh_blend.testing.
stepping.drive`), recording after every step the requests running and waiting, the blocks in use,
preemptions, and the bytes cascade decode holds next to the budget (masters, mirrors).

value = most agents running at once with sharing / with stock vLLM (goal ≥ 3; TokenDance
reports 2.7× over vLLM with prefix caching).
config.engines[e]: most_running, preemptions, steps, wall_s, bytes per agent at the peak —
``paged`` (vLLM blocks in use / agents running) and ``beside`` (masters + mirrors held next to
the budget / agents running), and the median decode step time divided by the agents running in
it (steps that only decoded: every running agent got a token, none its first).
config.bytes_model (per agent at steady decode, from the reports): stock = its blocks × block
bytes; sharing = kept blocks + its mirror + D's master / 8 (its family's share).
config.step_per_agent_ratio = sharing / stock of that per-agent decode step time.

``--speed-guard off`` (default) measures the raw path, whatever it costs; ``auto`` runs both KMesh
engines with the speed guard at the engine's default (result ``agents_per_memory_guard``):
sharing holds where requests wait for blocks, and config.guard holds the guard's decision.

Run: python bench/agents_per_memory.py [--quick] [--speed-guard off|auto]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, use_allocator
from _serving import attn_isa, guard_decision
from follow_up_ttft import smollm2_prompts

from kmesh_blend.testing.engine import kv_transfer_config, live_worker, make_llm
from kmesh_blend.testing.stepping import Driven, Request, drive

FAMILY = 8
NEW_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--families", type=int, default=4)
    parser.add_argument("--budget-agents", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM's KV block size (on an AMX CPU, bf16: 32 runs vLLM's amx "
                        "kernel, 16 its vec16 one: config.attn_isa names it)")  # fmt: skip
    parser.add_argument("--speed-guard", default="off", choices=["off", "auto"],
                        help="off: the raw path; auto: the engine's default decides")  # fmt: skip
    args = parser.parse_args()
    block = args.block_size
    if block < 16 or block % 16:
        raise SystemExit(f"--block-size: a multiple of 16, got {block}")
    allocator = use_allocator("tcmalloc")
    doc_len = 512 if args.quick else 2048
    families = 2 if args.quick else args.families
    new_tokens = 16 if args.quick else NEW_TOKENS
    path, prompts, details = smollm2_prompts(doc_len, families * (FAMILY + 1))
    readers = prompts[:families]
    agents = prompts[families:]
    longest = max(len(ids) for ids, _ in agents) + new_tokens
    blocks = args.budget_agents * -(-longest // block)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    head_dim = hf.hidden_size // hf.num_attention_heads
    token_bytes = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 2  # K+V, bf16
    block_bytes = block * token_bytes
    common = {"dtype": "bfloat16", "max_model_len": -(-longest // block) * block,
              "max_num_batched_tokens": 4096,
              "max_num_seqs": 64, "block_size": block, "enable_prefix_caching": True,
              "num_gpu_blocks_override": blocks}  # fmt: skip

    def params(spans: list[list[int]] | None, family: int, n: int) -> Any:
        from vllm import SamplingParams

        extra = None
        if spans is not None:
            extra = {"kv_transfer_params": {"kmesh": {"segments": spans, "family": f"f{family}"}}}
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)

    def requests(annotated: bool) -> list[Request]:
        return [(f"a{i}", {"prompt_token_ids": ids},
                 params(spans if annotated else None, i // FAMILY, new_tokens))
                for i, (ids, spans) in enumerate(agents)]  # fmt: skip

    engines: dict[str, dict[str, Any]] = {}
    reports: list[dict[str, Any]] = []
    guard: dict[str, Any] = {}
    for name, kmesh in [("stock", None), ("kmesh", False), ("kmesh_shared", True)]:
        print(f"engine: {name}", file=sys.stderr, flush=True)
        config = None
        if kmesh is not None:
            # off: how many agents sharing fits, whatever it costs; auto: what a user gets
            config = kv_transfer_config(
                cascade_decode=True, share_kv_memory=kmesh, speed_guard=args.speed_guard
            )
        llm = make_llm(path, kv_transfer_config=config, **common)
        try:
            if kmesh is not None:
                drive(llm, [(f"reader{f}", {"prompt_token_ids": ids}, params(spans, f, 1))
                            for f, (ids, spans) in enumerate(readers)])  # fmt: skip
            beside: list[int] = []
            times: list[float] = []

            def probe(step: int, driven: Driven, beside: list[int] = beside,
                      times: list[float] = times,
                      kmesh: bool | None = kmesh) -> tuple[list[str], list[Request]]:  # fmt: skip
                times.append(time.perf_counter())
                cascade = live_worker().cascade if kmesh is not None else None
                held = 0
                if cascade is not None:
                    held = cascade.master_bytes
                    held += cascade.sharing.mirror_bytes if cascade.sharing is not None else 0
                beside.append(held)
                return [], []

            start = time.perf_counter()
            driven = drive(llm, requests(kmesh is not None), probe)
            wall = time.perf_counter() - start
            engines[name] = summary(driven, beside, [start, *times], block_bytes, wall)
            if kmesh is not None:
                for i in range(len(agents)):  # in the agents' order
                    output = driven.outputs[f"a{i}"]
                    report = (output.kv_transfer_params or {}).get("kmesh", {})
                    reports.append({**report, "bench_engine": name})
                cascade = live_worker().cascade
                if kmesh and cascade is not None:
                    guard.update(guard_decision(cascade.guard))
            print(f"  {engines[name]}", file=sys.stderr, flush=True)
        finally:
            del llm
            gc.collect()

    shared = [r for r in reports if r["bench_engine"] == "kmesh_shared"]
    kept_blocks = statistics.mean(
        -(-(len(ids) + new_tokens) // block) - r.get("released_blocks", 0)
        for (ids, _), r in zip(agents, shared, strict=True)
    )  # fmt: skip
    stock_blocks = statistics.mean(-(-(len(ids) + new_tokens) // block) for ids, _ in agents)
    master = doc_len * token_bytes
    mirror = statistics.mean(r.get("mirror_bytes", 0) for r in shared)
    bytes_model = {
        "stock_per_agent": round(stock_blocks * block_bytes),
        "shared_per_agent": round(kept_blocks * block_bytes + mirror + master / FAMILY),
        "shared_in_vllm_budget": round(kept_blocks * block_bytes),
        "shared_mirror": round(mirror),
        "shared_master_share": round(master / FAMILY),
    }
    bytes_model["ratio"] = round(
        bytes_model["shared_per_agent"] / bytes_model["stock_per_agent"], 3
    )
    ratio = engines["kmesh_shared"]["most_running"] / max(1, engines["stock"]["most_running"])
    step_ratio = None
    if engines["stock"]["step_s_per_agent"] and engines["kmesh_shared"]["step_s_per_agent"]:
        step_ratio = round(engines["kmesh_shared"]["step_s_per_agent"]
                           / engines["stock"]["step_s_per_agent"], 3)  # fmt: skip
    emit({
        "name": "agents_per_memory" + ("_guard" if args.speed_guard == "auto" else ""),
        "metric": "most agents decoding at once in one KV budget, KMesh sharing / stock vLLM",
        "value": round(ratio, 3),
        "unit": "x",
        "goal": 3.0,
        "baseline": "stock vLLM with prefix caching, same KV budget (blocks)",
        "quick": args.quick,
        "config": {
            "model": "SmolLM2-135M-Instruct (bf16)", "document_tokens": doc_len,
            "families": families, "family_size": FAMILY, "new_tokens": new_tokens,
            "kv_budget_blocks": blocks, "block_size": block, "block_bytes": block_bytes,
            "attn_isa": attn_isa("bfloat16", block, head_dim),
            "budget_agents": args.budget_agents, "engines": engines,
            "speed_guard": args.speed_guard, "guard": guard,
            "bytes_model": bytes_model, "step_per_agent_ratio": step_ratio,
            "released_blocks_per_agent": statistics.mean(r.get("released_blocks", 0)
                                                         for r in shared),
            "preempted_agents_shared": sum(1 for r in shared if r.get("preemptions")),
            "memory_counted": "vLLM's KV budget holds each agent's kept blocks; the masters and "
            "mirrors are held next to it in host RAM (vllm:kmesh_shared_master_bytes, "
            "vllm:kmesh_mirror_bytes)",
            "allocator": allocator, "workload": details,
        },
    })  # fmt: skip


def summary(driven: Driven, beside: list[int], stamps: list[float], block_bytes: int,
            wall: float) -> dict[str, Any]:  # fmt: skip
    """One engine's figures from its trace (one entry per step)."""
    trace = driven.trace
    peak = max(range(len(trace)), key=lambda i: (trace[i].running, -i))
    state = trace[peak]
    in_use = state.num_blocks - 1 - state.blocks_free  # vLLM's null block is never free
    per_agent, step_s, running = [], [], []
    for i in range(len(trace)):
        if driven.decode_only(i):
            step_s.append(stamps[i + 1] - stamps[i])
            running.append(trace[i].running)
            per_agent.append(step_s[-1] / trace[i].running)
    return {
        "most_running": state.running,
        "preemptions": sum(driven.preemptions.values()),
        "steps": len(trace),
        "wall_s": round(wall, 2),
        "paged_bytes_per_agent_at_peak": round(in_use * block_bytes / max(1, state.running)),
        "beside_bytes_per_agent_at_peak": round(beside[peak] / max(1, state.running)),
        "step_s_per_agent": round(statistics.median(per_agent), 5) if per_agent else None,
        "decode_step_s": round(statistics.median(step_s), 4) if step_s else None,
        "decode_step_agents": statistics.median(running) if running else None,
        "finished": len(driven.outputs),
    }


if __name__ == "__main__":
    main()
