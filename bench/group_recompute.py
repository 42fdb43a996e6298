"""A group of N sibling follow-ups: one at a time vs layer-synchronous (per_request, collective).

Workload: the bench model (24 layers), one shared document of D tokens stored as a master, and
N = 8 follow-ups = 64 private tokens (different per sibling) + document + 32 question tokens.
The segment source copies every layer it serves out of host RAM, as a host-RAM store tier does,
so a schedule that reads a shared layer once for the group saves that copy. All three schedules
run side by side in this process at recompute ratio 0.15.

value = sequential per_request time / layer_sync collective time (goal ≥ 2.6); the config also
holds sequential / layer_sync per_request (goal ≥ 1.2), the reads each schedule made, and the
deviation of collective from per_request logits (random weights: a mechanics check, not quality).

Run: python bench/group_recompute.py [--quick]
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
    DenseSegmentSource,
    blend_group,
)
from kmesh_blend.models import ReferenceModel
from kmesh_blend.testing import BENCH_LLAMA, build_checkpoint


class HostCopySource(DenseSegmentSource):
    """Serves each layer as a fresh copy, like a read from a host-RAM tier."""

    def layer_kv(self, segment_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().layer_kv(segment_id, layer)
        return k.clone(), v.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    doc_len = 512 if args.quick else 2048
    repeats = 1 if args.quick else 5

    model = ReferenceModel.load(build_checkpoint(BENCH_LLAMA), torch.float32)
    requests, source = follow_up_family(model, doc_len, args.group, source_cls=HostCopySource)

    configs = {
        "sequential per_request": BlendOptions(schedule="sequential", backend="torch"),
        "layer_sync per_request": BlendOptions(schedule="layer_sync", backend="torch"),
        "layer_sync collective": BlendOptions(
            schedule="layer_sync", selection="collective", backend="torch"
        ),
    }
    times = interleaved(
        {
            label: lambda o=opts: blend_group(model, requests, source, o)
            for label, opts in configs.items()
        },
        repeats,
    )
    reads, results = {}, {}
    for label, opts in configs.items():
        source.reads.clear()
        results[label] = blend_group(model, requests, source, opts)
        reads[label] = sum(source.reads.values())
        print(f"{label:24s} {times[label]:.3f} s  reads {reads[label]}")
    base = times["sequential per_request"]
    per_request_speedup = base / times["layer_sync per_request"]
    collective_speedup = base / times["layer_sync collective"]
    per_req, coll = results["layer_sync per_request"], results["layer_sync collective"]
    deviation = max(
        float((a.logits - b.logits).abs().max()) for a, b in zip(per_req, coll, strict=True)
    )
    agree = sum(
        int(a.logits.argmax() == b.logits.argmax()) for a, b in zip(per_req, coll, strict=True)
    )
    print(
        f"layer_sync per_request: {per_request_speedup:.2f}x; collective: {collective_speedup:.2f}x"
    )
    print(
        f"collective vs per_request: max |logit diff| {deviation:.3f}, "
        f"top-1 agree {agree}/{len(coll)}"
    )
    plot_bars(
        "group_recompute",
        list(times),
        list(times.values()),
        f"group of {args.group}, {requests[0].token_ids.numel()} tokens each, ratio 0.15",
    )
    emit(
        {
            "name": "group_recompute",
            "metric": "sequential per_request time / layer_sync collective time",
            "value": round(collective_speedup, 3),
            "unit": "x",
            "goal": 2.6,
            "baseline": "the same group one request at a time (sequential, per_request), same run",
            "quick": args.quick,
            "config": {
                "model": BENCH_LLAMA.name,
                "group": args.group,
                "tokens_each": requests[0].token_ids.numel(),
                "seconds": {k: round(v, 4) for k, v in times.items()},
                "reads": reads,
                "per_request_speedup": round(per_request_speedup, 3),
                "per_request_goal": 1.2,
                "collective_vs_per_request_max_logit_diff": round(deviation, 4),
                "collective_vs_per_request_top1_agree": f"{agree}/{len(coll)}",
                "threads": torch.get_num_threads(),
            },
        }
    )


if __name__ == "__main__":
    main()
