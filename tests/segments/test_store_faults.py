"""Store faults never stall the caller (real LMCache server, real Redis, real disk store).

A hung server (SIGSTOP) costs one deadline, then every operation fails at once, naming the
store, until a background probe finds it answering again (SIGCONT). A store that is not there at
start is down from the start, the same way for ``lm://`` and ``redis://``, and is used once it
answers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kmesh_blend.segments.health import RETRY_S
from kmesh_blend.segments.store import LMCacheMasterStore, StoreUnavailable, open_store
from tests.segments.conftest import (
    _free_port,
    _stop,
    pause,
    start_lm_server,
    start_redis_server,
)
from tests.segments.test_master_store import LAYOUT, MiB, _master

TIMEOUT_S = 0.3
SLACK_S = 1.0  # scheduling noise on 2 busy cores; the old behaviour took 30 s or forever


def _start(kind: str, port: int) -> subprocess.Popen[bytes]:
    return start_lm_server(port) if kind == "lm" else start_redis_server(port)


@pytest.fixture(params=["lm", "redis"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """(store url, its own server process): each test may stop or kill it."""
    port = _free_port()
    proc = _start(request.param, port)
    try:
        yield f"{request.param}://127.0.0.1:{port}", proc
    finally:
        with_signal(proc, signal.SIGCONT)
        _stop(proc)


def with_signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.monotonic()
    try:
        out: object = fn()
    except StoreUnavailable as exc:
        out = exc
    return time.monotonic() - start, out


def _wait_up(store: LMCacheMasterStore, limit: float = 15.0) -> float:
    start = time.monotonic()
    while not store.health.up:
        assert time.monotonic() - start < limit, "the store never came back"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_hung_server_costs_one_deadline_then_fails_fast(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = served
    store = open_store(url, LAYOUT, cpu_bytes=64 * MiB, timeout_s=TIMEOUT_S)
    try:
        assert store.health.up
        sid, kv, pos = _master(1, 64)
        assert store.put(sid, kv, pos)
        pause(proc)
        spent, got = _timed(lambda: store.get(sid))
        assert isinstance(got, StoreUnavailable), got
        assert spent < TIMEOUT_S + SLACK_S
        assert str(got).startswith(f"kmesh.store {url} unavailable: ")
        spent, got = _timed(lambda: store.contains(sid))  # down: no socket touched
        assert isinstance(got, StoreUnavailable) and spent < 0.05
        spent, ok = _timed(lambda: store.put(*_master(2, 64)))
        assert ok is False and spent < 0.05 and url in store.last_error
        time.sleep(3 * RETRY_S)  # probes keep failing while it is stopped
        assert not store.health.up and store.health.num_down == 1
        os.kill(proc.pid, signal.SIGCONT)
        _wait_up(store)
        master = store.get(sid)
        assert master is not None and torch.equal(master.kv, kv)
        assert torch.equal(master.positions, pos)
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["lm", "redis"])
def test_a_store_down_at_start_is_used_once_it_answers(kind: str) -> None:
    port = _free_port()
    url = f"{kind}://127.0.0.1:{port}"
    spent, store = _timed(lambda: open_store(url, LAYOUT, cpu_bytes=64 * MiB, timeout_s=TIMEOUT_S))
    assert isinstance(store, LMCacheMasterStore) and spent < TIMEOUT_S + SLACK_S
    proc = None
    try:
        assert not store.health.up
        sid, kv, pos = _master(3, 32)
        with pytest.raises(StoreUnavailable, match=f"^kmesh.store {url} unavailable: "):
            store.contains(sid)
        assert store.put(sid, kv, pos) is False and url in store.last_error
        proc = _start(kind, port)
        _wait_up(store)
        assert store.put(sid, kv, pos)
        master = store.get(sid)
        assert master is not None and torch.equal(master.kv, kv)
    finally:
        store.close()
        if proc is not None:
            _stop(proc)


def test_a_killed_server_fails_fast_and_its_restart_is_found(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = served
    store = open_store(url, LAYOUT, cpu_bytes=64 * MiB, timeout_s=TIMEOUT_S)
    try:
        sid, kv, pos = _master(4, 32)
        assert store.put(sid, kv, pos)
        _stop(proc)
        spent, got = _timed(lambda: store.get(sid))
        assert isinstance(got, StoreUnavailable) and spent < TIMEOUT_S + SLACK_S
        port = int(url.rsplit(":", 1)[1])
        restarted = _start(url.split(":")[0], port)
        try:
            _wait_up(store)
            assert store.get(sid) is None  # restarted empty: absent, not an error
            assert store.put(sid, kv, pos) and store.get(sid) is not None
        finally:
            _stop(restarted)
    finally:
        store.close()


def test_a_removed_disk_directory_is_made_again(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = open_store(f"disk://{root}", LAYOUT, cpu_bytes=64 * MiB, timeout_s=TIMEOUT_S)
    try:
        sid, kv, pos = _master(5, 32)
        assert store.put(sid, kv, pos)
        shutil.rmtree(root)
        spent, got = _timed(lambda: store.get(sid))
        assert got is None and spent < TIMEOUT_S + SLACK_S  # its files are gone: absent
        spent, ok = _timed(lambda: store.put(sid, kv, pos))  # its next reader stores it again
        assert ok is True and spent < TIMEOUT_S + SLACK_S
        master = store.get(sid)
        assert master is not None and torch.equal(master.kv, kv)
    finally:
        store.close()
