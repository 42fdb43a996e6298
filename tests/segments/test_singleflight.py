"""Singleflight under real threads: one backing read for 8 concurrent lookups, leader failure."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from kmesh_blend.segments.singleflight import (
    Outcome,
    SingleFlight,
    SingleFlightError,
    SingleFlightTimeout,
)
from tests.threads import run_together

N = 8


def _run_threads(target: Callable[[int], object]) -> list[object]:
    """N threads behind a barrier; each one's result or exception."""
    return run_together(target, N, timeout=10)


class SlowRead:
    """A backing read that takes a while (so every thread arrives while it runs)."""

    def __init__(self, fail_first: int = 0, delay: float = 0.2) -> None:
        self.calls = 0
        self.fail_first = fail_first
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self) -> bytearray:
        with self.lock:
            self.calls += 1
            n = self.calls
        time.sleep(self.delay)
        if n <= self.fail_first:
            raise OSError(f"read {n} failed")
        return bytearray(b"kv-bytes-of-the-segment")


def test_eight_threads_one_backing_read() -> None:
    sf: SingleFlight[str, bytearray] = SingleFlight(timeout_s=5)
    read = SlowRead()
    results = _run_threads(lambda i: sf.do("seg", read))
    assert read.calls == 1
    assert all(isinstance(r, Outcome) for r in results)
    outcomes = [r for r in results if isinstance(r, Outcome)]
    assert sum(o.leader for o in outcomes) == 1
    assert all(o.value is outcomes[0].value for o in outcomes)  # the leader's very copy
    stats = sf.stats()
    assert stats["leads"] == 1 and stats["joins"] == N - 1
    assert not sf.in_flight("seg")


def test_without_singleflight_every_thread_reads() -> None:
    read = SlowRead(delay=0.01)
    _run_threads(lambda i: read())
    assert read.calls == N  # the baseline the bench compares against


def test_leader_failure_one_follower_takes_over() -> None:
    sf: SingleFlight[str, bytearray] = SingleFlight(timeout_s=5, max_attempts=2)
    read = SlowRead(fail_first=1)
    results = _run_threads(lambda i: sf.do("seg", read))
    errors = [r for r in results if isinstance(r, BaseException)]
    outcomes = [r for r in results if isinstance(r, Outcome)]
    assert len(errors) == 1 and isinstance(errors[0], OSError)  # the failed leader's own error
    assert len(outcomes) == N - 1 and read.calls == 2
    assert {o.attempt for o in outcomes} == {2}
    assert sum(o.leader for o in outcomes) == 1
    assert sf.stats()["takeovers"] == 1


def test_all_attempts_fail_clean_fallback() -> None:
    sf: SingleFlight[str, bytearray] = SingleFlight(timeout_s=5, max_attempts=2)
    read = SlowRead(fail_first=100)
    results = _run_threads(lambda i: sf.do("seg", read))
    assert read.calls == 2
    assert all(isinstance(r, OSError | SingleFlightError) for r in results)
    gave_up = [r for r in results if isinstance(r, SingleFlightError)]
    assert len(gave_up) == N - 2 and all(isinstance(e.__cause__, OSError) for e in gave_up)
    assert not sf.in_flight("seg")
    # the key is usable again afterwards
    assert sf.do("seg", lambda: bytearray(b"ok")).value == b"ok"


def test_hung_leader_followers_time_out() -> None:
    sf: SingleFlight[str, int] = SingleFlight(timeout_s=0.2)
    release = threading.Event()

    def hang() -> int:
        release.wait(5)
        return 1

    leader = threading.Thread(target=lambda: sf.do("k", hang))
    leader.start()
    while not sf.in_flight("k"):
        time.sleep(0.001)
    t0 = time.monotonic()
    with pytest.raises(SingleFlightTimeout):
        sf.do("k", lambda: 2)
    assert time.monotonic() - t0 < 2
    release.set()
    leader.join(5)
    assert sf.stats()["timeouts"] == 1


def test_different_keys_do_not_share() -> None:
    sf: SingleFlight[int, int] = SingleFlight()
    results = _run_threads(lambda i: sf.do(i % 2, lambda: i).value)
    assert sf.stats()["leads"] >= 2 and set(results) <= set(range(N))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SingleFlight(timeout_s=0)
    with pytest.raises(ValueError):
        SingleFlight(max_attempts=0)
