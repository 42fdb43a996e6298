"""Round-aware segment index: unit tests and a hypothesis state machine over its operations."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.index import SegmentIndex, SegmentState


def sid(i: int) -> SegmentId:
    return SegmentId(f"{i:064x}")


def test_all_gather_rounds_retire_old_outputs() -> None:
    index = SegmentIndex(keep_rounds=2)
    # round 0: three agents publish their outputs; round 1 reads them.
    index.publish_round(0, [(sid(i), 10, 0, 100) for i in range(3)], family="team")
    assert index.advance_round() == []  # round 1: still alive
    assert [info is not None for info in index.lookup([sid(0), sid(1), sid(9)])] == [
        True,
        True,
        False,
    ]
    index.publish_round(1, [(sid(i), 10, 0, 100) for i in range(3, 6)], family="team")
    retired = index.advance_round()  # round 2: round-0 outputs go
    assert sorted(r.segment_id for r in retired) == [sid(0), sid(1), sid(2)]
    assert all(r.state is SegmentState.EVICTED for r in retired)
    assert len(index) == 3 and index.total_bytes == 300


def test_pins_and_refcounts_defer_retirement() -> None:
    index = SegmentIndex(keep_rounds=1)
    index.publish(sid(1), 4, round=0)
    index.publish(sid(2), 4, round=0)
    index.pin(sid(1), "fam")
    index.acquire(sid(2))
    assert index.advance_round() == []
    assert [r.segment_id for r in index.release(sid(2))] == [sid(2)]
    assert [r.segment_id for r in index.close_family("fam")] == [sid(1)]
    assert len(index) == 0
    with pytest.raises(KeyError):
        index.acquire(sid(1))


def test_release_without_acquire_and_bad_transitions() -> None:
    index = SegmentIndex()
    index.publish(sid(1), 4, position_offset=7)
    with pytest.raises(ValueError, match="release without acquire"):
        index.release(sid(1))
    with pytest.raises(ValueError, match="not allowed"):
        index.set_state(sid(1), SegmentState.EVICTED)
    index.set_state(sid(1), SegmentState.LOADING)
    with pytest.raises(ValueError, match="COLD or READY"):
        index.publish(sid(2), 1, state=SegmentState.LOADING)
    assert index.set_state(sid(1), SegmentState.READY).state is SegmentState.READY
    info = index.get(sid(1))
    assert info is not None and info.position_offset == 7 and info.num_tokens == 4


def test_republish_extends_lifetime_and_adds_family() -> None:
    index = SegmentIndex(keep_rounds=1)
    index.publish(sid(1), 4, round=0, family="a")
    index.publish(sid(1), 4, round=2, family="b")
    assert index.advance_round(to=2) == []
    info = index.get(sid(1))
    assert info is not None and info.round == 2 and info.families == {"a", "b"}
    with pytest.raises(ValueError, match="forward"):
        index.advance_round(to=1)
    assert index.evict(sid(1)) is not None and sid(1) not in index


def test_rounds_count_per_scope() -> None:
    index = SegmentIndex(keep_rounds=2)
    index.publish(sid(1), 4, round=3, scope="x")
    index.publish(sid(2), 4, round=3)
    assert index.advance_round(to=60, scope="y") == []  # another tenant's clock
    assert index.round_of("y") == 60 and index.round_of("x") == 0 == index.current_round
    gone = index.advance_round(to=5, scope="x")
    assert [i.segment_id for i in gone] == [sid(1)] and gone[0].scope == "x"
    assert sid(2) in index


def test_clocks_of_empty_scopes_are_bounded() -> None:
    index = SegmentIndex(keep_rounds=2, max_entries=4)
    index.publish(sid(1), 4, round=7, scope="kept")
    index.advance_round(to=8, scope="kept")
    for i in range(10):
        index.advance_round(to=3, scope=f"t{i}")
    assert len(index._rounds) <= 5 and index.round_of("kept") == 8
    assert index.round_of("t9") == 3  # the newest stays


def test_a_round_published_late_is_expired_at_once_unless_held() -> None:
    index = SegmentIndex(keep_rounds=2)
    index.advance_round(to=10)
    index.publish(sid(1), 4, round=0)
    index.publish(sid(2), 4, round=0, family="f")
    index.pin(sid(2), "f")
    index.publish(sid(3), 4, round=9)
    assert sid(1) in index  # publishing retires nothing by itself
    assert [i.segment_id for i in index.retire_expired()] == [sid(1)]
    assert sid(2) in index and sid(3) in index
    assert [i.segment_id for i in index.close_family("f")] == [sid(2)]


def test_unrounded_segments_live_until_evicted() -> None:
    index = SegmentIndex(keep_rounds=1)
    index.publish(sid(1), 4)
    index.advance_round(to=100)
    assert sid(1) in index
    index.acquire(sid(1))
    assert index.evict(sid(1)) is None  # in use
    index.release(sid(1))
    assert index.evict(sid(1)) is not None


class IndexMachine(RuleBasedStateMachine):
    """Random publish / pin / acquire / advance / close sequences against the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.index = SegmentIndex(keep_rounds=2)
        self.refs: dict[SegmentId, int] = {}
        self.nbytes: dict[SegmentId, int] = {}
        self.retired: set[SegmentId] = set()

    def _absorb(self, retired: list, *, explicit: bool = False) -> None:  # type: ignore[type-arg]
        for info in retired:
            assert info.state is SegmentState.EVICTED
            assert info.refcount == 0, "an in-use entry was retired"
            assert not (info.pins & self.index.open_families), "a pinned entry was retired"
            assert explicit or self.index.is_expired(info), "retired before its rounds ended"
            self.refs.pop(info.segment_id, None)
            self.nbytes.pop(info.segment_id, None)

    @rule(i=st.integers(0, 15), nbytes=st.integers(0, 1000), rounded=st.booleans())
    def publish(self, i: int, nbytes: int, rounded: bool) -> None:
        r = self.index.current_round if rounded else None
        info = self.index.publish(sid(i), 3, round=r, nbytes=nbytes, family="f")
        self.nbytes.setdefault(sid(i), info.nbytes)
        self.refs.setdefault(sid(i), 0)

    @rule(i=st.integers(0, 15))
    def acquire(self, i: int) -> None:
        if sid(i) in self.index:
            self.index.acquire(sid(i))
            self.refs[sid(i)] += 1

    @rule(i=st.integers(0, 15))
    def release(self, i: int) -> None:
        if self.refs.get(sid(i), 0) > 0:
            self.refs[sid(i)] -= 1
            self._absorb(self.index.release(sid(i)))
        elif sid(i) in self.index:
            with pytest.raises(ValueError):
                self.index.release(sid(i))

    @rule(i=st.integers(0, 15), fam=st.sampled_from(["a", "b"]))
    def pin(self, i: int, fam: str) -> None:
        if sid(i) in self.index:
            self.index.pin(sid(i), fam)

    @rule(fam=st.sampled_from(["a", "b"]))
    def close(self, fam: str) -> None:
        self._absorb(self.index.close_family(fam))

    @rule(steps=st.integers(1, 3))
    def advance(self, steps: int) -> None:
        self._absorb(self.index.advance_round(self.index.current_round + steps))

    @rule(i=st.integers(0, 15))
    def evict(self, i: int) -> None:
        info = self.index.get(sid(i))
        gone = self.index.evict(sid(i))
        if gone is not None:
            assert info is not None and info.refcount == 0
            assert not (info.pins & self.index.open_families)
            self._absorb([gone], explicit=True)

    @invariant()
    def refcounts_match_and_never_negative(self) -> None:
        for info in self.index.entries():
            assert info.refcount >= 0
            assert info.refcount == self.refs[info.segment_id]

    @invariant()
    def bytes_are_the_sum_of_live_entries(self) -> None:
        live = {info.segment_id for info in self.index.entries()}
        assert live == set(self.nbytes)
        assert self.index.total_bytes == sum(self.nbytes.values())

    @invariant()
    def nothing_expired_stays_unless_held(self) -> None:
        for info in self.index.entries():
            if self.index.is_expired(info):
                assert info.refcount > 0 or info.pins & self.index.open_families


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_index_forgets_its_oldest_unheld_entries_beyond_its_cap() -> None:
    index = SegmentIndex(keep_rounds=2, max_entries=3)
    for i in range(3):
        index.publish(f"s{i}", 4)
    index.pin("s0", "fam")  # held: never forgotten while its family is open
    index.publish("s3", 4)
    index.publish("s4", 4)
    assert len(index) == 3 and "s0" in index and {"s1", "s2"}.isdisjoint(set(_ids(index)))


def _ids(index: SegmentIndex) -> list[str]:
    return [info.segment_id for info in index.entries()]
