"""Run-to-run spread of the serving benchmark where it matters: several runs per engine and rate.

`bench/serving.py` runs every engine once per rate. Near the rates where a 2-core server tips
over (0.6 and 0.9 requests/s on the full workload) one run is one draw: a family whose decode
slips behind another family's full prefill changes a run's share within the SLO by several
requests. This benchmark runs the same servers, workload, client and SLO (`serving.one_run`)
``--repeats`` times per engine and rate, and says whether KMesh with ``cascade_decode`` and
``share_kv_memory`` (the speed guard at its default) reaches KMesh defaults' throughput and
goodput *within noise*: its mean ≥ KMesh's mean minus two standard errors of the difference.

Runs are kept in ``bench/results/serving_runs/`` (or ``serving_kv<N>_runs/``): the first of
each cell as `bench/serving.py` names it (``<engine>_r<rate>``), the others beside it as
``<engine>_r<rate>_n<k>``; ``--reuse`` reads back the kept ones (only for the same code: a run
made before a change says nothing about it) and runs the rest. Result ``serving_spread`` (or
``serving_kv<N>_spread`` with ``--kv-blocks N``): value = the smallest, over the rates, of
(kmesh_share's mean within-SLO share − KMesh's) / the standard error of that difference — ≥ −2
means "within noise" at every rate; every run's figures, means and standard deviations are in
``config``. ``--quick``: 2 families × 3 agents, one rate, 2 runs (≈ 10 min).

Run: python bench/serving_spread.py [--quick] [--kv-blocks 64] [--rates 0.6,0.9] [--repeats 3]
[--reuse]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_flags, emit, progress, use_allocator
from _serving import BLOCK_SIZE, Runs, attn_isa, parse_rates, separator_id
from serving import (
    ENGINES,
    SLO,
    chosen_engines,
    engine_args,
    figures,
    one_run,
    runs_folder,
    workload,
)

PAIR = ("kmesh", "kmesh_share")  # (baseline, engine judged against it)
FIGURES = ("within_slo", "request_throughput", "request_goodput", "median_tpot_ms",
           "median_ttft_ms")  # fmt: skip
NOISE = 2.0  # standard errors of the difference that still count as "within noise"


def spread(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one run), min and max of one figure's runs."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"runs": values, "mean": round(statistics.fmean(values), 4), "sd": round(sd, 4),
            "min": min(values), "max": max(values)}  # fmt: skip


def compare(base: dict[str, Any], other: dict[str, Any], floor: float = 0.0) -> dict[str, Any]:
    """``other`` − ``base`` for one figure's spreads: the difference of means, its standard error
    (independent runs; at least ``floor``, the figure's resolution) and the difference in
    standard errors. With no spread on either side and no floor, z is None and only a
    difference ≥ 0 holds."""
    diff = other["mean"] - base["mean"]
    se = math.sqrt(other["sd"] ** 2 / len(other["runs"]) + base["sd"] ** 2 / len(base["runs"]))
    se = max(se, floor)
    z = None if se == 0 else round(diff / se, 2)
    held = diff >= 0 if se == 0 else diff >= -NOISE * se
    return {"difference": round(diff, 4), "se": round(se, 4), "z": z, "within_noise": held}


def cells(rows: dict[str, dict[float, list[dict[str, Any]]]], requests: int) -> dict[str, Any]:
    """Per engine and rate, each figure's spread over its runs; per rate, the pair compared (the
    within-SLO share's standard error at least one request of ``requests`` over √runs: two
    sides without spread still give a z)."""
    table: dict[str, Any] = {}
    for engine, by_rate in rows.items():
        table[engine] = {f"{r:g}": {f: spread([run[f] for run in runs]) for f in FIGURES}
                         for r, runs in by_rate.items()}  # fmt: skip
    if all(e in table for e in PAIR):
        base, other = (table[e] for e in PAIR)
        table["compared"] = {}
        for rate in [r for r in base if r in other]:
            runs = min(
                len(base[rate]["within_slo"]["runs"]), len(other[rate]["within_slo"]["runs"])
            )
            floor = 1 / (requests * math.sqrt(runs))
            table["compared"][rate] = {
                f: compare(base[rate][f], other[rate][f], floor if f == "within_slo" else 0.0)
                for f in ("within_slo", "request_throughput", "request_goodput")
            }
    return table


def value(table: dict[str, Any]) -> float | None:
    """The worst rate's z of the within-SLO difference (None without the pair)."""
    if not table.get("compared"):
        return None
    return min(row["within_slo"]["z"] for row in table["compared"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 families x 3 agents, one rate")
    parser.add_argument("--rates", type=parse_rates, help="requests/s, comma-separated")
    parser.add_argument("--engines", default=",".join(PAIR), help="comma-separated subset")
    parser.add_argument("--repeats", type=int, help="runs per engine and rate (≥ 2)")
    parser.add_argument("--kv-blocks", type=int, help="tight KV budget in blocks (all engines)")
    parser.add_argument("--reuse", action="store_true", help="read back kept runs (same code)")
    args = parser.parse_args()
    engines = chosen_engines(parser, args.engines)
    rates, repeats = ([1.0], 2) if args.quick else ([0.6, 0.9], 3)
    rates, repeats = args.rates or rates, args.repeats or repeats
    if repeats < 2:
        parser.error(f"--repeats: {repeats}; a spread needs at least 2 runs")
    model, tokenizer, work = workload(args.quick)
    allocator = use_allocator("tcmalloc")
    sep = separator_id(tokenizer)
    platform = {"cpu": cpu_flags(), "attn_isa": attn_isa("bfloat16", BLOCK_SIZE)}
    runs = Runs(runs_folder(args.kv_blocks), platform, replay=args.reuse)
    rows: dict[str, dict[float, list[dict[str, Any]]]] = {e: {r: [] for r in rates}
                                                          for e in engines}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kmesh-spread-") as tmp:
        out = Path(tmp)
        dataset = work.write(out / "agents.jsonl")
        # repeats outermost: each round gives every cell one run before any gets its next
        for k in progress(range(1, repeats + 1), "rounds"):
            for engine in engines:
                for rate in rates:
                    name = f"{engine}_r{rate:g}" + ("" if k == 1 else f"_n{k}")
                    server_args = engine_args("bfloat16", ENGINES[engine], sep, args.kv_blocks)
                    result, _ = runs.get(name, lambda a=server_args, r=rate, n=name: one_run(
                        model, a, dataset, r, out, n))  # fmt: skip
                    rows[engine][rate].append(figures(result, work))
                    print(name, rows[engine][rate][-1]["within_slo"], file=sys.stderr, flush=True)
    table = cells(rows, len(work.rows))
    name = "serving_spread" if args.kv_blocks is None else f"serving_kv{args.kv_blocks}_spread"
    emit({
        "name": name,
        "metric": "worst rate's (kmesh_share − KMesh) within-SLO share, in standard errors",
        "value": value(table),
        "unit": "SE",
        "goal": -NOISE,
        "baseline": "KMesh defaults, same workload, server arguments and client, same runs",
        "quick": args.quick,
        "config": {
            "model": "SmolLM2-135M-Instruct (bf16)", "client": "vllm.benchmarks.serve",
            "slo_ms": SLO, "allocator": allocator, "attn_isa": platform["attn_isa"],
            "cpu": platform["cpu"], "block_size": BLOCK_SIZE, "kv_blocks": args.kv_blocks,
            "families": len(set(work.family)), "agents": max(work.agent) + 1,
            "requests": len(work.rows), "document_tokens": list(work.document_tokens),
            "output_tokens": work.rows[0]["output_tokens"],
            "repeats": repeats, "noise_se": NOISE, "cells": table,
        },
    })  # fmt: skip


if __name__ == "__main__":
    main()
