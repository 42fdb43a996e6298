"""Follow-up time to first token on real vLLM: stock (prefix caching on) vs KMesh, and the
overhead KMesh adds to unannotated requests.

Workload (the issue's anchor): the 24-layer bench model (bf16 by default, as the stock-vLLM anchor;
``--dtype float32`` too; CPU, in-process engine), a shared
document D of 2,048 tokens, follow-ups = 64 private instruction tokens + D + 32 question tokens.
Prefix caching cannot help stock vLLM (the private part comes first). KMesh reads D once (the
first reader publishes its master), then each follow-up reuses it at recompute ratio 0.15.
The engines run in this process one after another (vLLM's KV connector is process-global): stock,
KMesh, stock again; each is warmed up first; requests go one at a time. TTFT = wall time of a
1-token generate.

value = median KMesh follow-up TTFT / median stock follow-up TTFT (goal ≤ 0.25).
config.unannotated_overhead = median KMesh-engine TTFT of unannotated prompts / stock − 1
(goal ≤ 3%; the KMesh engine runs with prefix caching off, which it requires).
config.kmesh_vs_unannotated_same_engine = the same ratio against unannotated prompts measured
interleaved on the KMesh engine (the stock path there): a cross-check free of engine order.

Both engines run under tcmalloc by default, the allocator vLLM's CPU guide requires for
performance (``--allocator system`` for glibc's malloc; config.allocator says which ran).

Run: python bench/follow_up_ttft.py [--quick] [--allocator tcmalloc|system]
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
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, plot_bars, progress, use_allocator

from kmesh_blend.testing import BENCH_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import make_llm

RATIO = 0.15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--allocator",
        default="tcmalloc",
        choices=["tcmalloc", "system"],
        help="tcmalloc (vLLM's documented CPU setup, default) or the system malloc",
    )
    args = parser.parse_args()
    allocator = use_allocator(args.allocator)
    doc_len = 512 if args.quick else 2048
    rounds = 2 if args.quick else 6
    from vllm import SamplingParams

    path = build_checkpoint(BENCH_LLAMA)
    gen = torch.Generator().manual_seed(0)
    vocab = BENCH_LLAMA.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    doc = tokens(doc_len)

    def follow_up() -> tuple[list[int], list[list[int]]]:
        private, question = tokens(64), tokens(32)
        return private + doc + question, [[64, 64 + doc_len]]

    def ttft(llm: Any, ids: list[int], spans: list[list[int]] | None) -> tuple[float, Any]:
        extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if spans else None
        sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    common = {"max_model_len": 4096, "max_num_batched_tokens": 4096, "dtype": args.dtype}
    rounds_ids = [(follow_up(), follow_up()[0]) for _ in range(rounds)]
    reader_ids, reader_spans = follow_up()
    times: dict[str, list[float]] = {"stock": [], "kmesh": [], "stock_plain": [], "kmesh_plain": []}

    def run_stock() -> None:
        stock = make_llm(path, **common)
        for _ in range(3):  # warm-up, unmeasured
            ttft(stock, tokens(doc_len + 96), None)
        for (ids, _), plain in progress(rounds_ids, "stock rounds"):
            times["stock"].append(ttft(stock, ids, None)[0])
            times["stock_plain"].append(ttft(stock, plain, None)[0])
        del stock
        gc.collect()

    # Engines run one after another (vLLM's KV connector is process-global): stock, KMesh, then
    # stock again, so neither side gains from the order (the first engine of a process is slower).
    run_stock()

    # Phase 2: the same engine settings with KMesh (prefix caching off, as it requires).
    kmesh = make_llm(
        path,
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kmesh.store": "cpu", "kmesh.recompute_ratio": RATIO},
        },
        **common,
    )
    for _ in range(3):  # warm-up, unmeasured
        ttft(kmesh, tokens(doc_len + 96), None)
    _, reader = ttft(kmesh, reader_ids, reader_spans)  # publishes the document's master
    reports = []
    for (ids, spans), plain in progress(rounds_ids, "kmesh rounds"):
        t, out = ttft(kmesh, ids, spans)
        times["kmesh"].append(t)
        reports.append(out.kv_transfer_params["kmesh"])
        times["kmesh_plain"].append(ttft(kmesh, plain, None)[0])
    del kmesh
    gc.collect()
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()  # lets a connector-free engine start in this process again
    run_stock()
    med = {k: statistics.median(v) for k, v in times.items()}
    value = med["kmesh"] / med["stock"]
    same_engine = med["kmesh"] / med["kmesh_plain"]
    overhead = med["kmesh_plain"] / med["stock_plain"] - 1.0
    print(f"follow-up of {doc_len + 96} tokens, {rounds} rounds (medians):")
    print(f"  stock vLLM (prefix caching on): {med['stock']:.3f} s")
    print(f"  KMesh reuse at ratio {RATIO}:     {med['kmesh']:.3f} s  = {value:.3f}x of stock")
    print(f"  vs unannotated requests on the same engine (interleaved): {same_engine:.3f}x")
    print(f"  reports: {reports}")
    print(f"  unannotated: stock {med['stock_plain']:.3f} s, KMesh engine "
          f"{med['kmesh_plain']:.3f} s ({overhead:+.1%})")  # fmt: skip
    plot_bars(
        "follow_up_ttft",
        ["stock", "kmesh", "stock unannotated", "kmesh unannotated"],
        [med["stock"], med["kmesh"], med["stock_plain"], med["kmesh_plain"]],
        f"follow-up TTFT, {doc_len}-token shared document, bench model, vLLM CPU",
    )
    emit(
        {
            "name": "follow_up_ttft",
            "metric": "KMesh follow-up TTFT / stock vLLM follow-up TTFT",
            "value": round(value, 4),
            "unit": "x",
            "goal": 0.25,
            "baseline": "stock vLLM with prefix caching, same process, same prompts",
            "quick": args.quick,
            "config": {
                "model": BENCH_LLAMA.name,
                "dtype": args.dtype,
                "allocator": allocator,
                "document": doc_len,
                "tokens": doc_len + 96,
                "recompute_ratio": RATIO,
                "seconds_median": {k: round(v, 4) for k, v in med.items()},
                "kmesh_vs_unannotated_same_engine": round(same_engine, 4),
                "unannotated_overhead": round(overhead, 4),
                "unannotated_overhead_goal": 0.03,
                "reused_tokens": [r["reused_tokens"] for r in reports],
                "first_reader_report": reader.kv_transfer_params["kmesh"],
            },
        }
    )


if __name__ == "__main__":
    main()
