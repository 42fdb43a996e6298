"""Several KMesh engines behind vLLM's router on this machine: ``redis-server`` as the shared
store, N vLLM OpenAI servers (each its own process, pinned to its own core, named ``engine-i`` by
its ``kv_transfer_config`` engine id, with the `FamilyHeader` middleware), and ``vllm-router``
(the ``vllm-router`` wheel) in front. Used by the routing tests, ``bench/routing.py`` and
``examples/routed_agents.py``.

Start-up on 2 cores: ≈1 min for two tiny-model engines started side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kmesh_blend.testing.engine import kv_transfer_config
from kmesh_blend.testing.services import free_port, start_redis, stop, wait_healthy, wait_port

__all__ = ["Fleet", "metric_sum"]

MIDDLEWARE = "kmesh_blend.vllm.family_header.FamilyHeader"


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus text page, over every label set that
    has ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Fleet:
    """``with Fleet(model, log_dir) as fleet: fleet.post("/v1/completions", body, headers)``.

    ``settings``: ``kmesh.*`` keys without the prefix for every engine (the store is the fleet's
    Redis unless given). ``policy``: the router's (``sticky_least_loaded``, ``consistent_hash``,
    ``round_robin``, ``cache_aware``, …). ``router_args``: more ``vllm-router`` flags.
    """

    model: str
    log_dir: Path
    engines: int = 2
    policy: str = "sticky_least_loaded"
    settings: dict[str, Any] = field(default_factory=dict)
    engine_args: tuple[str, ...] = ("--dtype", "float32")
    router_args: tuple[str, ...] = ("--cb-failure-threshold", "2")
    store: str = ""
    router: str = ""
    engine_urls: list[str] = field(default_factory=list)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __enter__(self) -> Fleet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        if "store" not in self.settings:
            port = free_port()
            self._procs["redis"] = start_redis(port)
            self.store = f"redis://127.0.0.1:{port}"
        settings = {"store": self.store, **self.settings}
        cores = os.cpu_count() or 1
        for i in range(self.engines):
            port = free_port()
            config = {**kv_transfer_config(**settings), "engine_id": f"engine-{i}"}
            cmd = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                "--enforce-eager", "--seed", "0", *self.engine_args,
                "--kv-transfer-config", json.dumps(config), "--middleware", MIDDLEWARE,
            ]  # fmt: skip
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}  # fmt: skip
            self._procs[f"engine-{i}"] = self._spawn(f"engine-{i}", cmd, env)
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        for i, url in enumerate(self.engine_urls):
            self._wait_healthy(f"engine-{i}", url)
        exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        port, prom = free_port(), free_port()
        cmd = [
            exe, "--host", "127.0.0.1", "--port", str(port), "--policy", self.policy,
            "--worker-urls", *self.engine_urls, "--prometheus-port", str(prom),
            "--prometheus-host", "127.0.0.1", *self.router_args,
        ]  # fmt: skip
        self._procs["router"] = self._spawn("router", cmd, dict(os.environ))
        wait_port(port, self._procs["router"], timeout=60)
        self.router = f"http://127.0.0.1:{port}"
        self.router_metrics_url = f"http://127.0.0.1:{prom}/metrics"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("ab")
        try:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            log.close()  # the child keeps its own descriptor

    def _wait_healthy(self, name: str, url: str) -> None:
        wait_healthy(url, self._procs[name], self.log_dir / f"{name}.log", name)

    def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
        *, retries: int = 0, url: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """POST ``body`` (JSON) to the router (or ``url``); its JSON answer. A 5xx answer or a
        refused connection is tried again up to ``retries`` times, 0.5 s apart (what a client of
        a router does while the router's breaker has not yet taken a dead engine out)."""
        data = json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        for attempt in range(retries + 1):
            req = urllib.request.Request(f"{url or self.router}{path}", data, hdrs)
            try:
                with urllib.request.urlopen(req, timeout=300) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:500]
                if exc.code < 500 or attempt == retries:
                    raise RuntimeError(f"POST {path}: {exc.code} {detail!r}") from None
            except OSError:
                if attempt == retries:
                    raise
            time.sleep(0.5)
        raise AssertionError("unreachable")

    def metrics(self, i: int) -> str:
        """Engine ``i``'s ``/metrics`` page."""
        with urllib.request.urlopen(f"{self.engine_urls[i]}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def router_metrics(self) -> str:
        with urllib.request.urlopen(self.router_metrics_url, timeout=30) as resp:
            return resp.read().decode()

    def kill(self, i: int) -> None:
        """SIGKILL engine ``i`` (a crash: no goodbye to the router)."""
        proc = self._procs[f"engine-{i}"]
        proc.kill()
        proc.wait(timeout=30)

    def close(self) -> None:
        for name in ("router", *[f"engine-{i}" for i in range(self.engines)], "redis"):
            proc = self._procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                stop(proc, grace_s=30)
