"""Fixtures that start real storage services on 127.0.0.1 for the store integration tests.

The LMCache ``lm://`` server and ``redis-server`` are started once per session on free ports and
stopped at the end. Without ``redis-server`` on PATH the Redis tests fail when ``CI=true`` (CI
must run them; ``scripts/services.sh`` installs it) and are skipped otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kmesh_blend.testing.services import free_port, start_redis, stop, wait_port

_free_port, _wait_port, _stop = free_port, wait_port, stop  # the names the tests import


def pause(proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP ``proc`` and return once it is stopped: a signal is delivered asynchronously, and
    on a busy machine the process may still answer a request sent right after `os.kill`."""
    os.kill(proc.pid, signal.SIGSTOP)
    stat = Path(f"/proc/{proc.pid}/stat")
    deadline = time.monotonic() + 30
    while stat.read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {proc.pid} did not stop")
        time.sleep(0.01)


# Starts LMCache's server with SO_REUSEADDR on its listening socket, so a server restarted on
# the same port binds at once instead of waiting out the killed one's TIME_WAIT connections.
_REUSABLE_SERVER = """
import runpy, socket, sys
bind = socket.socket.bind
def reusable_bind(self, address):
    self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return bind(self, address)
socket.socket.bind = reusable_bind
sys.argv = ["lmcache.v1.server", *sys.argv[1:]]
runpy.run_module("lmcache.v1.server", run_name="__main__")
"""


def start_lm_server(port: int) -> subprocess.Popen[bytes]:
    """A fresh LMCache server process on ``port`` (nothing stored), once it says it listens:
    an answer on the port alone could come from another process."""
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "INFO"}
    fd, name = tempfile.mkstemp(prefix="lm-server-", suffix=".log")
    cmd = [sys.executable, "-c", _REUSABLE_SERVER, "127.0.0.1", str(port), "cpu"]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, env=env)
    os.close(fd)  # the child keeps its own descriptor
    deadline = time.monotonic() + 60
    while b"Server started at" not in Path(name).read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"LMCache server on {port} did not start: {name}")
        time.sleep(0.1)
    _wait_port(port, proc)
    return proc


@pytest.fixture(scope="session")
def lm_server() -> Iterator[str]:
    """``lm://127.0.0.1:PORT`` of a fresh LMCache server process (``lmcache.v1.server``)."""
    port = _free_port()
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,  # never read: a full pipe would stall the server
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        _wait_port(port, proc)
        yield f"lm://127.0.0.1:{port}"
    finally:
        _stop(proc)


def start_redis_server(port: int) -> subprocess.Popen[bytes]:
    """A fresh, non-persistent ``redis-server`` on ``port``, once it listens. Without the binary:
    a failure when ``CI=true`` (CI must run these tests), a skip otherwise."""
    try:
        return start_redis(port)
    except FileNotFoundError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """``redis://127.0.0.1:PORT`` of a fresh, non-persistent ``redis-server``."""
    port = _free_port()
    proc = start_redis_server(port)
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        _stop(proc)
