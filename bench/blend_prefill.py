"""One follow-up's prefill in our executor: full prefill vs blend at several recompute ratios.

Workload: the bench model (24 layers, Llama-style), a shared document of D tokens stored as a
master (prefilled alone at positions 0..D-1), and a follow-up = 64 private tokens + document +
32 question tokens. Full prefill and the blends run side by side in this process, on the same
reference executor, same threads. value = blend time at ratio 0.15 / full prefill time.

Run: python bench/blend_prefill.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, follow_up_family, interleaved, plot_bars

from kmesh_blend.blend import (
    BlendOptions,
    blend_one,
)
from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.testing import BENCH_LLAMA, build_checkpoint

RATIOS = (0.05, 0.15, 0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    doc_len = 512 if args.quick else 2048
    repeats = 1 if args.quick else 5

    model = ReferenceModel.load(build_checkpoint(BENCH_LLAMA), torch.float32)
    requests, source = follow_up_family(model, doc_len, 1)
    request = requests[0]
    ids = request.token_ids

    options = {ratio: BlendOptions(recompute_ratio=ratio, backend="torch") for ratio in RATIOS}
    fns = {"full": lambda: prefill(model, ids, last_only=True)}
    for ratio, opts in options.items():
        fns[str(ratio)] = lambda o=opts: blend_one(model, request, source, o)
    measured = interleaved(fns, repeats)
    full_s = measured["full"]
    times = {ratio: measured[str(ratio)] for ratio in RATIOS}
    print(f"full prefill of {ids.numel()} tokens: {full_s:.3f} s")
    full_logits = prefill(model, ids, last_only=True).logits
    deviations = {}
    for ratio, opts in options.items():
        res = blend_one(model, request, source, opts)
        deviations[ratio] = float((res.logits - full_logits).abs().max())
        print(
            f"blend ratio {ratio:.2f}: {times[ratio]:.3f} s = {times[ratio] / full_s:.3f}x of full "
            f"({res.num_recomputed}/{res.num_reused} reused tokens recomputed; "
            f"max |logit - full| {deviations[ratio]:.3f} on random weights)"
        )
    plot_bars(
        "blend_prefill",
        ["full"] + [f"blend {r}" for r in RATIOS],
        [full_s] + [times[r] for r in RATIOS],
        f"one follow-up, {ids.numel()} tokens, bench model (24 layers), 2 CPU threads",
    )
    emit(
        {
            "name": "blend_prefill",
            "metric": "blend(0.15) time / full prefill time",
            "value": round(times[0.15] / full_s, 4),
            "unit": "x",
            "goal": 0.25,
            "baseline": "full prefill in the same executor, same run",
            "quick": args.quick,
            "config": {
                "model": BENCH_LLAMA.name,
                "tokens": ids.numel(),
                "document": doc_len,
                "full_s": round(full_s, 4),
                "blend_s": {str(r): round(t, 4) for r, t in times.items()},
                "ratio_vs_full": {str(r): round(t / full_s, 4) for r, t in times.items()},
                "max_logit_deviation": {str(r): round(d, 4) for r, d in deviations.items()},
                "threads": torch.get_num_threads(),
            },
        }
    )


if __name__ == "__main__":
    main()
