"""Resident memory a KMesh engine adds to stock vLLM, same model, same prompts, same allocator.

Workload: SmolLM2-135M-Instruct (bf16, CPU) and the chat prompts of ``follow_up_ttft.py
--model smollm2``: a 2,048-token real-text document read by a first reader, then four
follow-ups (own system prompt and preamble before it, own question after it) served together in
one ``generate`` call (KMesh blends them as one group). Stock vLLM (prefix caching on, its
default) gets the same prompts without annotations. Every request generates 4 tokens.

Each engine runs in a process of its own (``python bench/engine_memory.py --child stock|kmesh``,
in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the whole engine lives in that
process), under the same allocator (tcmalloc by default, as in ``follow_up_ttft``; the child
inherits the parent's LD_PRELOAD). The child reports its resident set (RSS, psutil) after each
phase — interpreter, imports, engine start, first reader, follow-ups — and its peak (the kernel's
high-water mark, VmHWM) as JSON on stdout. Full mode runs stock, KMesh, stock, KMesh and takes
the median per engine.

KMesh's store budgets are set small and subtracted as configured: ``kmesh.store_cpu_bytes``
(LMCache's host-RAM pool: allocated and zero-filled when the connector starts, so resident in
full) and ``kmesh.retention_bytes`` (restored masters kept in host RAM: filled lazily, up to the
budget; ``config.retained_bytes`` says how much of it was in use at the end).

value = KMesh peak RSS − stock peak RSS − store_cpu_bytes − retention_bytes (MiB);
goal  ≤ 160 MiB + 0.25 × weight bytes (the checkpoint's safetensors files).
config.final_overhead_mib is the same difference on the RSS after the last phase.

Run: python bench/engine_memory.py [--quick] [--allocator tcmalloc|system] [--trace]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

MIB = 1 << 20
STORE_CPU_BYTES = 256 * MIB
RETENTION_BYTES = 64 * MIB
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: the same paged KV cache in both engines
GOAL_FIXED_MIB = 160.0
GOAL_WEIGHT_SHARE = 0.25
MAX_TOKENS = 4
NUM_FOLLOW_UPS = 4
PHASES = ["interpreter", "imports", "engine start", "first reader", "follow-ups"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--allocator",
        default="tcmalloc",
        choices=["tcmalloc", "system"],
        help="tcmalloc (vLLM's documented CPU setup, default) or the system malloc",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also trace Python allocations (tracemalloc) per phase: slower; for diagnosis",
    )
    parser.add_argument("--child", choices=["stock", "kmesh"], help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, Path(args.prompts), args.trace)
        return

    from _common import emit, use_allocator

    allocator = use_allocator(args.allocator)  # re-runs this script under it; children inherit
    from follow_up_ttft import smollm2_prompts

    doc_len = 512 if args.quick else 2048
    repeats = 1 if args.quick else 2
    path, prompts, details = smollm2_prompts(doc_len, 1 + NUM_FOLLOW_UPS)
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "kmesh": []}
    with tempfile.TemporaryDirectory(prefix="engine_memory-") as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps({"model": str(path), "prompts": prompts}))
        for _ in range(repeats):
            for kind in runs:
                runs[kind].append(_run_child(kind, prompt_file, args.trace))

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    budgets = STORE_CPU_BYTES + RETENTION_BYTES
    peak = (median("kmesh", "peak_rss") - median("stock", "peak_rss") - budgets) / MIB
    final = (median("kmesh", "final_rss") - median("stock", "final_rss") - budgets) / MIB
    goal = GOAL_FIXED_MIB + GOAL_WEIGHT_SHARE * weight_bytes / MIB
    phases = {
        kind: {p: round(statistics.median(r["rss"][p] for r in rs) / MIB, 1) for p in PHASES}
        for kind, rs in runs.items()
    }
    kmesh = runs["kmesh"][-1]
    print(
        f"resident memory, {doc_len}-token document, reader + {NUM_FOLLOW_UPS} follow-ups, "
        f"{repeats} run(s) per engine (medians, MiB):"
    )
    print(f"  {'phase':<14}{'stock':>10}{'kmesh':>10}{'difference':>12}")
    for p in PHASES:
        s, k = phases["stock"][p], phases["kmesh"][p]
        print(f"  {p:<14}{s:>10.1f}{k:>10.1f}{k - s:>12.1f}")
    s_peak, k_peak = median("stock", "peak_rss") / MIB, median("kmesh", "peak_rss") / MIB
    print(f"  {'peak (VmHWM)':<14}{s_peak:>10.1f}{k_peak:>10.1f}{k_peak - s_peak:>12.1f}")
    store, retention = STORE_CPU_BYTES / MIB, RETENTION_BYTES / MIB
    print("  overhead = kmesh peak − stock peak − store_cpu_bytes − retention_bytes")
    print(f"           = {k_peak:.1f} − {s_peak:.1f} − {store:.0f} − {retention:.0f}")
    print(f"           = {peak:.1f} MiB   (the same on final RSS: {final:.1f} MiB)")
    verdict = "met" if peak <= goal else "MISSED"
    print(f"  goal     ≤ {GOAL_FIXED_MIB:.0f} MiB + {GOAL_WEIGHT_SHARE} × weights")
    print(f"           = {GOAL_FIXED_MIB:.0f} + {GOAL_WEIGHT_SHARE} × {weight_bytes / MIB:.1f}")
    print(f"           = {goal:.1f} MiB: {verdict}")
    retained = kmesh["retained_bytes"] / MIB
    print(f"  retention in use at the end: {retained:.1f} of {retention:.0f} MiB")
    print(f"  reports: {kmesh['reports']}")
    _plot(s_peak, k_peak, peak, goal, doc_len)
    emit(
        {
            "name": "engine_memory",
            "metric": "KMesh engine peak RSS − stock vLLM peak RSS − configured store budgets",
            "value": round(peak, 1),
            "unit": "MiB",
            "goal": round(goal, 1),
            "baseline": "stock vLLM in its own process, same model, prompts and allocator",
            "quick": args.quick,
            "config": {
                "model": "SmolLM2-135M-Instruct",
                "dtype": "bfloat16",
                "allocator": allocator,
                "document": doc_len,
                "follow_ups": NUM_FOLLOW_UPS,
                "max_tokens": MAX_TOKENS,
                "runs_per_engine": repeats,
                "formula": "kmesh_peak_rss - stock_peak_rss - store_cpu_bytes - retention_bytes",
                "goal_formula": f"{GOAL_FIXED_MIB:g} MiB + {GOAL_WEIGHT_SHARE} * weight_bytes",
                "weight_bytes": weight_bytes,
                "store_cpu_bytes": STORE_CPU_BYTES,
                "retention_bytes": RETENTION_BYTES,
                "kv_cache_gib": KV_CACHE_GIB,
                "peak_rss_mib": {"stock": round(s_peak, 1), "kmesh": round(k_peak, 1)},
                "final_overhead_mib": round(final, 1),
                "rss_after_phase_mib": phases,
                "retained_bytes": kmesh["retained_bytes"],
                "reused_tokens": [r["reused_tokens"] for r in kmesh["reports"]],
                "runs": runs,
                **details,
            },
        }
    )


def _run_child(kind: str, prompt_file: Path, trace: bool) -> dict[str, Any]:
    """Run one engine in a fresh process; its last stdout line is its JSON report. The rest of
    its stdout (vLLM's log) goes to our stderr, so our own last line stays the result."""
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    }
    cmd = [sys.executable, __file__, "--child", kind, "--prompts", str(prompt_file)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + ["--trace"] * trace, stdout=subprocess.PIPE, text=True, env=env)
    lines = proc.stdout.rstrip("\n").splitlines()
    sys.stderr.write("\n".join(lines[:-1]) + "\n")
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} engine process failed (exit {proc.returncode})")
    report: dict[str, Any] = json.loads(lines[-1])
    peak, final, took = (
        report["peak_rss"] / MIB,
        report["final_rss"] / MIB,
        time.perf_counter() - t0,
    )
    print(f"  {kind}: peak {peak:.1f} MiB, final {final:.1f} MiB ({took:.0f} s)", flush=True)
    return report


