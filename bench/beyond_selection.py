"""Past the selection ceiling at ratio 0.15 on SmolLM2: which methods move the frontier, and what
limits them.

Same tasks, references and metrics as `bench/quality.py --model smollm2` (fp32 engine, the
blend's `VllmModel`, check layers 1–3). Every variant runs through the same executor
(`RequestBlend`, variants in `bench/_beyond.py`) on the same stale rows unless it changes them:

- ``deviation``: the default rule at ratio 0.15;
- ``drift auto``: with ``kmesh.drift_correction = "auto"`` (`kmesh_blend.blend.drift`: the
  share α measured per segment and KV head at each check layer);
- ``drift α=0.3``: the same shift with one fixed share instead of the measured one;
- ``oracle mean shift``: each segment's stale rows shifted by their own *true* mean error per KV
  head (from the full prefill of the very prompt): the best any segment-wide shift can do;
  ``oracle shift per 16 positions``: the same per run of 16 positions from the segment's start,
  the best a drift model by position can do;
- ``adaptive mass m``: a per-request budget — the smallest share of a request's reused tokens
  that carries m of the first check layer's squared deviation (at least 0.15); its mean share is
  printed, to compare with the fixed ratios ``deviation 0.3`` and ``deviation 0.5``;
- ``layers a then b``: per-layer budgets — a share ``a`` kept through layer 15 and ``b`` from
  layer 16 (a further check layer), the reused rows computed over all layers the same as ratio
  0.15's (``rows × layers`` printed);
- ``calibrated map``: stale rows shifted by a model-level per-token map of their own deviation at
  the first check layer, fit on the other tasks' full prefills (`bench/drift_predictability.py`,
  leave one task out); ``calibrated mean shift``: those tasks' mean deviation per layer and head;
- ``query-aware``: the check layers' deviation weighted by the attention the question (the
  prompt's text after its last segment) pays each row there;
- ``stale keys × s``: attention scaling (APE's temperature) — the stale rows' keys multiplied
  by s in every layer, so every query's logits over them are scaled by s;
- ``anchored masters``: each document's master computed after one fixed anchor (the chat
  template's header with a fixed system prompt) instead of after its reader's own text;
- ``chained masters``: each follow-up of a family blends from the previous follow-up's blended
  rows (computed in a follow-up's context) instead of the reader's master; ``chained after
  full``: the first follow-up computes everything (its cost is in the recomputed share);
  ``refreshed masters``: after each follow-up, the rows it recomputed are written back into the
  family's masters (keys re-rotated to the master's positions) — siblings' fresh rows as further
  observations of the same segment — and the next follow-up blends from them.

Printed per variant: top-1 agreement ± standard error (clustered by task), its difference from
``drift auto`` on the same answer positions ± its own (paired) standard error, KL, the stale rows'
relative error against the full prefill's KV (keys, values; mean over layers), the mean
recomputed share and the reused rows computed summed over layers (share of all of them).
`make bench` keeps its result line in bench/results/beyond_selection.json.

Run: python bench/beyond_selection.py [--quick | --tasks N] [--only "a,b"]   (--quick: 2 tasks;
--tasks: the first N chat tasks, 8 by default; --only: these variants and the two baselines)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _beyond import FIXED_ALPHA, POSITION_BIN, CalibratedMap, FixedShare, OracleShift, Variant
from _stale_rows import run_on_stale, smollm2_tasks

from kmesh_blend.blend import BlendOptions, DenseSegmentSource, SegmentKV, blend_group
from kmesh_blend.blend.drift import DriftCorrection
from kmesh_blend.quality.chat_harness import aggregate, masters, paired_difference, references

RATIO = 0.15
MASSES = (0.7, 0.85)
# Per-layer budgets, front-loaded: a further check layer keeps a smaller share, with the share
# before it raised so the reused rows computed over all layers stay those of ratio 0.15.
LATER = {"layers 0.20 then 0.10": (0.20, {16: 0.10}),
         "layers 0.25 then 0.05": (0.25, {16: 0.05})}  # fmt: skip
ANCHOR_SYSTEM = "You are a helpful assistant."
KEY_SCALES = (0.9, 1.1)  # attention temperature on stale rows, both directions


def _stale_error(res: Any, full: list[tuple[torch.Tensor, torch.Tensor]],
                 reused: torch.Tensor) -> tuple[float, float] | None:  # fmt: skip
    """The stale rows' relative squared error (keys, values; mean over layers), None if none."""
    stale = reused & ~res.recomputed
    if not bool(stale.any()):
        return None
    err = torch.zeros(2)
    for (fk, fv), k, v in zip(full, res.keys, res.values, strict=True):
        for i, (a, b) in enumerate(((k, fk), (v, fv))):
            err[i] += (a[stale] - b[stale]).float().pow(2).sum() / b[stale].float().pow(2).sum()
    k_err, v_err = (err / len(full)).tolist()
    return k_err, v_err


