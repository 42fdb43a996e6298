"""Run every benchmark script in bench/ and collect its result (what `make bench` does).

Each script's last printed line is one JSON object (``name``, ``metric``, ``value``, ``unit``,
``goal``, ``baseline``, ``quick``, ``config``). This runner saves it as
``bench/results/<name>.json`` and rewrites the results table of docs/results.md between its
markers, so the table only ever shows measured numbers. ``--quick`` passes ``--quick`` to every
script; a quick run's results (JSON and plots) go to ``bench/results/quick/`` and the tables are
left alone, so a quick run never replaces a full one.

Every ``bench/*.py`` script (but this one and ``_*`` helpers) is one benchmark named after its
file; `VARIANTS` adds benchmarks that run a script again with other arguments (named after the
result they write).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
TABLE_DOC = BENCH.parent / "docs" / "results.md"  # every result's row
QUALITY_DOC = BENCH.parent / "docs" / "quality.md"  # the quality tables' home
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
Q_BEGIN, Q_END = "<!-- quality:begin -->", "<!-- quality:end -->"
R_BEGIN, R_END = "<!-- quality_smollm2:begin -->", "<!-- quality_smollm2:end -->"
LOAD_DOC = BENCH.parent / "docs" / "load.md"  # bench/serving.py's table
S_BEGIN, S_END = "<!-- serving:begin -->", "<!-- serving:end -->"
# name -> (script, arguments): a script run again under another workload
VARIANTS = {
    "quality_smollm2": ("quality.py", ["--model", "smollm2"]),
    "follow_up_ttft_smollm2": ("follow_up_ttft.py", ["--model", "smollm2"]),
    "cascade_load_kv64": ("cascade_load.py", ["--kv-blocks", "64"]),
    # the tight KV budget of the serving benchmark, and its run-to-run spread
    "serving_kv64": ("serving.py", ["--kv-blocks", "64"]),
    "serving_kv64_spread": ("serving_spread.py", ["--kv-blocks", "64", "--repeats", "5"]),
    "cascade_decode_guard": ("cascade_decode.py", ["--speed-guard", "auto"]),
    "agents_per_memory_guard": ("agents_per_memory.py", ["--speed-guard", "auto"]),
    "follow_up_ttft_smollm2_mixed": (
        "follow_up_ttft.py",
        ["--model", "smollm2", "--workload", "mixed"],
    ),
    # the TTFT side of the quality frontier at ratio 0.5, where drift correction reaches bf16's
    "follow_up_ttft_smollm2_r0.5": (
        "follow_up_ttft.py",
        ["--model", "smollm2", "--recompute-ratio", "0.5"],
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, same code path")
    parser.add_argument("names", nargs="*", help="only these benchmarks (e.g. quality)")
    parser.add_argument(
        "--no-tables",
        "--no-readme",
        action="store_true",
        help="write bench/results/ only, leave the generated tables alone",
    )
    args = parser.parse_args()
    scripts = sorted(p for p in BENCH.glob("*.py") if p.name != "run_all.py" and p.name[0] != "_")
    jobs: list[tuple[str, Path, list[str]]] = [(p.stem, p, []) for p in scripts]
    jobs += [(name, BENCH / script, extra) for name, (script, extra) in VARIANTS.items()]
    jobs.sort(key=lambda job: job[0])
    unknown = set(args.names) - {name for name, _, _ in jobs}
    if unknown:
        known = [name for name, _, _ in jobs]
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; known: {known}")
    if args.names:
        jobs = [job for job in jobs if job[0] in args.names]
    results = quick_results() if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, script, extra in jobs:
        print(f"== {name}", flush=True)
        cmd = [sys.executable, str(script), *extra, *(["--quick"] if args.quick else [])]
        # stdout is collected for the result line; stderr (progress bars, logs) goes straight
        # to the terminal so a long run shows where it is.
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        print(proc.stdout, end="")
        lines = proc.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            print(f"{name}: no result line (exit {proc.returncode})", file=sys.stderr)
            failed.append(name)
            continue
        (results / f"{result['name']}.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_tables and not args.quick:
        write_tables()
    if not jobs:
        print("no benchmark scripts in bench/ yet")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def quick_results() -> Path:
    """Where a ``--quick`` run's results go (the scripts agree: ``bench/_common.py``)."""
    return RESULTS / "quick"


