"""Reuse quality on a trained model: blended vs full prefill, per recompute ratio and selection.

Model: the committed quality model (`kmesh_blend.testing.quality`: a small Llama trained on the
Python standard library, fp32 here). Tasks (`kmesh_blend.quality`): a shared segment of 384
tokens from a held-out stdlib file, read by a group of 4 requests, each = its own private
prefix (64–128 tokens of another file) + the segment + a cue of 8 segment tokens quoted again;
the true continuation is the 16 segment tokens after the cue. The segment's master is the
segment prefilled alone at positions 0..S-1.

Every request is scored on its continuation (teacher-forced over its prompt's KV) after a full
prefill and after a blend at each ratio (0, 0.05, 0.15, 0.3, 1.0), with per_request and
collective selection (groups of 4, layer_sync, the paper's gradual filtering over check layers
1, 2, 3 unless --check-layers says otherwise; ``--check-layers 1`` is the released code's
single check). Per setting: top-1 agreement with full prefill, mean KL(full ‖ blended), perplexity
of the true continuation.

value = top-1 agreement at ratio 0.15, per_request (goal ≥ 0.99). Asserted: per_request at ratio
1.0 is bit-identical to full prefill (agreement 1, KL 0, every score row equal).

``--model smollm2``: the same question on the real SmolLM2-135M-Instruct through a vLLM engine,
with multi-document chat prompts, the selection rules side by side and follow-up TTFT
(`bench/_quality_smollm2.py`; result ``quality_smollm2``, the README's headline quality).

Run: python bench/quality.py [--quick] [--check-layers 1] [--model toy|smollm2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, emit

from kmesh_blend.models import ReferenceModel
from kmesh_blend.quality import QualityReport, evaluate, format_table, standard_tasks
from kmesh_blend.testing.quality import quality_model_dir

SMOLLM2_CHECKS = (1, 2, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=["toy", "smollm2"], default="toy")
    parser.add_argument("--tasks", type=int, default=None, help="tasks (default per model)")
    parser.add_argument(
        "--check-layers",
        default=None,
        help="check layers (default 1,2,3 = the paper's gradual filtering on the toy model; "
        f"{','.join(map(str, SMOLLM2_CHECKS))} on smollm2); 1 = the released code",
    )
    args = parser.parse_args()
    if args.model == "smollm2":
        checks = SMOLLM2_CHECKS if args.check_layers is None else _layers(args.check_layers)
        real_model(args.quick, args.tasks or (2 if args.quick else 8), checks)
        return
    check_layers = _layers(args.check_layers or "1,2,3")
    num_tasks = args.tasks or (2 if args.quick else 24)
    torch.set_num_threads(2)

    start = time.perf_counter()
    model = ReferenceModel.load(quality_model_dir(), torch.float32)
    tasks = standard_tasks(num_tasks)
    report = evaluate(model, tasks, check_layers=check_layers)
    seconds = time.perf_counter() - start
    print(format_table(report))
    print(f"({seconds:.1f} s)")

    exact = report.result(1.0, "per_request")
    if not (exact.identical == 1.0 and exact.agreement == 1.0 and exact.kl == 0.0):
        raise SystemExit(f"ratio 1.0 is not bit-identical to full prefill: {exact}")
    plot(report, RESULTS / "quality.png")
    headline = report.result(0.15, "per_request")
    emit(
        {
            "name": "quality",
            "metric": "top-1 agreement with full prefill at ratio 0.15",
            "value": round(headline.agreement, 4),
            "unit": "fraction",
            "goal": 0.99,
            "baseline": "full prefill",
            "quick": args.quick,
            "config": {
                "model": "kmesh_blend/testing/quality_model (fp32)",
                "check_layers": list(check_layers),
                "tasks": report.num_tasks,
                "requests": report.num_requests,
                "positions": report.num_positions,
                "segment_tokens": tasks[0].segment.numel(),
                "group": len(tasks[0].requests),
                "full_perplexity": round(report.full_perplexity, 4),
                "table": [
                    {
                        "selection": r.setting.selection,
                        "ratio": r.setting.ratio,
                        "recomputed": round(r.recomputed, 4),
                        "agreement": round(r.agreement, 4),
                        "kl": float(f"{r.kl:.4g}"),
                        "perplexity": round(r.perplexity, 4),
                        "bit_identical": round(r.identical, 4),
                    }
                    for r in report.results
                ],
                "seconds": round(seconds, 1),
                "threads": torch.get_num_threads(),
            },
        }
    )


def _layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def real_model(quick: bool, num_tasks: int, check_layers: tuple[int, ...]) -> None:
    """`--model smollm2` (see `_quality_smollm2`)."""
    import _quality_smollm2 as real

    result = real.run(quick, num_tasks, check_layers)
    real.plot(result, RESULTS / "quality_smollm2.png")
    emit(result)


def plot(report: QualityReport, path: Path) -> None:
    """Two panels over the ratios: top-1 agreement and mean KL, one bar per selection mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted({r.setting.ratio for r in report.results})
    selections = list(dict.fromkeys(r.setting.selection for r in report.results))
    fig, (ax_agree, ax_kl) = plt.subplots(1, 2, figsize=(9, 3.5))
    width = 0.8 / len(selections)
    for j, selection in enumerate(selections):
        rows = [report.result(x, selection) for x in ratios]
        xs = [i + (j - (len(selections) - 1) / 2) * width for i in range(len(ratios))]
        ax_agree.bar(xs, [r.agreement for r in rows], width, label=selection)
        ax_kl.bar(xs, [r.kl for r in rows], width, label=selection)
    ax_agree.axhline(0.99, color="gray", linestyle="--", linewidth=1, label="goal 0.99")
    ax_agree.set_ylim(min(0.8, min(r.agreement for r in report.results) - 0.02), 1.005)
    ax_agree.set_ylabel("top-1 agreement with full prefill")
    ax_kl.set_yscale("symlog", linthresh=1e-4)
    ax_kl.set_ylabel("mean KL(full ‖ blended), nats")
    for ax in (ax_agree, ax_kl):
        ax.set_xticks(range(len(ratios)), [f"{x:g}" for x in ratios])
        ax.set_xlabel("recompute ratio")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"blend vs full prefill, trained model: {report.num_positions} continuation positions",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
