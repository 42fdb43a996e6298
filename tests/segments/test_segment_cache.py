"""SegmentCache end to end on a real LMCache store: singleflight, retention, rounds, notice."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import SegmentId, make_namespace, segment_id
from kmesh_blend.segments.index import SegmentIndex, SegmentState
from kmesh_blend.segments.master import Master, MasterLayout
from kmesh_blend.segments.notice import Notice
from kmesh_blend.segments.store import LMCacheMasterStore, open_store

LAYOUT = MasterLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
NS = make_namespace("tiny", "float32", num_layers=2, num_kv_heads=2, head_dim=32)
N = 8


class CountingStore:
    """Wraps a real store: counts backing reads, adds latency, can fail the first reads."""

    def __init__(self, inner: LMCacheMasterStore, delay: float = 0.1, fail_first: int = 0) -> None:
        self.inner, self.delay, self.fail_first = inner, delay, fail_first
        self.tier, self.layout = inner.tier, inner.layout
        self.reads = 0
        self._lock = threading.Lock()

    def put(self, sid: SegmentId, kv: torch.Tensor, pos: torch.Tensor) -> bool:
        return self.inner.put(sid, kv, pos)

    def get(self, sid: SegmentId) -> Master | None:
        with self._lock:
            self.reads += 1
            n = self.reads
        time.sleep(self.delay)
        if n <= self.fail_first:
            raise ConnectionError(f"injected failure of read {n}")
        return self.inner.get(sid)

    def delete(self, sid: SegmentId) -> bool:
        return self.inner.delete(sid)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def backing() -> Iterator[LMCacheMasterStore]:
    store = open_store("cpu", LAYOUT, cpu_bytes=32 << 20)
    yield store
    store.close()


def _seed(store: LMCacheMasterStore, i: int, tokens: int = 16) -> tuple[SegmentId, torch.Tensor]:
    sid = segment_id(NS, [i] * tokens)
    kv = torch.randn(2, 2, tokens, 2, 32, generator=torch.Generator().manual_seed(i))
    assert store.put(sid, kv, torch.arange(tokens, dtype=torch.int64))
    return sid, kv


def _eight_threads(cache: SegmentCache, sid: SegmentId) -> list[object]:
    results: list[object] = [None] * N
    barrier = threading.Barrier(N)

    def body(i: int) -> None:
        barrier.wait()
        results[i] = cache.fetch(sid, family="fam")

    threads = [threading.Thread(target=body, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "deadlock"
    return results


def test_eight_concurrent_cold_lookups_one_backing_read(backing: LMCacheMasterStore) -> None:
    sid, kv = _seed(backing, 1)
    store = CountingStore(backing)
    cache = SegmentCache(store)
    results = _eight_threads(cache, sid)
    assert store.reads == 1
    masters = [r.master for r in results]  # type: ignore[attr-defined]
    assert all(m is masters[0] for m in masters) and torch.equal(masters[0].kv, kv)
    assert sorted(r.source for r in results) == ["joined"] * (N - 1) + ["read"]  # type: ignore[attr-defined]
    stats = cache.metrics.as_dict()
    assert stats["reads"]["cpu"] == 1 and stats["singleflight_joins"] == N - 1
    # retained: a later lookup reads nothing
    assert cache.fetch(sid).source == "retained" and store.reads == 1


def test_without_singleflight_or_retention_every_lookup_reads(backing: LMCacheMasterStore) -> None:
    sid, _ = _seed(backing, 2)
    store = CountingStore(backing, delay=0.05)
    cache = SegmentCache(store, singleflight=False, retain=False)
    _eight_threads(cache, sid)
    assert store.reads == N


def test_leader_failure_takeover_no_deadlock(backing: LMCacheMasterStore) -> None:
    sid, kv = _seed(backing, 3)
    store = CountingStore(backing, fail_first=1)
    cache = SegmentCache(store)
    results = _eight_threads(cache, sid)
    ok = [r for r in results if r.master is not None]  # type: ignore[attr-defined]
    fell_back = [r for r in results if r.source == "fallback"]  # type: ignore[attr-defined]
    assert len(ok) + len(fell_back) == N and len(fell_back) == 1  # only the failed leader
    assert all(torch.equal(r.master.kv, kv) for r in ok)  # type: ignore[attr-defined]
    assert store.reads == 2


def test_every_attempt_fails_clean_fallback(backing: LMCacheMasterStore) -> None:
    sid, _ = _seed(backing, 4)
    cache = SegmentCache(CountingStore(backing, fail_first=100))
    results = _eight_threads(cache, sid)
    assert all(r.master is None and r.source == "fallback" for r in results)  # type: ignore[attr-defined]
    assert cache.metrics.as_dict()["fallbacks"]["load_error"] == N


def test_miss_is_not_a_fallback(backing: LMCacheMasterStore) -> None:
    cache = SegmentCache(backing)
    result = cache.fetch(segment_id(NS, [99]))
    assert result.master is None and result.source == "miss" and result.reads == 1
    assert cache.metrics.as_dict()["misses"] == 1


def test_rounds_retire_masters_and_retention(backing: LMCacheMasterStore) -> None:
    cache = SegmentCache(backing, index=SegmentIndex(keep_rounds=1))
    kv = torch.randn(2, 2, 4, 2, 32)
    sid = segment_id(NS, [5, 6, 7, 8])
    assert cache.publish(sid, kv, torch.arange(10, 14), round=0, family="team")
    info = cache.index.get(sid)
    assert info is not None and info.state is SegmentState.READY and info.position_offset == 10
    assert cache.fetch(sid).source == "retained"
    retired = cache.advance_round()
    assert [r.segment_id for r in retired] == [sid]
    assert sid not in cache.retention and backing.get(sid) is None
    assert cache.metrics.as_dict()["retained_bytes"] == 0


def test_budget_eviction_counts_and_marks_cold(backing: LMCacheMasterStore) -> None:
    sid_a, _ = _seed(backing, 6)
    sid_b, _ = _seed(backing, 7)
    one = 2 * 2 * 16 * 2 * 32 * 4 + 16 * 8
    cache = SegmentCache(backing, retention_bytes=one)
    cache.index.publish(sid_a, 16)
    assert cache.fetch(sid_a).source == "read"
    assert cache.index.get(sid_a).state is SegmentState.READY  # type: ignore[union-attr]
    assert cache.fetch(sid_b).source == "read"  # evicts a (unpinned)
    assert cache.index.get(sid_a).state is SegmentState.COLD  # type: ignore[union-attr]
    assert cache.metrics.as_dict()["evictions"] == 1
    # a family pin protects b: c cannot be retained, but is still served
    cache.retention.pin(sid_b, "fam")
    sid_c, _ = _seed(backing, 8)
    res = cache.fetch(sid_c)
    assert res.master is not None and sid_c not in cache.retention and sid_b in cache.retention


def test_notice_prepares_before_follow_ups(backing: LMCacheMasterStore) -> None:
    sids = [_seed(backing, i)[0] for i in (10, 11, 12)]
    store = CountingStore(backing, delay=0.05)
    cache = SegmentCache(store)
    notice = Notice(cache)
    report = notice.prepare("doc-42", sids)
    assert report.num_ready == 3 and report.reads == 3 and report.seconds >= 0.15
    t0 = time.perf_counter()
    follow = cache.fetch_many(sids, family="doc-42")
    waited = time.perf_counter() - t0
    assert [r.source for r in follow] == ["retained"] * 3 and store.reads == 3
    assert waited < report.seconds  # follow-ups wait for nothing; the prep is reported apart
    assert cache.metrics.as_dict()["prepare_seconds"] == pytest.approx(report.seconds)
    notice.close()


def test_bench_quick_prints_json() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/singleflight.py", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["name"] == "singleflight" and result["quick"] is True
    assert result["value"] >= 1.0