def write_tables() -> None:
    """Regenerate docs/results.md's results table, docs/load.md's serving table and
    docs/quality.md's quality tables from bench/results/*.json."""
    rows = ["| benchmark | metric | value | goal | baseline | mode |", "|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        r = json.loads(path.read_text())
        mode = "quick" if r.get("quick") else "full"
        goal = "—" if r.get("goal") is None else r["goal"]
        # None: the run could not form the ratio (e.g. a serving run without its baseline engine)
        value = "—" if r["value"] is None else f"{r['value']:.3g} {r.get('unit', '')}"
        rows.append(
            f"| {r['name']} | {r['metric']} | {value} | {goal} | {r.get('baseline', '—')} "
            f"| {mode} |"
        )
    if len(rows) == 2:
        rows.append("| — | not measured yet | — | — | — | — |")
    TABLE_DOC.write_text(_between(TABLE_DOC.read_text(), BEGIN, END, rows))
    serving = RESULTS / "serving.json"
    if LOAD_DOC.exists() and serving.exists():
        rows = _serving_rows(json.loads(serving.read_text()))
        LOAD_DOC.write_text(_between(LOAD_DOC.read_text(), S_BEGIN, S_END, rows))
    if not QUALITY_DOC.exists():
        return
    text = QUALITY_DOC.read_text()
    quality = RESULTS / "quality.json"
    if quality.exists():
        text = _between(text, Q_BEGIN, Q_END, _quality_rows(json.loads(quality.read_text())))
    real = RESULTS / "quality_smollm2.json"
    if real.exists():
        ceiling = RESULTS / "selection_ceiling.json"
        oracle = json.loads(ceiling.read_text()) if ceiling.exists() else None
        rows = _real_quality_rows(json.loads(real.read_text()), oracle)
        text = _between(text, R_BEGIN, R_END, rows)
    QUALITY_DOC.write_text(text)


def _real_quality_rows(result: dict, ceiling: dict | None = None) -> list[str]:
    """docs/quality.md's real-model table: every rule × ratio × selection of
    ``quality_smollm2``, then its reference points and, when ``selection_ceiling`` ran, the
    oracle selections at 0.15."""
    cfg = result["config"]
    served = cfg.get("served_identical_answers", {})
    rows = [
        f"{cfg['follow_ups']} follow-ups, {cfg['positions']} answer positions, check layers "
        f"{cfg['check_layers']}, {'quick' if result['quick'] else 'full'} run; ± = standard error "
        "clustered by task; TTFT and served answers: per_request, through vLLM.",
        "",
        "| rule | selection | ratio | sinks | recomputed | top-1 agreement | KL(full ‖ blend) "
        "| identical answers | served identical | TTFT / stock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cfg["table"]:
        ttft = "—" if r["ttft_vs_stock"] is None else f"{r['ttft_vs_stock']:.3f}"
        same = served.get(r["nominal"]) if r["selection"] == "per_request" else None
        rows.append(
            f"| {r['rule']} | {r['selection']} | {r['ratio']:.3g} | {r['sink_tokens']} "
            f"| {r['recomputed']:.3f} | {r['agreement']:.3f} ± {r['agreement_se']:.3f} "
            f"| {r['kl']:.2e} | {r['identical_answers']:.3f} "
            f"| {'—' if same is None else f'{same:.3f}'} | {ttft} |"
        )
    return rows + _reference_points(cfg) + _ceiling_rows(ceiling)


def _reference_points(cfg: dict) -> list[str]:
    floor, ties = cfg.get("bf16_full_prefill_vs_fp32"), cfg.get("near_ties")
    if floor is None or ties is None:  # a result from before these were measured
        return []
    reached = cfg.get("goal_reached_at_ratio")
    goal = "at none of the ratios measured" if reached is None else f"from ratio {reached:g}"
    gaps = ", ".join(f"{share:.1%} under {gap} nats" for gap, share in ties.items())
    return [
        "",
        f"Reference points, same run: the same full prefills run in bf16 agree with the fp32 "
        f"engine's on {floor['agreement']:.3f} ± {floor['agreement_se']:.3f} of answer positions "
        f"(KL {floor['kl']:.2e}, identical answers {floor['identical_answers']:.3f}); the full "
        f"prefill's top-1 leads its top-2 by {gaps}; the deviation rule reaches 0.99 {goal}.",
        *_goal_line(cfg),
    ]


def _goal_line(cfg: dict) -> list[str]:
    goal = cfg.get("goal")
    if goal is None:  # a result from before the goal was stated against bf16
        return []
    ceiling = goal.get("selection_ceiling")
    past = "" if ceiling is None else (
        f"; the selection ceiling (the best oracle choice of tokens) is {ceiling:.3f}, which it "
        f"{'passes' if goal['past_selection_ceiling'] else 'does not pass'}"
    )  # fmt: skip
    return [
        "",
        f"Goal (reuse error no larger than bf16's): at ratio 0.15 the best method "
        f"({cfg.get('headline_rule', 'deviation')}) agrees on {goal['agreement']:.3f} against the "
        f"bf16 floor {goal['bf16_floor']:.3f}: {'met' if goal['reached'] else 'not met'}{past}.",
    ]


def _ceiling_rows(ceiling: dict | None) -> list[str]:
    if ceiling is None:
        return []
    cfg = ceiling["config"]
    rows = [
        "",
        f"Oracle selections at ratio {cfg['ratio']} (`bench/selection_ceiling.py`, "
        f"{cfg['follow_ups']} follow-ups, {cfg['positions']} positions, "
        f"{'quick' if ceiling['quick'] else 'full'} run): the same token count chosen with the "
        "full prefill's own KV and attention; drift auto (the rule with drift correction, not a "
        "selection) beside them. Paired: the difference from the rule on the same answer "
        "positions.",
        "",
        "| selection score | top-1 agreement | paired vs deviation | KL(full ‖ blend) "
        "| identical answers |",
        "|---|---|---|---|---|",
    ]
    for r in cfg["table"]:
        paired = "—"
        if "vs_deviation" in r:
            paired = f"{100 * r['vs_deviation']:+.1f} ± {100 * r['vs_deviation_se']:.1f} pts"
        rows.append(
            f"| {r['rule']} | {r['agreement']:.3f} ± {r['agreement_se']:.3f} | {paired} "
            f"| {r['kl']:.2e} | {r['identical_answers']:.3f} |"
        )
    past = cfg.get("drift_auto_vs_best_oracle")
    if past:
        (gain, gain_se), (kl, kl_se) = past["agreement"], past["kl"]
        rows += [
            "",
            f"Drift auto − the best oracle ({cfg['best_oracle']}), paired: top-1 "
            f"{100 * gain:+.1f} ± {100 * gain_se:.1f} points, KL {kl:+.2e} ± {kl_se:.2e}.",
        ]
    return rows


def _serving_rows(result: dict) -> list[str]:
    """docs/load.md's table: every engine × rate of ``bench/serving.py``, then its headline."""
    cfg = result["config"]
    cpu = cfg.get("cpu", {})
    isa = "AMX" if cpu.get("amx_tile") else "AVX-512 BF16" if cpu.get("avx512_bf16") else "AVX2"
    if cfg.get("attn_isa"):
        isa += f", vLLM attention kernel {cfg['attn_isa']}"
    if cfg.get("kv_blocks"):
        isa += f", KV budget {cfg['kv_blocks']} blocks"
    rows = [
        f"{'Quick' if result['quick'] else 'Full'} run of `bench/serving.py` on {cpu.get('model')}"
        f" ({cpu.get('cores')} cores, {isa}): {cfg['families']} families × {cfg['agents']} "
        f"agents, documents of {min(cfg['document_tokens'])}–{max(cfg['document_tokens'])} "
        f"tokens, {cfg['output_tokens']} output tokens; SLO TTFT ≤ {cfg['slo_ms']['ttft']:g} ms, "
        f"TPOT ≤ {cfg['slo_ms']['tpot']:g} ms.",
        "",
        "| engine | offered req/s | completed req/s | within SLO | goodput req/s | TTFT p50 / p99 "
        "(ms) | ITL p50 / p99 (ms) | families/min | reused / fallbacks / preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for engine, by_rate in cfg["engines"].items():
        for rate, r in by_rate.items():
            s = r["server"]
            rows.append(
                f"| {engine} | {rate} | {r['request_throughput']:.3f} | {r['within_slo']:.0%} "
                f"| {r['request_goodput']:.3f} "
                f"| {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} "
                f"| {r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | {r['families_per_min']:.2f} "
                f"| {s['requests_reused']:.0f} / {s['requests_fallback']:.0f} "
                f"/ {s['preemptions']:.0f} |"
            )
    best, value = cfg["sustained_rate"], result["value"]
    bound = " (a lower bound: stock sustains none of the rates)" if cfg[
        "stock_below_lowest_rate"] else ""  # fmt: skip
    exact = cfg.get("exactness") or {}
    sweep = cfg.get("sustained_rate_by_ttft_s") or {}
    if sweep:
        rows += [
            "",
            "The same runs under other TTFT bounds (TPOT as above; from the client's per-request "
            "figures), highest rate sustained: "
            + "; ".join(
                f"TTFT ≤ {t} s: " + ", ".join(f"{e} {r}" for e, r in by.items())
                for t, by in sweep.items()
            )
            + ".",
        ]
    rows += [
        "",
        f"Highest rate sustained (≥ {cfg['sustained_share']:.0%} of requests within the SLO there "
        f"and below): {', '.join(f'{e} {r}' for e, r in best.items())}. KMesh / stock: "
        f"**{value}×**{bound} (goal ≥ {result['goal']}); p99 TTFT at stock's highest sustained "
        f"rate, KMesh / stock: {cfg['p99_ttft_at_stock_rate']} (goal ≤ {cfg['p99_ttft_goal']}).",
    ]
    if exact:
        rows += [
            "",
            f"At recompute ratio 1.0 (fp32, one request at a time) {exact['identical']} of the "
            f"first {exact['requests']} answers the client received equal stock's "
            f"({exact['reused_tokens']:.0f} tokens reused).",
        ]
    return rows


def _quality_rows(result: dict) -> list[str]:
    """docs/quality.md's reuse-quality table: every setting of ``bench/quality.py``'s result."""
    rows = [
        "| selection | ratio | recomputed | top-1 agreement | KL(full ‖ blend) | perplexity |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["config"]["table"]:
        exact = " (bit-identical)" if r["bit_identical"] == 1.0 else ""
        rows.append(
            f"| {r['selection']} | {r['ratio']:g} | {r['recomputed']:.3f} "
            f"| {r['agreement']:.3f}{exact} | {r['kl']:.2e} | {r['perplexity']:.3f} |"
        )
    return rows


def _between(text: str, begin: str, end: str, rows: list[str]) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + "\n".join(rows) + "\n" + text[stop:]


if __name__ == "__main__":
    sys.exit(main())
