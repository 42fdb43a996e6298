"""The blend's fixed cost: a follow-up's time to first token split into its phases, served.

SmolLM2-135M-Instruct (bf16) in vLLM, in this process (its CPU attention kernel), on the chat
follow-ups of `follow_up_ttft --model smollm2` around real text, for each layout in ``--docs``:
``NxM`` is N documents of M tokens side by side, each its own segment (full: ``4x192`` — short
documents, as in `kmesh-blend quality`'s tasks — and ``1x2048``; ``--quick``: ``4x192``, fewer
repeats, ≤ 2 minutes). One KMesh
engine at its defaults: the first reader publishes the document, then follow-ups at recompute
ratio 0, 0.15 and 1.0 (each request's own ``recompute_ratio``), interleaved, ``--repeats`` each;
a stock engine (no connector, prefix caching on) serves the same prompts, each a cold prefill
(every prompt starts with its own system prompt). Engines run stock, KMesh, stock (the first
engine of a process is slower); every request is a 1-token generate, timed whole.

Timers wrap the functions of each phase in this process (nothing in the package changes) and
keep each phase's *own* time (nested phases subtracted), so the phases add up to the TTFT:

| phase | wrapped |
|---|---|
| engine | `LLM.generate` less all below: request set-up, outputs |
| scheduler | vLLM's `Scheduler.schedule`, the connector's scheduler side in it (matching) |
| vllm forward | `CPUModelRunner.execute_model` less the blend in it: the last token's forward |
| sampling | `CPUModelRunner.sample_tokens` (stock's column: `vllm forward` less attention) |
| fetch | `worker_load.fetch_masters`: the masters from the segment cache |
| prefix | `worker_load.blend_request`: vLLM's exact prefix read back, the blend's input |
| setup | `RequestBlend.__init__`: selection plan, embeddings |
| master read | `MasterSource.layer_kv`: a master's layer, as stored |
| re-position | `reposition_keys`: stored keys rotated to their new positions |
| frames | `_Group._stored_frames` less the two above: each request's dense layer frame |
| qkv | `RequestBlend.begin` less select/drift: projections, rotation, rows into the frame |
| select | `RequestBlend._select`: the check layer's deviation score and top share |
| drift | `DriftCorrection.calibrate` / `apply` |
| kv write | `cpu_attention.write_kv`: the layer's rows into vLLM's paged cache |
| attention | `cpu_attention.run_kernel` and the hook around it; `CPUAttentionBackendImpl.forward` |
| o-proj + mlp | `RequestBlend.end` |
| finish | `RequestBlend.finish` |
| blend rest | `WorkerSide.load` less the above: hooks, results, decode plans |
| save | `WorkerSide.save`: tails, publishing |

value = ratio 0's TTFT / stock's TTFT of the same prompts on the first layout (goal ≤ 0.15:
with nothing recomputed but the private tokens, what is left is overhead). Results name the CPU
and vLLM's attention kernel (``config.attn_isa``).

Run: python bench/blend_profile.py [--quick] [--docs 4x192,1x2048] [--repeats N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_flags, emit, progress, use_allocator
from _serving import attn_isa
from follow_up_ttft import Prompt, smollm2_prompts

from kmesh_blend.testing.engine import kv_transfer_config, make_llm

RATIOS = (0.0, 0.15, 1.0)
BLOCK_SIZE = 128  # vLLM's CPU default


class Timers:
    """Own time per phase label (seconds), nested calls subtracted from their callers'."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open call: [start, time spent in callees]

    def wrap(self, owner: Any, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return real(*args, **kwargs)
            finally:
                start, inner = self._stack.pop()
                took = time.perf_counter() - start
                self.own[label] += took - inner
                if self._stack:
                    self._stack[-1][1] += took

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        own, self.own = dict(self.own), defaultdict(float)
        return own


def install(timers: Timers) -> None:
    """Wrap each phase's functions (see the module docstring)."""
    from vllm import LLM
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    import kmesh_blend.blend.group as group
    import kmesh_blend.vllm.worker_side as worker_side
    from kmesh_blend.blend.drift import DriftCorrection
    from kmesh_blend.blend.executor import RequestBlend
    from kmesh_blend.blend.source import MasterSource
    from kmesh_blend.vllm.seam import cpu_attention

    for owner, name, label in (
        (LLM, "generate", "engine"),
        (Scheduler, "schedule", "scheduler"),
        (CPUModelRunner, "execute_model", "vllm forward"),
        (CPUModelRunner, "sample_tokens", "sampling"),
        (CPUAttentionBackendImpl, "forward", "attention"),
        (worker_side.WorkerSide, "load", "blend rest"),
        (worker_side.WorkerSide, "save", "save"),
        (worker_side, "fetch_masters", "fetch"),
        (worker_side, "blend_request", "prefix"),
        (RequestBlend, "__init__", "setup"),
        (MasterSource, "layer_kv", "master read"),
        (group, "reposition_keys", "re-position"),
        (group._Group, "_stored_frames", "frames"),
        (RequestBlend, "begin", "qkv"),
        (RequestBlend, "_select", "select"),
        (DriftCorrection, "calibrate", "drift"),
        (DriftCorrection, "apply", "drift"),
        (cpu_attention, "write_kv", "kv write"),
        (RequestBlend, "attend", "attention"),
        (cpu_attention, "run_kernel", "attention"),
        (RequestBlend, "end", "o-proj + mlp"),
        (RequestBlend, "finish", "finish"),
    ):
        timers.wrap(owner, name, label)


PHASES = ("engine", "scheduler", "vllm forward", "sampling", "fetch", "prefix", "setup",
          "master read", "re-position", "frames", "qkv", "select", "drift", "kv write",
          "attention", "o-proj + mlp", "finish", "blend rest", "save")  # fmt: skip


def generate(llm: Any, ids: list[int], segments: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kmesh": segments}} if segments else None
    params = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]


def measure(timers: Timers, llm: Any, ids: list[int],
            segments: dict[str, Any] | None) -> tuple[dict[str, float], Any]:  # fmt: skip
    """One request's phases (seconds, own time; ``engine`` holds what no other phase does)."""
    timers.take()
    out = generate(llm, ids, segments)
    return timers.take(), out


def layout(text: str) -> tuple[int, int]:
    """``NxM`` → (N documents, M tokens each)."""
    count, _, tokens = text.partition("x")
    if not (count.isdigit() and tokens.isdigit()) or int(count) < 1 or int(tokens) < 16:
        raise argparse.ArgumentTypeError(f"--docs wants NxM (N ≥ 1 documents of M ≥ 16 tokens), "
                                         f"got {text!r}")  # fmt: skip
    return int(count), int(tokens)


def prompts_for(count: int, tokens: int, needed: int) -> tuple[Path, list[Prompt]]:
    """``needed`` chat follow-ups around ``count`` documents of ``tokens`` tokens side by side
    (one text cut in ``count`` consecutive segments)."""
    path, prompts, _ = smollm2_prompts(count * tokens, needed)
    split = [(ids, [[s + tokens * d, s + tokens * (d + 1)] for d in range(count)])
             for ids, ((s, _),) in prompts]  # fmt: skip
    return path, split


def markdown(table: list[dict[str, Any]]) -> str:
    """The profile as docs/performance.md shows it: per layout, a phase a row, a ratio a column
    and stock's prefill the last (ms, median own time), then TTFT and its ratio to stock's."""
    lines = []
    for name in dict.fromkeys(row["layout"] for row in table):
        rows = [row for row in table if row["layout"] == name]
        head = " | ".join(f"ratio {row['ratio']:g}" for row in rows)
        lines += [f"| {name}, ms | {head} | stock |", "|---" * (len(rows) + 2) + "|"]
        for phase in PHASES:
            cells = [row["phases_ms"][phase] for row in rows]
            cells.append(rows[0].get("stock_phases_ms", {}).get(phase, 0.0))
            if any(cells):
                lines.append(f"| {phase} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
        ttft = " | ".join(f"{row['ttft_ms']:.1f}" for row in rows)
        lines.append(f"| **TTFT** | {ttft} | {rows[0]['stock_ms']:.1f} |")
        vs = " | ".join(f"{r['vs_stock']:.3f}" for r in rows)
        lines += [f"| TTFT / stock | {vs} | 1 |", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4x192 only, 2 repeats")
    parser.add_argument("--docs", help="layouts NxM (N documents of M tokens), comma-separated")
    parser.add_argument("--repeats", type=int, help="follow-ups per ratio and layout")
    args = parser.parse_args()
    allocator = use_allocator("tcmalloc")
    names = args.docs.split(",") if args.docs else ["4x192"] if args.quick else ["4x192", "1x2048"]
    try:
        layouts = {name: layout(name) for name in names}
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    repeats = args.repeats or (2 if args.quick else 5)
    if repeats < 1:
        parser.error(f"--repeats must be ≥ 1, got {repeats}")
    # per layout: the reader, a warm-up per ratio, then the measured follow-ups
    work = {name: prompts_for(*shape, 1 + len(RATIOS) * (1 + repeats))
            for name, shape in layouts.items()}  # fmt: skip
    path = next(iter(work.values()))[0]
    common = {"dtype": "bfloat16", "max_model_len": 4096, "max_num_batched_tokens": 4096,
              "block_size": BLOCK_SIZE}  # fmt: skip
    timers = Timers()
    install(timers)
    stock: dict[str, list[dict[str, float]]] = defaultdict(list)  # per layout: each prompt's

    def run_stock() -> None:
        llm = make_llm(path, **common)
        for name, (_, prompts) in work.items():
            generate(llm, prompts[0][0][::-1], None)  # warm-up, unmeasured (a cold prompt)
            for ids, _ in progress(prompts[1:], f"stock, {name}"):
                stock[name].append(measure(timers, llm, ids, None)[0])
        del llm
        gc.collect()

    run_stock()
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm = make_llm(path, kv_transfer_config=kv_transfer_config(store="cpu"), **common)
    # per layout and ratio: each follow-up's phases, and its report
    phases: dict[tuple[str, float], list[dict[str, float]]] = defaultdict(list)
    reports: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for name, (_, prompts) in work.items():
        reader, rest = prompts[0], prompts[1:]
        generate(llm, reader[0], {"segments": reader[1]})  # publishes the documents
        for k, (ids, spans) in enumerate(progress(rest, f"kmesh, {name}")):
            ratio = RATIOS[k % len(RATIOS)]
            own, out = measure(timers, llm, ids, {"segments": spans, "recompute_ratio": ratio})
            if k >= len(RATIOS):  # the first follow-up of each ratio warms up
                phases[name, ratio].append(own)
                reports[name, ratio].append(out.kv_transfer_params["kmesh"])
    del llm
    gc.collect()
    ensure_kv_transfer_shutdown()  # lets a connector-free engine start in this process again
    run_stock()
    table, vs_stock = [], {}
    for name, (_, prompts) in work.items():
        stock_s = statistics.median(sum(r.values()) for r in stock[name])
        stock_row = {p: round(statistics.median(r.get(p, 0.0) for r in stock[name]) * 1e3, 2)
                     for p in PHASES}  # fmt: skip
        length = statistics.median(len(ids) for ids, _ in prompts[1:])
        print(f"{name} ({length:g}-token prompts): stock prefill {stock_s * 1e3:.1f} ms (median)")
        for ratio in RATIOS:
            runs = phases[name, ratio]
            row = {p: statistics.median(r.get(p, 0.0) for r in runs) for p in PHASES}
            ttft = statistics.median(sum(r.values()) for r in runs)
            got = reports[name, ratio]
            recomputed = statistics.median(r["recomputed_tokens"] for r in got)
            reused = statistics.median(r["reused_tokens"] for r in got)
            vs_stock[f"{name}@{ratio:g}"] = round(ttft / stock_s, 4)
            table.append({"layout": name, "ratio": ratio, "prompt_tokens": length,
                          "reused_tokens": reused, "recomputed_tokens": recomputed,
                          "ttft_ms": round(ttft * 1e3, 2), "stock_ms": round(stock_s * 1e3, 2),
                          "vs_stock": round(ttft / stock_s, 4),
                          "phases_ms": {p: round(t * 1e3, 2) for p, t in row.items()},
                          "stock_phases_ms": stock_row})  # fmt: skip
            print(f"  ratio {ratio:g}: TTFT {ttft * 1e3:.1f} ms = {ttft / stock_s:.3f}x stock "
                  f"({reused:g} reused, {recomputed:g} of them recomputed)")  # fmt: skip
            for p in PHASES:
                if row[p] > 0:
                    print(f"    {p:14s} {row[p] * 1e3:8.2f} ms  {row[p] / ttft:6.1%}")
    print(markdown(table))
    first = names[0]
    emit(
        {
            "name": "blend_profile",
            "metric": f"follow-up TTFT at ratio 0 / stock's prefill of the same prompt, {first}",
            "value": vs_stock[f"{first}@0"],
            "unit": "x",
            "goal": 0.15,
            "baseline": "stock vLLM (prefix caching on, no connector), the same prompts, same "
            "process",
            "quick": args.quick,
            "config": {
                "model": "SmolLM2-135M-Instruct (bf16)",
                "allocator": allocator,
                "attn_isa": attn_isa("bfloat16", BLOCK_SIZE),
                "block_size": BLOCK_SIZE,
                "repeats": repeats,
                "vs_stock": vs_stock,
                "table": table,
                "cpu": cpu_flags(),
            },
        }
    )


if __name__ == "__main__":
    main()