def _variants() -> dict[str, dict[str, Any]]:
    """Name → what differs from the deviation rule at ratio 0.15: ``ratio``, ``drift`` (a
    `DriftCorrection` class, "oracle" or "oracle by position"), ``mass`` (adaptive budget),
    ``later`` (per-layer budget), ``query`` (query-aware ranking), ``key_scale`` (stale keys
    scaled), ``source`` (where the stale
    rows come from: "reader" masters, "anchor" masters, or "chain" / "chain after full": the
    family's previous follow-up's blended rows, the first follow-up blending at ``ratio`` or
    computing everything)."""
    auto = {"drift": DriftCorrection}
    return {
        "deviation": {},
        "drift auto": auto,
        f"drift α={FIXED_ALPHA}": {"drift": FixedShare},
        "oracle mean shift": {"drift": "oracle"},
        f"oracle shift per {POSITION_BIN} positions": {"drift": "oracle by position"},
        **{f"adaptive mass {m}": {"mass": m} for m in MASSES},
        **{name: {"ratio": r, "later": later} for name, (r, later) in LATER.items()},
        **{
            f"{name} + drift": {"ratio": r, "later": later, **auto}
            for name, (r, later) in LATER.items()
        },
        "calibrated map": {"drift": "calibrated"},
        "calibrated mean shift": {"drift": "calibrated mean"},
        "query-aware": {"query": True},
        "query-aware + drift": {"query": True, **auto},
        **{f"stale keys × {k} + drift": {"key_scale": k, **auto} for k in KEY_SCALES},
        "anchored masters + drift": {"source": "anchor", **auto},
        "chained masters + drift": {"source": "chain", **auto},
        "chained after full + drift": {"source": "chain after full", **auto},
        "refreshed masters": {"source": "refresh"},
        "refreshed masters + drift": {"source": "refresh", **auto},
        "deviation 0.3": {"ratio": 0.3},
        "deviation 0.5": {"ratio": 0.5},
    }


def _calibration(model: Any, tasks: list[Any], variants: dict[str, Any]) -> dict[str, list[Any]]:
    """ "calibrated" / "calibrated mean" → per task, the maps fit on the other tasks."""
    if not any(str(v.get("drift", "")).startswith("calibrated") for v in variants.values()):
        return {}
    from drift_predictability import calibrated_maps, collect, task_moments
    from quality import SMOLLM2_CHECKS  # CalibratedMap's features come from the first one

    per_task = task_moments(collect(model, tasks, SMOLLM2_CHECKS[0]))
    return {"calibrated": [calibrated_maps(per_task, j) for j in range(len(tasks))],
            "calibrated mean": [calibrated_maps(per_task, j, mean_only=True)
                                for j in range(len(tasks))]}  # fmt: skip


def _anchored(model: Any, tokenizer: Any, task: Any) -> DenseSegmentSource:
    """Each document's master computed after one fixed anchor (the chat template's header with
    `ANCHOR_SYSTEM`) instead of after its reader's own text."""
    from kmesh_blend.quality.chat import ChatTask, chat_prompt

    readers = tuple(chat_prompt(tokenizer, ANCHOR_SYSTEM, "", [doc], "") for doc in task.documents)
    return masters(model, ChatTask(task.documents, readers, task.requests))


