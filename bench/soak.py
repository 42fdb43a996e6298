"""Soak: 2,000 requests in random families through real vLLM; registries and memory level off.

Families arrive and interleave at random (8 open at a time): each has its own document (96–288
tokens), one reader and three follow-ups with their own private text before the document and a
question after it; every 4 families start a new round (``kmesh.round_lifetime`` 2); the last
follow-up closes its family. Every 250 requests it prints the scheduler's registries, the
worker's index and retention, the store's contents and the process's resident memory.

Result: resident memory at the end over resident memory halfway (goal ≤ 1.05×: it levels off),
with every registry size at both points in ``config``.

Run: ``.venv/bin/python bench/soak.py [--requests 2000] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import make_llm

FOLLOW_UPS, OPEN_FAMILIES, FAMILIES_PER_ROUND = 3, 8, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="500 requests")
    args = parser.parse_args()
    total = 500 if args.quick else args.requests
    from vllm import SamplingParams

    llm = make_llm(
        build_checkpoint(TINY_LLAMA),
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "kmesh.store": "cpu",
                "kmesh.round_lifetime": 2,
                "kmesh.retention_bytes": 64 << 20,
                "kmesh.store_cpu_bytes": 256 << 20,
            },
        },
    )
    rng = random.Random(0)
    families: list[dict[str, Any]] = []
    started, reused, rows = 0, 0, []
    t0 = time.perf_counter()
    for n in range(1, total + 1):
        while len(families) < OPEN_FAMILIES:
            doc = [rng.randrange(3, 2048) for _ in range(rng.randrange(96, 289))]
            families.append({"id": f"f{started}", "round": started // FAMILIES_PER_ROUND,
                             "doc": doc, "next": 0})  # fmt: skip
            started += 1
        fam = rng.choice(families)
        private = [rng.randrange(3, 2048) for _ in range(rng.randrange(8, 64))]
        question = [rng.randrange(3, 2048) for _ in range(rng.randrange(4, 16))]
        last = fam["next"] == FOLLOW_UPS
        kmesh = {
            "segments": [[len(private), len(private) + len(fam["doc"])]],
            "family": fam["id"], "round": fam["round"], "close": last,
        }  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=4,
                                extra_args={"kv_transfer_params": {"kmesh": kmesh}})  # fmt: skip
        (out,) = llm.generate([{"prompt_token_ids": private + fam["doc"] + question}], params,
                              use_tqdm=False)  # fmt: skip
        reused += bool(out.kv_transfer_params["kmesh"]["reused_tokens"])
        fam["next"] += 1
        if last:
            families.remove(fam)
        if n % 250 == 0 or n == total:
            row = {"requests": n, "families_started": started, "reused_requests": reused,
                   **_sizes(llm), "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
            rows.append(row)
            print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    half = min(rows, key=lambda r: abs(r["requests"] - total / 2))
    end = rows[-1]
    emit({
        "name": "soak",
        "metric": f"resident memory after {total} requests / after {half['requests']}",
        "value": round(end["rss_mib"] / half["rss_mib"], 3),
        "unit": "x",
        "goal": 1.05,
        "baseline": "the same engine halfway through the run",
        "quick": args.quick,
        "config": {"model": "tiny-llama fp32", "store": "cpu", "round_lifetime": 2,
                   "open_families": OPEN_FAMILIES, "follow_ups": FOLLOW_UPS,
                   "halfway": half, "end": end, "rows": rows},
    })  # fmt: skip


def _sizes(llm: Any) -> dict[str, int]:
    """Registry sizes of both sides of the connector, and this process's resident memory."""
    from kmesh_blend.testing.engine import live_worker

    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    worker = live_worker()
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "published": len(side.segments.published),
        "plans": len(side.plans),
        "retired_known": len(side.segments.retired),
        "turns": len(side.turns.records),
        "pending_keeps": side.turns.num_pending,
        "index": len(worker.cache.index),
        "retained_mib": round(worker.cache.retention.retained_bytes / 2**20, 1),
        "rss_mib": rss_kib // 1024,
    }


if __name__ == "__main__":
    main()
