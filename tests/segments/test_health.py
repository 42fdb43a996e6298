"""`Health` without a server: a caller checks once inline when the prober has fallen behind
(a loaded machine), at most once per probe interval and one caller at a time."""

from __future__ import annotations

import re
import threading
import time

import pytest

from kmesh_blend.segments.health import RETRY_S, Health, StoreUnavailable


class _Store:
    """A probe that fails until ``answers`` is set; counts its calls."""

    def __init__(self) -> None:
        self.answers = False
        self.calls = 0

    def probe(self) -> None:
        self.calls += 1
        if not self.answers:
            raise ConnectionError("refused")


@pytest.fixture
def starved(monkeypatch: pytest.MonkeyPatch) -> None:
    """The background prober never gets to run (as on a machine too busy to schedule it)."""
    monkeypatch.setattr(Health, "_probe_until_up", lambda self: None)


def test_a_caller_probes_inline_once_the_last_failure_is_older_than_an_interval(
    starved: None,
) -> None:
    store = _Store()
    health = Health("lm://127.0.0.1:1", 0.1, store.probe)
    health.failed("refused")
    store.answers = True
    with pytest.raises(StoreUnavailable, match=re.escape("kmesh.store lm://127.0.0.1:1 unavail")):
        health.check()  # the outage is fresh: fail fast, no socket touched
    assert store.calls == 0
    time.sleep(RETRY_S + 0.05)
    health.check()  # the prober is late: this caller checks, the store answers
    assert store.calls == 1 and health.up


def test_a_store_still_down_is_probed_inline_at_most_once_per_interval(starved: None) -> None:
    store = _Store()
    health = Health("redis://127.0.0.1:1", 0.1, store.probe)
    health.failed("refused")
    time.sleep(RETRY_S + 0.05)
    for _ in range(5):  # the first probes (and fails); the rest fail at once
        with pytest.raises(StoreUnavailable):
            health.check()
    assert store.calls == 1 and not health.up
    time.sleep(RETRY_S + 0.05)
    with pytest.raises(StoreUnavailable):
        health.check()
    assert store.calls == 2


def test_one_caller_probes_while_the_others_fail_fast(starved: None) -> None:
    release = threading.Event()
    calls: list[float] = []

    def slow_probe() -> None:
        calls.append(time.monotonic())
        release.wait(5)
        raise ConnectionError("hung")

    health = Health("lm://127.0.0.1:1", 0.1, slow_probe)
    health.failed("hung")
    time.sleep(RETRY_S + 0.05)
    outcomes: list[bool] = []

    def first_caller() -> None:
        try:
            health.check()
        except StoreUnavailable:
            outcomes.append(False)

    first = threading.Thread(target=first_caller)
    first.start()
    deadline = time.monotonic() + 5
    while not calls:  # the first caller's inline probe has started
        assert time.monotonic() < deadline, "no caller probed inline"
        time.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable):
        health.check()  # another caller's inline probe is in flight: fail at once
    assert time.monotonic() - start < 0.1 and len(calls) == 1
    release.set()
    first.join(5)
    assert outcomes == [False]  # the probing caller was refused too: the probe failed


def test_the_background_prober_still_brings_the_store_back() -> None:
    store = _Store()
    health = Health("lm://127.0.0.1:1", 0.1, store.probe)
    try:
        health.failed("refused")
        store.answers = True
        deadline = time.monotonic() + 10 * RETRY_S
        while not health.up:  # `up` never probes: only the thread can have done it
            assert time.monotonic() < deadline, "the prober never marked the store up"
            time.sleep(0.02)
        assert health.num_down == 1 and store.calls >= 1
    finally:
        health.close()
