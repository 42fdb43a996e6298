"""`bench/quality.py --model smollm2`: the reuse-quality report (`kmesh_blend.quality.report`,
what ``kmesh-blend quality`` runs) on SmolLM2-135M-Instruct and the built-in multi-document chat
tasks (`kmesh_blend.quality.chat`: 1–4 documents of 192 tokens per prompt, prose from the Python
reference and stdlib code, families of 4, the model's chat template), with the benchmark's
headline: top-1 agreement at ratio 0.15, per request, of the better of the deviation rule alone
and with drift correction (``headline_rule`` says which).

Every field of the report is kept; added: ``headline_se``, ``headline_rule``, ``goal`` (the
headline beside the same run's bf16 floor and the selection ceiling: the best oracle selection
at this budget, `bench/selection_ceiling.py`), ``second_rule_best`` (the best sink
variant against the deviation rule at equal recomputed tokens) and ``goal_reached_at_ratio``
(the smallest deviation ratio reaching 0.99).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kmesh_blend.quality.frontier import plot as plot_frontier

DOC_TOKENS = 192


def selection_ceiling() -> float | None:
    """The best oracle selection's agreement at ratio 0.15 on these tasks, from the committed
    `bench/selection_ceiling.py` result (what choosing tokens alone reaches), or None."""
    path = Path(__file__).resolve().parent / "results" / "selection_ceiling.json"
    if not path.exists():
        return None
    table = json.loads(path.read_text())["config"]["table"]
    return max(r["agreement"] for r in table if r["rule"].startswith("oracle"))


def run(quick: bool, num_tasks: int, check_layers: tuple[int, ...]) -> dict[str, Any]:
    """The whole measurement; returns the result object (the JSON line `bench/run_all.py` reads)."""
    from transformers import AutoTokenizer

    from kmesh_blend.quality.chat import chat_tasks
    from kmesh_blend.quality.report import run as report
    from kmesh_blend.testing import smollm2_checkpoint

    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.0f} s] {message}", flush=True)

    model = smollm2_checkpoint()
    tasks = chat_tasks(AutoTokenizer.from_pretrained(model), num_tasks, doc_tokens=DOC_TOKENS)
    result = report(model, tasks, check_layers=check_layers, quick=False, log=log)
    cfg = result["config"]
    mine = [r for r in cfg["table"] if r["selection"] == "per_request"]
    at_budget = [r for r in mine if r["rule"] in ("deviation", "deviation+drift")
                 and r["ratio"] == 0.15]  # fmt: skip
    headline = max(at_budget, key=lambda r: r["agreement"])
    best = max((r for r in mine if r["rule"].startswith("sink")), key=lambda r: r["agreement"])
    share = best["nominal"].split()[-1]
    rival = next(r for r in mine if r["nominal"] == f"deviation {share}")
    reached = [r["ratio"] for r in mine if r["rule"] == "deviation" and r["agreement"] >= 0.99]
    cfg["model"] = "SmolLM2-135M-Instruct (fp32), vLLM in-process, prefix caching off"
    cfg["headline_se"] = headline["agreement_se"]
    cfg["headline_rule"] = headline["rule"]
    floor = cfg["bf16_full_prefill_vs_fp32"]["agreement"]
    ceiling = selection_ceiling()
    cfg["goal"] = {"agreement": headline["agreement"], "bf16_floor": floor,
                   "reached": headline["agreement"] >= floor, "selection_ceiling": ceiling,
                   "past_selection_ceiling": None if ceiling is None
                   else headline["agreement"] > ceiling}  # fmt: skip
    cfg["second_rule_best"] = {"best_sink_variant": best, "deviation_at_equal_tokens": rival}
    cfg["goal_reached_at_ratio"] = min(reached, default=None)
    return {
        "name": "quality_smollm2",
        "metric": "top-1 agreement with full prefill at ratio 0.15, best method (multi-document "
        "chat); goal: the same run's bf16 full prefill's",
        "value": headline["agreement"],
        "unit": "fraction",
        "goal": floor,
        "baseline": "full prefill, same engine",
        "quick": quick,
        "config": cfg,
    }


def plot(result: dict[str, Any], path: Any) -> None:
    cfg = result["config"]
    plot_frontier(result, path, f"SmolLM2-135M-Instruct, {cfg['follow_ups']} multi-document "
                  f"follow-ups, {cfg['positions']} answer positions")  # fmt: skip