def _chained(result: Any, request: Any) -> DenseSegmentSource:
    """A follow-up's blended rows of each segment it used, as the next follow-up's masters."""
    source = DenseSegmentSource()
    for use in request.uses:
        rows = slice(use.start, use.end)
        keys = torch.stack([k[rows] for k in result.keys])
        values = torch.stack([v[rows] for v in result.values])
        source.add(use.segment_id, SegmentKV(keys, values, torch.arange(use.start, use.end)))
    return source


def _refreshed(source: DenseSegmentSource, result: Any, request: Any,
               rope: Any) -> DenseSegmentSource:  # fmt: skip
    """``source`` with the rows ``result`` recomputed written back (keys re-rotated to the
    master's positions): the family's masters, refreshed by what its members computed fresh."""
    out = DenseSegmentSource(dict(source.segments))
    for use in request.uses:
        kv = source.segments[use.segment_id]
        rows = result.recomputed[use.start : use.end].nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        keys, values = kv.keys.clone(), kv.values.clone()
        at = rows + use.start
        for layer, (k, v) in enumerate(zip(result.keys, result.values, strict=True)):
            plain = rope.apply(k[at].float(), -at)
            keys[layer, rows] = rope.apply(plain, kv.positions[rows]).to(keys.dtype)
            values[layer, rows] = v[at]
        out.add(use.segment_id, SegmentKV(keys, values, kv.positions))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 tasks instead of --tasks")
    parser.add_argument("--tasks", type=int, default=8, help="chat tasks, 4 follow-ups each")
    parser.add_argument("--only", default="", help="comma-separated variants to run (and the "
                        "first two, the baselines); all by default")  # fmt: skip
    args = parser.parse_args()
    from _common import emit
    from quality import SMOLLM2_CHECKS

    from kmesh_blend.models.layerwise import prefill
    from kmesh_blend.quality import Setting
    from kmesh_blend.quality.metrics import compare, continuation_logits
    from kmesh_blend.quality.report import ANSWER_TOKENS, close

    began = time.perf_counter()
    tokenizer, tasks, llm, model = smollm2_tasks(args.quick, SMOLLM2_CHECKS, args.tasks)
    variants = _variants()
    if args.only:
        chosen = {name.strip() for name in args.only.split(",")}
        unknown = chosen - set(variants)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; known: {list(variants)}")
        variants = {n: v for i, (n, v) in enumerate(variants.items()) if i < 2 or n in chosen}
    parts: dict[str, list[Any]] = {name: [] for name in variants}
    errors: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    shares: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    kinds: list[str] = []
    num_layers = model.shape.num_layers
    try:
        stop = (int(tokenizer.eos_token_id),)
        refs = references(model, tasks, ANSWER_TOKENS, None, stop)
        plain = BlendOptions(recompute_ratio=0.0, check_layers=(1,))
        calibration = _calibration(model, tasks, variants)
        for j, (task, task_refs) in enumerate(zip(tasks, refs, strict=True)):
            sources = {"reader": masters(model, task), "anchor": _anchored(model, tokenizer, task)}
            chains: dict[str, DenseSegmentSource] = {}
            for i, (prompt, ref) in enumerate(zip(task.requests, task_refs, strict=True)):
                kinds.append(prompt.kind)
                request = prompt.blend_request()
                done = prefill(model, request.token_ids, last_only=True)
                full = list(zip(done.keys, done.values, strict=True))
                stale_of: dict[int, Any] = {}
                for name, spec in variants.items():
                    kind = spec.get("source", "reader")
                    base = "reader" if kind in ("refresh",) or "chain" in kind else kind
                    source = chains.get(name, sources[base])
                    ratio = spec.get("ratio", RATIO)
                    if kind == "chain after full" and i == 0:
                        ratio = 1.0
                    options = BlendOptions(recompute_ratio=ratio, check_layers=SMOLLM2_CHECKS)
                    drift = spec.get("drift")
                    if drift in ("calibrated", "calibrated mean"):
                        maps = calibration[drift][j]
                        drift = lambda *a, m=maps: CalibratedMap(m, *a)  # noqa: E731
                    if drift in ("oracle", "oracle by position"):
                        bins = POSITION_BIN if drift == "oracle by position" else None
                        drift = lambda *a, b=bins, f=full: OracleShift(f, b, *a)  # noqa: E731
                    if id(source) not in stale_of:
                        stale_of[id(source)] = blend_group(model, [request], source, plain)[0]
                    blend = Variant(model, request, options, drift, spec.get("mass"),
                                    spec.get("later"), spec.get("query", False),
                                    spec.get("key_scale"))  # fmt: skip
                    res = run_on_stale(blend, stale_of[id(source)])
                    if "chain" in kind:
                        chains[name] = _chained(res, request)
                    if kind == "refresh":
                        chains[name] = _refreshed(source, res, request, model.rope)
                    rows = continuation_logits(model, res.keys, res.values, res.logits, ref.answer)
                    parts[name].append((j, compare(ref.rows, rows, ref.answer)))
                    error = _stale_error(res, full, request.reused_mask)
                    if error is not None:
                        errors[name].append(error)
                    reused = max(1, res.num_reused)
                    shares[name].append((res.num_recomputed / reused,
                                         blend.token_layers / (reused * num_layers)))  # fmt: skip
            print(f"[{time.perf_counter() - began:5.0f} s] task {j + 1}/{len(tasks)}", flush=True)
    finally:
        close(llm)
    table = []
    auto = [p for _, p in parts["drift auto"]]
    for name in variants:
        comparisons, clusters = [p for _, p in parts[name]], [j for j, _ in parts[name]]
        r = aggregate(Setting(RATIO), comparisons, kinds, clusters, RATIO, 0.0)
        gain, gain_se = paired_difference(comparisons, auto, clusters)
        err = torch.tensor(errors[name]).mean(0).tolist()
        share = torch.tensor(shares[name]).mean(0).tolist()
        table.append({"variant": name, "agreement": round(r.agreement, 4),
                      "agreement_se": round(r.agreement_se, 4), "kl": float(f"{r.kl:.4g}"),
                      "vs_drift_auto": round(gain, 4), "vs_drift_auto_se": round(gain_se, 4),
                      "identical_answers": round(r.identical_answers, 4),
                      "stale_error_k": float(f"{err[0]:.4g}"),
                      "stale_error_v": float(f"{err[1]:.4g}"),
                      "recomputed": round(share[0], 4),
                      "token_layers": round(share[1], 4)})  # fmt: skip
        row = table[-1]
        print(f"  {name:34s} agreement {row['agreement']:.4f} ± {row['agreement_se']:.4f} "
              f"({gain:+.4f} ± {gain_se:.4f} paired, vs drift auto), KL "
              f"{row['kl']:.2e}, stale error K {row['stale_error_k']:.2e} V "
              f"{row['stale_error_v']:.2e}, recomputed {row['recomputed']:.3f} "
              f"(rows × layers {row['token_layers']:.3f})")  # fmt: skip
    base = table[0]["agreement"]
    emit({
        "name": "beyond_selection",
        "metric": "top-1 agreement at ratio 0.15: drift correction (auto) / the deviation rule",
        "value": round(table[1]["agreement"] / base, 4),
        "unit": "x",
        "quick": args.quick,
        "config": {"model": "SmolLM2-135M-Instruct (fp32)", "ratio": RATIO,
                   "check_layers": list(SMOLLM2_CHECKS), "tasks": len(tasks),
                   "follow_ups": len(kinds), "table": table,
                   "seconds": round(time.perf_counter() - began, 1)},
    })  # fmt: skip


if __name__ == "__main__":
    main()
