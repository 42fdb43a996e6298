"""Local service processes for tests, examples and benchmarks: free ports, waiting for a port or
a vLLM server's health, stopping a process, and a throwaway ``redis-server`` (from the Debian
package that ``scripts/services.sh`` installs)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

__all__ = ["free_port", "start_redis", "stop", "wait_healthy", "wait_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Return once something accepts on 127.0.0.1:``port``; raise if ``proc`` exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"service exited with {proc.returncode}:\n{out[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout} s")


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], log: Path, name: str, timeout_s: float = 600.0
) -> None:
    """Return once ``url``/health answers; raise with the tail of ``log`` if ``proc`` (the
    server ``name``) exits first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited at start ({log}):\n{tail}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s ({log})") from None
            time.sleep(1)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; waits for the exit."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def start_redis(port: int) -> subprocess.Popen[bytes]:
    """A fresh, non-persistent ``redis-server`` on 127.0.0.1:``port``, once it listens; raises
    `FileNotFoundError` when the binary is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (run scripts/services.sh)")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,  # never read: a full pipe would stall the server
        stderr=subprocess.DEVNULL,
    )
    wait_port(port, proc)
    return proc