# -- the engine process ----------------------------------------------------------------------


def child(kind: str, prompt_file: Path, trace: bool) -> None:
    """Start one engine in this process, serve the prompts, print RSS per phase as JSON."""
    if trace:
        import tracemalloc

        tracemalloc.start()
    proc = psutil.Process()
    rss: dict[str, int] = {}
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    python_mem: dict[str, dict[str, Any]] = {}
    snapshots: list[Any] = []

    def mark(phase: str) -> None:
        rss[phase] = proc.memory_info().rss
        seconds[phase] = round(time.perf_counter() - t0, 2)
        if trace:
            current, peak = tracemalloc.get_traced_memory()
            snap = tracemalloc.take_snapshot()
            top = snap.compare_to(snapshots[-1], "filename") if snapshots else []
            python_mem[phase] = {
                "current": current,
                "peak": peak,
                "top_growth": [f"{s.traceback} {s.size_diff / MIB:+.1f} MiB" for s in top[:8]],
            }
            snapshots[:] = [snap]
            tracemalloc.reset_peak()

    mark("interpreter")
    from vllm import SamplingParams

    from kmesh_blend.testing.engine import make_llm

    data = json.loads(prompt_file.read_text())
    reader, *follow_ups = [(ids, spans) for ids, spans in data["prompts"]]
    mark("imports")
    args: dict[str, Any] = {"max_model_len": 4096, "max_num_batched_tokens": 4096}
    if kind == "kmesh":
        extra = {
            "kmesh.store": "cpu",
            "kmesh.recompute_ratio": 0.15,
            "kmesh.store_cpu_bytes": STORE_CPU_BYTES,
            "kmesh.retention_bytes": RETENTION_BYTES,
        }
        args["enable_prefix_caching"] = False
        args["kv_transfer_config"] = {
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    llm = make_llm(data["model"], dtype="bfloat16", **args)
    mark("engine start")

    def params(spans: list[list[int]]) -> Any:
        annotation = {"kv_transfer_params": {"kmesh": {"segments": spans}}}
        extra_args = annotation if kind == "kmesh" else None
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args=extra_args)

    llm.generate([{"prompt_token_ids": reader[0]}], params(reader[1]), use_tqdm=False)
    mark("first reader")
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids, _ in follow_ups],
        [params(spans) for _, spans in follow_ups],
        use_tqdm=False,
    )
    mark("follow-ups")
    reports = [o.kv_transfer_params["kmesh"] for o in outs] if kind == "kmesh" else []
    report = {
        "kind": kind,
        "rss": rss,
        "seconds": seconds,
        "peak_rss": _peak_rss(),
        "final_rss": rss[PHASES[-1]],
        "retained_bytes": _retained_bytes() if kind == "kmesh" else 0,
        "reports": reports,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    if trace:
        report["python_allocations"] = python_mem
    print(json.dumps(report), flush=True)
    os._exit(0)  # skip engine teardown: nothing left to measure, and it can take seconds


def _peak_rss() -> int:
    """The process's resident high-water mark in bytes (VmHWM; it covers moments between the
    phases that RSS samples would miss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _retained_bytes() -> int:
    """Bytes of restored masters the connector's retention pool holds now (−1: not reachable)."""
    from kmesh_blend.testing.engine import live_worker

    try:
        cache = live_worker().cache
    except RuntimeError:
        cache = None
    return int(cache.retention.retained_bytes) if cache is not None else -1


def _plot(stock: float, kmesh: float, overhead: float, goal: float, doc_len: int) -> Path:
    """``bench/results/engine_memory.png``: stock's and KMesh's peak RSS, KMesh's bar split into
    stock's level, the store budgets and the overhead; the goal marked on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _common import RESULTS as results

    results.mkdir(parents=True, exist_ok=True)
    budgets = (STORE_CPU_BYTES + RETENTION_BYTES) / MIB
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(["stock", "kmesh"], [stock, stock], color="#4878a8", label="stock vLLM peak")
    ax.bar(["kmesh"], [budgets], bottom=[stock], color="#a0a0a0", label="store budgets")
    ax.bar(["kmesh"], [overhead], bottom=[stock + budgets], color="#d08040", label="overhead")
    limit = stock + budgets + goal
    ax.hlines(limit, 0.6, 1.4, colors="black", linestyles="dashed", label=f"goal ({goal:.0f})")
    top = max(kmesh, limit) * 1.01
    ax.text(0, stock, f"{stock:.0f} MiB", ha="center", va="bottom")
    ax.text(1, top, f"{kmesh:.0f} MiB (overhead {overhead:.0f})", ha="center", va="bottom")
    ax.set_ylabel("MiB (peak RSS)")
    ax.set_ylim(0, top * 1.12)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        f"engine peak RSS, SmolLM2 bf16, {doc_len}-token document + 4 follow-ups, vLLM CPU",
        fontsize=10,
    )
    fig.tight_layout()
    path = results / "engine_memory.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
