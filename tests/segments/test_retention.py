"""Retention pool: byte budget, pins, in-use protection, LRU order; fuzzed invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kmesh_blend.segments.metrics import SegmentMetrics
from kmesh_blend.segments.retention import RetentionPool


def test_lru_eviction_within_budget() -> None:
    evicted: list[tuple[str, int]] = []
    pool: RetentionPool[str, str] = RetentionPool(100, on_evict=lambda k, n: evicted.append((k, n)))
    assert pool.put("a", "A", 40) and pool.put("b", "B", 40)
    assert pool.get("a") == "A"  # a is now most recent
    assert pool.put("c", "C", 40)
    assert evicted == [("b", 40)] and pool.keys() == ["a", "c"]
    assert pool.retained_bytes == 80
    assert pool.get("b") is None
    s = pool.stats()
    assert s["hits"] == 1 and s["misses"] == 1 and s["evictions"] == 1


def test_pinned_and_in_use_objects_are_never_evicted() -> None:
    pool: RetentionPool[str, str] = RetentionPool(100)
    pool.put("fam-doc", "D", 60, owner="family:42")
    pool.put("busy", "B", 30)
    assert pool.acquire("busy") == "B"
    assert not pool.put("x", "X", 20)  # would need to drop a held object: rejected
    assert pool.stats()["rejected"] == 1 and set(pool.keys()) == {"fam-doc", "busy"}
    pool.release("busy")
    assert pool.put("x", "X", 20)  # busy is free now
    assert "busy" not in pool
    assert pool.release_owner("family:42") == 1
    assert pool.put("y", "Y", 70)
    assert "fam-doc" not in pool and pool.retained_bytes <= 100
    with pytest.raises(ValueError):
        pool.release("y")


def test_existing_key_is_kept_and_pinned() -> None:
    pool: RetentionPool[str, str] = RetentionPool(10)
    assert pool.put("k", "first", 5)
    assert pool.put("k", "second", 5, owner="o")
    assert pool.get("k") == "first" and pool.is_held("k") and pool.retained_bytes == 5
    assert not pool.put("huge", "H", 11)


def test_metrics_plain_dict_and_prometheus_agree() -> None:
    from prometheus_client import generate_latest

    m1, m2 = SegmentMetrics(), SegmentMetrics()  # private registries: no collision
    m1.read("redis", 2)
    m1.hit()
    m1.miss()
    m1.join(3)
    m1.eviction()
    m1.fallback("bad_annotation")
    m1.set_retained_bytes(1234)
    d = m1.as_dict()
    assert d["reads"]["redis"] == 2 and d["reads"]["cpu"] == 0
    assert (d["hits"], d["misses"], d["singleflight_joins"], d["evictions"]) == (1, 1, 3, 1)
    assert d["fallbacks"] == {"bad_annotation": 1} and d["retained_bytes"] == 1234
    text = generate_latest(m1.registry).decode()
    assert 'kmesh_segments_reads_total{tier="redis"} 2.0' in text
    assert "kmesh_segments_retained_bytes 1234.0" in text
    assert m2.as_dict()["hits"] == 0


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: RetentionPool[int, int] = RetentionPool(1000, on_evict=self._evicted)
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.pins: dict[int, set[str]] = {}

    def _evicted(self, key: int, nbytes: int) -> None:
        assert self.refs.get(key, 0) == 0, "an in-use object was evicted"
        assert not self.pins.get(key), "a pinned object was evicted"
        del self.sizes[key]
        self.pins.pop(key, None)
        self.refs.pop(key, None)

    @rule(k=st.integers(0, 12), n=st.integers(0, 600), owner=st.sampled_from([None, "a", "b"]))
    def put(self, k: int, n: int, owner: str | None) -> None:
        present = k in self.sizes
        if self.pool.put(k, k, n, owner=owner):
            self.sizes.setdefault(k, n)
            if owner:
                self.pins.setdefault(k, set()).add(owner)
        else:
            assert not present

    @rule(k=st.integers(0, 12))
    def acquire(self, k: int) -> None:
        if self.pool.acquire(k) is not None:
            self.refs[k] = self.refs.get(k, 0) + 1

    @rule(k=st.integers(0, 12))
    def release(self, k: int) -> None:
        if self.refs.get(k, 0) > 0:
            self.pool.release(k)
            self.refs[k] -= 1

    @rule(owner=st.sampled_from(["a", "b"]))
    def release_owner(self, owner: str) -> None:
        self.pool.release_owner(owner)
        for pins in self.pins.values():
            pins.discard(owner)

    @invariant()
    def retained_bytes_is_sum_of_live_objects(self) -> None:
        assert set(self.pool.keys()) == set(self.sizes)
        assert self.pool.retained_bytes == sum(self.sizes.values())
        assert self.pool.retained_bytes <= self.pool.budget_bytes
        assert all(r >= 0 for r in self.refs.values())


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
