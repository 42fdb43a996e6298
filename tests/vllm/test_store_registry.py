"""What the scheduler believes is stored follows what the store holds (real vLLM, real stores).

A master the store no longer gives back (evicted under its budget, lost with a restarted `lm://`
server) fails its load once, naming why; that request is recomputed by vLLM and stores the
document again, so the next follow-up reuses it. Reports say why reuse was skipped, briefly.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import make_llm
from tests.segments.conftest import _free_port, _stop, _wait_port
from tests.vllm.family import DOC_LEN, kv_transfer_config, prompts

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]

Out = tuple[list[int], dict[str, Any]]


def _generate(llm: Any, ids: list[int], kmesh: dict[str, Any] | None, **params: Any) -> Out:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kmesh": kmesh}} if kmesh is not None else None
    sp = SamplingParams(temperature=0.0, max_tokens=6, extra_args=extra, **params)
    (o,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    return list(o.outputs[0].token_ids), (o.kv_transfer_params or {}).get("kmesh", {})


def _engine(fn: Callable[[Any], Any], **kmesh: Any) -> Any:
    extra = {"kv_transfer_config": kv_transfer_config(**kmesh)} if kmesh else {}
    llm = make_llm(build_checkpoint(TINY_LLAMA), enable_prefix_caching=False, **extra)
    try:
        return fn(llm)
    finally:
        del llm
        gc.collect()


def _stock(items: list[list[int]]) -> list[list[int]]:
    return _engine(lambda llm: [_generate(llm, ids, None)[0] for ids in items])


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


def _lm_server(port: int) -> subprocess.Popen[bytes]:
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


def test_a_master_lost_with_its_lm_server_is_stored_again_by_the_next_reader() -> None:
    """Reuse, `lm://` server killed and restarted empty, then three more follow-ups (in a fresh
    process: tests/vllm/lm_restart_proc.py)."""
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.lm_restart_proc"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    reports = [r for _, r in got]
    assert reports[1]["reused_tokens"] == DOC_LEN
    assert reports[2]["reused_tokens"] == 0 and "load error" in reports[2]["fallback"]
    assert len(reports[2]["fallback"]) <= 200
    # The failed follow-up was recomputed and stored the document again: reuse resumes.
    assert [r["reused_tokens"] for r in reports[3:]] == [DOC_LEN, DOC_LEN]
    assert all(r["fallback"] is None for r in reports[3:])
    assert got[2][0] == _stock([prompts(seed=5)[2][0]])[0]  # the failed one: stock's tokens


def test_a_master_evicted_under_the_store_budget_is_stored_again() -> None:
    """The cpu store holds one master (retention off): reading a second document evicts the
    first; its next follow-up misses once, and the one after reuses again."""
    a, b = prompts(seed=6), prompts(seed=7)
    order = [(a, 0), (a, 1), (b, 0), (b, 1), (a, 2), (a, 3)]

    def run(llm: Any) -> list[Out]:
        return [_generate(llm, fam[i][0], {"segments": fam[i][1]}) for fam, i in order]

    master = 4 * 2 * DOC_LEN * TINY_LLAMA.num_kv_heads * TINY_LLAMA.head_dim * 4
    got = _engine(run, store="cpu", retention_bytes=0, store_cpu_bytes=int(master * 1.5))
    reused = [r["reused_tokens"] for _, r in got]
    assert reused[1] == DOC_LEN and reused[3] == DOC_LEN  # each document reused while stored
    assert reused[4] == 0 and "miss" in got[4][1]["fallback"]
    assert reused[5] == DOC_LEN and got[5][1]["fallback"] is None


def test_reports_say_why_briefly() -> None:
    family = prompts(seed=8)

    def run(llm: Any) -> list[Out]:
        first = _generate(llm, family[0][0], {"segments": family[0][1]})
        logprobs = _generate(llm, family[1][0], {"segments": family[1][1]}, prompt_logprobs=0)
        huge = _generate(llm, family[2][0], {"segments": "x" * 1_000_000})
        after = _generate(llm, family[3][0], {"segments": family[3][1]})
        return [first, logprobs, huge, after]

    got = _engine(run, store="cpu")
    assert "prompt_logprobs" in got[1][1]["fallback"] and got[1][1]["reused_tokens"] == 0
    assert len(got[2][1]["fallback"]) <= 200 and "segments" in got[2][1]["fallback"]
    assert got[3][1]["reused_tokens"] == DOC_LEN  # the engine is unharmed


def test_an_lm_server_down_at_start_is_used_once_it_answers() -> None:
    family = prompts(seed=9)
    port = _free_port()
    server: list[subprocess.Popen[bytes]] = []

    def run(llm: Any) -> list[Out]:
        out = [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2)]
        server.append(_lm_server(port))
        out += [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2, 4)]
        return out

    try:
        got = _engine(run, store=f"lm://127.0.0.1:{port}", retention_bytes=0)
    finally:
        for proc in server:
            _stop(proc)
    reused = [r["reused_tokens"] for _, r in got]
    assert reused[:2] == [0, 0]  # nothing could be stored: served on the stock path
    assert reused[2:] == [0, DOC_LEN]  # the first after it answered stores, the next reuses


def test_a_store_too_small_for_one_master_says_so() -> None:
    family = prompts(seed=10)
    master = 4 * 2 * DOC_LEN * TINY_LLAMA.num_kv_heads * TINY_LLAMA.head_dim * 4

    def run(llm: Any) -> list[Out]:
        return [_generate(llm, ids, {"segments": spans}) for ids, spans in family[:3]]

    got = _engine(run, store="cpu", retention_bytes=0, store_cpu_bytes=master // 2)
    first, *later = [r for _, r in got]
    assert first["fallback"] is None and first["reused_tokens"] == 0  # its reader: nothing to say
    for report in later:
        assert report["reused_tokens"] == 0
        assert "not stored" in report["fallback"] and "no room" in report["fallback"]
        assert len(report["fallback"]) <= 200
