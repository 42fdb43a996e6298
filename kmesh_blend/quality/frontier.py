"""The reuse-quality frontier: which settings to measure, one table row per setting, the
recommended setting, and the plot.

Rules at equal recomputed tokens (documents of about ``doc_tokens`` tokens): ``deviation`` at
ratio r; ``sink`` = ratio 0 with keep_count(r, doc_tokens) sink tokens; ``sink+deviation`` =
`COMBINED_SINKS` sinks and the deviation ratio that brings the total to the same count.

The recommendation (`recommend`) is the setting that best meets the goal *reuse error no larger
than the model's own bf16 error, at a follow-up TTFT that still pays*: among the per-request
settings whose TTFT / stock is at most ``max_ttft``, the fastest one whose top-1 agreement with
the full prefill reaches ``target`` (by default the same run's bf16-vs-fp32 full-prefill
agreement); when none reaches it, the most faithful one, saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kmesh_blend.blend import keep_count
from kmesh_blend.quality.harness import RATIOS, SELECTIONS, Setting

__all__ = ["COMBINED_SINKS", "GOAL_RATIOS", "nominal", "plot", "recommend", "rule_settings"]

COMBINED_SINKS = 4
GOAL_RATIOS = (0.5, 0.7)  # deviation rule only, per request: how far the ratio must go


def rule_settings(doc_tokens: int, quick: bool = False) -> list[Setting]:
    """Every rule at every ratio, per selection mode; ratios 0 and 1.0 once per mode; then the
    deviation rule per request at `GOAL_RATIOS`; then the deviation rule with drift correction,
    per request, at every ratio between 0 and 1. ``quick``: per request only."""
    out = []
    for selection in SELECTIONS[:1] if quick else SELECTIONS:
        for ratio in RATIOS:
            out.append(Setting(ratio, selection))
        for ratio in RATIOS[1:-1]:
            count = keep_count(ratio, doc_tokens)
            out.append(Setting(0.0, selection, sink_tokens=count))
            if count > COMBINED_SINKS:  # else the combination is the sink rule itself
                rest = (count - COMBINED_SINKS) / (doc_tokens - COMBINED_SINKS)
                out.append(Setting(rest, selection, sink_tokens=COMBINED_SINKS))
    out.extend(Setting(ratio) for ratio in GOAL_RATIOS)
    out.extend(Setting(ratio, drift="auto") for ratio in (*RATIOS[1:-1], *GOAL_RATIOS))
    return out


def nominal(setting: Setting, doc_tokens: int) -> str:
    """``rule ratio`` at the recompute share it matches: 'deviation 0.15', 'sink 0.15', …"""
    if setting.rule in ("none", "all"):
        return setting.rule
    count = setting.sink_tokens + keep_count(setting.ratio, doc_tokens - setting.sink_tokens)
    share = min(RATIOS + GOAL_RATIOS, key=lambda r: abs(keep_count(r, doc_tokens) - count))
    return f"{setting.rule} {share:g}"


def recommend(rows: list[dict[str, Any]], target: float, max_ttft: float) -> dict[str, Any]:
    """The recommended per-request row (see the module docstring) as settings and reasons.

    ``rows``: table rows with ``selection``, ``ratio``, ``sink_tokens``, ``agreement`` and
    ``ttft_vs_stock``."""
    mine = [r for r in rows if r["selection"] == "per_request" and r["rule"] != "all"]
    pays = [r for r in mine if r["ttft_vs_stock"] is not None and r["ttft_vs_stock"] <= max_ttft]
    faithful = [r for r in pays if r["agreement"] >= target]
    if faithful:
        best = min(faithful, key=lambda r: (r["ttft_vs_stock"], -r["agreement"]))
        why = (f"the fastest setting whose agreement {best['agreement']:.4f} reaches the target "
               f"{target:.4f}, at TTFT {best['ttft_vs_stock']:.3f}x stock")  # fmt: skip
    elif pays:
        best = max(pays, key=lambda r: (r["agreement"], -r["ttft_vs_stock"]))
        why = (f"no setting at TTFT <= {max_ttft:g}x stock reaches the target {target:.4f}: the "
               f"most faithful of them ({best['agreement']:.4f})")  # fmt: skip
    else:
        why = f"no reuse setting pays (TTFT <= {max_ttft:g}x stock): recompute fully"
        return {"settings": {"kmesh.recompute_ratio": 1.0}, "meets_target": False,
                "agreement": 1.0, "ttft_vs_stock": None, "target": target, "why": why}  # fmt: skip
    settings = {"kmesh.recompute_ratio": best["ratio"], "kmesh.sink_tokens": best["sink_tokens"],
                "kmesh.selection": "per_request",
                "kmesh.drift_correction": best.get("drift_correction", "off")}  # fmt: skip
    return {"settings": settings, "nominal": best["nominal"], "agreement": best["agreement"],
            "agreement_se": best["agreement_se"], "ttft_vs_stock": best["ttft_vs_stock"],
            "meets_target": bool(faithful), "target": target, "why": why}  # fmt: skip


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Two panels over the recomputed share: top-1 agreement (per_request and collective, the
    target as a dashed line) and TTFT / stock (per_request), one line per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["config"]["table"]
    fig, (ax_q, ax_t) = plt.subplots(1, 2, figsize=(10, 3.8))
    rules = (("deviation", "o"), ("sink", "s"), ("sink+deviation", "^"), ("deviation+drift", "D"))
    for rule, marker in rules:
        for selection, style in (("per_request", "-"), ("collective", ":")):
            pts = sorted(
                (r["recomputed"], r["agreement"], r["ttft_vs_stock"])
                for r in rows
                if r["selection"] == selection and r["rule"] in (rule, "none", "all")
            )
            if not any(r["selection"] == selection and r["rule"] == rule for r in rows):
                continue  # only the shared end points (plain reuse, full recompute)
            xs = [p[0] for p in pts]
            ax_q.plot(xs, [p[1] for p in pts], style, marker=marker, label=f"{rule} {selection}")
            if selection == "per_request":
                ax_t.plot(xs, [p[2] for p in pts], "-", marker=marker, label=rule)
    target = result["config"].get("recommended", {}).get("target")
    if target is not None:
        ax_q.axhline(target, color="gray", linestyle="--", linewidth=1)
    for ax, label in ((ax_q, "top-1 agreement with full prefill"),
                      (ax_t, "follow-up TTFT / stock vLLM")):  # fmt: skip
        ax.set_xscale("symlog", linthresh=0.05)
        ax.set_xlabel("recomputed share of reused tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
