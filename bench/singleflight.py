"""Backing-tier reads for N concurrent followers, with/without singleflight and retention, and
follower waiting time with/without application notice — all in one run.

Workload: one shared master (the document) in a real LMCache store (default: ``LocalDiskBackend``
in a temporary directory; ``--store lm://HOST:PORT`` or ``redis://HOST:PORT`` for a server). For
each N in 1, 4, 8: a first wave of N concurrent lookups of the cold segment, then a second wave of
N (later follow-ups). Configurations: neither singleflight nor retention (every lookup reads),
singleflight only, retention only, both. Then a family of N follow-ups arrives after the document:
without notice the first follow-up's read is on their critical path; with notice the application
prepared the family first (its time reported apart) and the follow-ups find the master in RAM.

Headline: reads(neither) / reads(both) at N = 8 (goal: >= 8, i.e. one read serves every follower).
The last printed line is the JSON result (bench/run_all.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import SegmentId, make_namespace, segment_id
from kmesh_blend.segments.master import MasterLayout
from kmesh_blend.segments.notice import Notice
from kmesh_blend.segments.store import open_store

NS_SIZES = (1, 4, 8)


def concurrent_fetch(cache: SegmentCache, sid: SegmentId, n: int, family: str) -> list[float]:
    """N threads look ``sid`` up at once; returns each one's wait in seconds."""
    waits = [0.0] * n
    barrier = threading.Barrier(n)

    def body(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        result = cache.fetch(sid, family=family)
        waits[i] = time.perf_counter() - t0
        if result.master is None:
            raise RuntimeError(f"follower {i} got no master ({result.source})")

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return waits


def reads_of(cache: SegmentCache) -> int:
    return int(sum(cache.metrics.as_dict()["reads"].values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small master, same code path")
    parser.add_argument("--store", default=None, help="kmesh.store URL (default: temp disk)")
    args = parser.parse_args()
    tokens = 256 if args.quick else 2048
    layout = MasterLayout(num_layers=24, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    ns = make_namespace("bench", "bfloat16", num_layers=24, num_kv_heads=2, head_dim=64)
    tmp = tempfile.TemporaryDirectory()
    url = args.store or f"disk://{tmp.name}/kv"
    master_bytes = layout.bytes_per_token() * tokens
    store = open_store(url, layout, cpu_bytes=max(64 << 20, 8 * master_bytes))
    kv = torch.randn(24, 2, tokens, 2, 64).to(torch.bfloat16)
    pos = torch.arange(tokens, dtype=torch.int64)

    configs = {
        "neither": dict(singleflight=False, retain=False),
        "singleflight": dict(singleflight=True, retain=False),
        "retention": dict(singleflight=False, retain=True),
        "both": dict(singleflight=True, retain=True),
    }
    reads: dict[str, dict[int, int]] = {name: {} for name in configs}
    run = 0
    for n in NS_SIZES:
        for name, flags in configs.items():
            run += 1
            sid = segment_id(ns, [run] * 8)  # a fresh cold segment per measurement
            assert store.put(sid, kv, pos)
            cache = SegmentCache(store, retention_bytes=4 * master_bytes, **flags)  # type: ignore[arg-type]
            concurrent_fetch(cache, sid, n, family="f")  # first wave
            concurrent_fetch(cache, sid, n, family="f")  # later follow-ups
            reads[name][n] = reads_of(cache)
    print(f"master: {tokens} tokens, {master_bytes / 2**20:.1f} MiB, store {store.tier}")
    print("backing reads for 2 waves of N followers (lower is better)")
    print(f"{'N':>3} " + " ".join(f"{name:>13}" for name in configs) + "   neither/both")
    for n in NS_SIZES:
        row = " ".join(f"{reads[name][n]:>13}" for name in configs)
        print(f"{n:>3} {row}   {reads['neither'][n] / reads['both'][n]:>10.1f}x")

    # application notice: follower waiting time
    n = NS_SIZES[-1]
    repeats = 3 if args.quick else 10
    wait_plain: list[float] = []
    wait_notice: list[float] = []
    prep: list[float] = []
    for r in range(repeats):
        for with_notice in (False, True):
            run += 1
            sid = segment_id(ns, [run] * 8)
            assert store.put(sid, kv, pos)
            cache = SegmentCache(store, retention_bytes=4 * master_bytes)
            if with_notice:
                report = Notice(cache).prepare(f"fam-{r}", [sid])
                prep.append(report.seconds)
            waits = concurrent_fetch(cache, sid, n, family=f"fam-{r}")
            (wait_notice if with_notice else wait_plain).append(statistics.mean(waits))
    plain_ms = 1e3 * statistics.median(wait_plain)
    notice_ms = 1e3 * statistics.median(wait_notice)
    prep_ms = 1e3 * statistics.median(prep)
    print(
        f"mean follower wait, N={n}: without notice {plain_ms:.3f} ms, with notice "
        f"{notice_ms:.3f} ms ({plain_ms / max(notice_ms, 1e-6):.1f}x); "
        f"preparation (reported apart) {prep_ms:.3f} ms"
    )
    store.close()
    tmp.cleanup()

    value = reads["neither"][8] / reads["both"][8]
    print("value = backing reads (no singleflight, no retention) / (singleflight + retention), N=8")
    result = {
        "name": "singleflight",
        "metric": "backing_reads(neither) / backing_reads(singleflight+retention), N=8",
        "value": round(value, 3),
        "unit": "x",
        "goal": 8.0,
        "baseline": "every follower reads the backing tier",
        "quick": bool(args.quick),
        "config": {
            "store": url.split("://")[0] if "://" in url else url,
            "tokens": tokens,
            "master_bytes": master_bytes,
            "reads": {name: {str(k): v for k, v in d.items()} for name, d in reads.items()},
            "follower_wait_ms": {"without_notice": plain_ms, "with_notice": notice_ms},
            "notice_wait_ratio": plain_ms / max(notice_ms, 1e-6),
            "prepare_ms": prep_ms,
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
