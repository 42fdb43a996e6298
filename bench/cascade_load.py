"""Decode sharing under load, step by step and in parts: where a loaded step's time goes.

Workload: the serving benchmark's (`bench/serving.py`): SmolLM2-135M-Instruct bf16, agent
families in separator mode (6 families × 5 agents, documents of 0.9-1.6k tokens, 32 output
tokens; ``--quick``: 3 × 4, 300-500 tokens, 12), in its order, one new request every ``--gap``
engine steps (4): steps mix chunked prefills with the decodes of several families, as a loaded
server's do. The engine runs in this process with the server's defaults (2,048 batched tokens,
128 sequences, prefix caching, vLLM's default KV budget or ``--kv-blocks``). Engines one after
another, the same arrivals: ``kmesh`` (defaults), ``kmesh_share`` (``cascade_decode`` +
``share_kv_memory``, the speed guard at its default) and ``kmesh_share_raw`` (the same with
``speed_guard: off``: the raw path).

Per step: its wall time (``LLMEngine.step``), its make-up from the scheduler's output (requests
decoding one token, prompt tokens prefilled) and, on the cascade engine, the cascade path's parts
(`kmesh_blend.vllm.cascade_clock`: planning and composition, the cascade kernel, vLLM's kernel
on the step's other rows); the rest of a step is the model's GEMMs, norms, the blend and vLLM.

value = Σ step time kmesh_share / Σ kmesh (the whole workload, same arrivals; goal ≤ 1.03);
config.raw_vs_kmesh the same for the raw path; config.engine_start_s each engine's start (the
speed guard's start-up timing included).
config.table: per make-up (decode-only or with prefill, × requests decoding), steps and median
step ms per engine, and the cascade engines' mean parts in ms. Results name the CPU and vLLM's
attention kernel.

Run: python bench/cascade_load.py [--quick] [--gap N] [--kv-blocks N]
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
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, use_allocator
from _serving import BLOCK_SIZE, agent_families, attn_isa, separator_id

GOAL = 1.03
ENGINES = {
    "kmesh": {},
    "kmesh_share": {"cascade_decode": True, "share_kv_memory": True},
    "kmesh_share_raw": {"cascade_decode": True, "share_kv_memory": True, "speed_guard": "off"},
}
BUCKETS = ((1, 4), (5, 8), (9, 16), (17, 1 << 30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gap", type=int, default=4, help="engine steps between arrivals")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="a tight KV budget: vLLM's num_gpu_blocks_override")  # fmt: skip
    args = parser.parse_args()
    if args.gap < 1:
        raise SystemExit(f"--gap: at least 1, got {args.gap}")
    allocator = use_allocator("tcmalloc")
    if args.quick:
        families, agents, docs, tokens = 3, 4, (300, 500), 12
    else:
        families, agents, docs, tokens = 6, 5, (900, 1600), 32
    from transformers import AutoTokenizer

    from kmesh_blend.testing import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(model)
    work = agent_families(tokenizer, families, agents, docs, tokens)
    sep = separator_id(tokenizer)
    runs = {name: run(model, settings, sep, work, args) for name, settings in ENGINES.items()}
    total = {name: sum(r["step_s"]) for name, r in runs.items()}
    value = total["kmesh_share"] / total["kmesh"]
    raw = total["kmesh_share_raw"] / total["kmesh"]
    table = make_table(runs)
    for row in table:
        print(row, file=sys.stderr)
    print(f"sum of step times: {', '.join(f'{k} {v:.2f} s' for k, v in total.items())}; "
          f"kmesh_share / kmesh = {value:.3f}, raw (speed guard off) {raw:.3f}")  # fmt: skip
    emit({
        "name": "cascade_load" + (f"_kv{args.kv_blocks}" if args.kv_blocks else ""),
        "metric": "engine time for the serving workload, cascade + shared memory / KMesh defaults",
        "value": round(value, 4),
        "unit": "x",
        "goal": GOAL,
        "baseline": "KMesh defaults (cascade decode off), the same arrivals by step",
        "quick": args.quick,
        "config": {
            "model": "SmolLM2-135M-Instruct (bf16)", "families": families, "agents": agents,
            "document_tokens": list(work.document_tokens), "output_tokens": tokens,
            "gap_steps": args.gap, "kv_blocks": args.kv_blocks, "block_size": BLOCK_SIZE,
            "attn_isa": attn_isa("bfloat16", BLOCK_SIZE), "allocator": allocator,
            "steps": {k: len(r["step_s"]) for k, r in runs.items()},
            "total_step_s": {k: round(v, 3) for k, v in total.items()},
            "raw_vs_kmesh": round(raw, 4),
            "engine_start_s": {k: r["start_s"] for k, r in runs.items()},
            "cascade_steps": {k: r["cascade_steps"] for k, r in runs.items()},
            "requests": {k: r["requests"] for k, r in runs.items()},
            "table": table,
        },
    })  # fmt: skip


def run(model: str, settings: dict[str, Any], sep: int, work: Any,
        args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One engine over the workload: per step (wall s, decoding requests, prefill tokens,
    cascade parts or None)."""
    from vllm import SamplingParams

    from kmesh_blend.testing.engine import kv_transfer_config, live_worker, make_llm
    from kmesh_blend.vllm.seam.engine import drop_leaked_connector

    extra = {} if args.kv_blocks is None else {"num_gpu_blocks_override": args.kv_blocks}
    started = time.perf_counter()
    llm = make_llm(model, "bfloat16", max_model_len=4096, enable_prefix_caching=True,
                   max_num_batched_tokens=2048, max_num_seqs=128, block_size=BLOCK_SIZE,
                   kv_transfer_config=kv_transfer_config(store="cpu", separator=[sep],
                                                         **settings), **extra)  # fmt: skip
    start_s = time.perf_counter() - started
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    makeups: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        counts = list(out.num_scheduled_tokens.values())
        makeups.append((sum(1 for n in counts if n == 1), sum(n for n in counts if n > 1)))
        return out

    scheduler.schedule = recorded
    # (an older checkout's path has no clock: its steps are timed whole)
    clock = getattr(live_worker().cascade, "clock", None)
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate(["Say hello.\nA short note.\nReply with one word."], warm, use_tqdm=False)
    makeups.clear()
    pending = [(f"r{i}", row["prompt"], SamplingParams(
        max_tokens=row["output_tokens"], temperature=0.0, ignore_eos=True))
        for i, row in enumerate(work.rows)]  # fmt: skip
    pending.reverse()
    steps: list[tuple[float, int, int, Any]] = []
    cascade_steps = 0
    step = 0
    reports: list[dict[str, Any]] = []
    while pending or engine.has_unfinished_requests():
        if pending and step % args.gap == 0:
            engine.add_request(*pending.pop())
        seen = clock.serial if clock is not None else 0
        before = len(makeups)
        t0 = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - t0
        for o in outs:
            if o.finished:
                reports.append((o.kv_transfer_params or {}).get("kmesh") or {})
        step += 1
        if len(makeups) == before:  # nothing scheduled
            continue
        parts = clock.since(seen) if clock is not None else []
        cascade_steps += bool(parts)
        steps.append((seconds, *makeups[-1], parts[0] if parts else None))
    scheduler.schedule = schedule
    del llm
    gc.collect()
    drop_leaked_connector()  # vLLM keeps one KV connector per process: the next engine's own
    reasons: dict[str, int] = {}
    for r in reports:
        if r.get("cascade_off"):
            reasons[str(r["cascade_off"])] = reasons.get(str(r["cascade_off"]), 0) + 1
    return {"steps": steps, "step_s": [s[0] for s in steps], "cascade_steps": cascade_steps,
            "start_s": round(start_s, 2),
            "requests": {"finished": len(reports),
                         "reused": sum(1 for r in reports if r.get("reused_tokens")),
                         "in_cascade": sum(1 for r in reports if r.get("cascade_steps")),
                         "released_blocks": sum(int(r.get("released_blocks") or 0)
                                                for r in reports),
                         "cascade_off": reasons}}  # fmt: skip


def make_table(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per make-up: steps and median step ms per engine, the cascade engine's mean parts."""
    rows = []
    for prefill in (False, True):
        for lo, hi in BUCKETS:
            row: dict[str, Any] = {"prefill": prefill, "decoding": f"{lo}-{hi}" if hi < 1 << 20
                                   else f"{lo}+"}  # fmt: skip
            for name, r in runs.items():
                picked = [s for s in r["steps"] if (s[2] > 0) == prefill and lo <= s[1] <= hi]
                row[f"{name}_steps"] = len(picked)
                row[f"{name}_ms"] = (round(statistics.median(s[0] for s in picked) * 1e3, 1)
                                     if picked else None)  # fmt: skip
                parts = [s[3] for s in picked if s[3] is not None]
                if parts:
                    row[f"{name}_cascade_steps"] = len(parts)
                    for field in ("plan_s", "arm_s", "cascade_s", "others_s"):
                        mean = statistics.mean(getattr(p, field) for p in parts)
                        row[f"{name}_{field[:-2]}_ms"] = round(mean * 1e3, 2)
            if row["kmesh_steps"] or row["kmesh_share_steps"]:
                rows.append(row)
    return rows


if __name__ == "__main__":
    main()
