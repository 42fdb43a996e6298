"""What the scheduler believes is stored follows what the store holds (real vLLM, real stores).

A master the store no longer gives back (evicted under its budget, lost with a restarted `lm://`
server) fails its load once, naming why; that request is recomputed by vLLM and stores the
document again, so the next follow-up reuses it. Reports say why reuse was skipped, briefly.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kmesh_blend.segments.health import RETRY_S
from kmesh_blend.segments.master import MasterMeta
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import live_worker, make_llm
from tests.segments.conftest import _free_port, _stop, pause, start_lm_server
from tests.vllm.family import DOC_LEN, kv_transfer_config, prompts

pytestmark = pytest.mark.vllm

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


def _wait_stores_up(llm: Any, limit: float = 60.0) -> None:
    """Until both sides' stores of the in-process engine say they answer (their probes run
    every `RETRY_S` seconds; a loaded machine may need a few)."""
    stores = [live_worker().store]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    lookup = scheduler.segments.contains
    if lookup is not None:
        stores.append(lookup.__self__)
    deadline = time.monotonic() + limit
    while not all(store.health.up for store in stores):
        assert time.monotonic() < deadline, "a store never answered again"
        time.sleep(RETRY_S / 10)


def _stock(items: list[list[int]]) -> list[list[int]]:
    return _engine(lambda llm: [_generate(llm, ids, None)[0] for ids in items])


def test_a_master_lost_with_its_lm_server_is_stored_again_by_the_next_reader() -> None:
    """Reuse; the `lm://` server killed and restarted empty on the same port; three more
    follow-ups: the first misses once (and stores the document again), the next two reuse."""
    family = prompts(seed=5)
    port = _free_port()
    server = [start_lm_server(port)]

    def run(llm: Any) -> list[Out]:
        out = [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2)]
        _stop(server[0])  # every master is gone with it
        server[0] = start_lm_server(port)
        return out + [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2, 5)]

    try:
        got = _engine(run, store=f"lm://127.0.0.1:{port}", retention_bytes=0)
    finally:
        _stop(server[0])
    reports = [r for _, r in got]
    assert reports[1]["reused_tokens"] == DOC_LEN
    assert reports[2]["reused_tokens"] == 0 and "load error" in reports[2]["fallback"]
    assert len(reports[2]["fallback"]) <= 200
    # The failed follow-up was recomputed and stored the document again: reuse resumes.
    assert [r["reused_tokens"] for r in reports[3:]] == [DOC_LEN, DOC_LEN]
    assert all(r["fallback"] is None for r in reports[3:])
    assert got[2][0] == _stock([family[2][0]])[0]  # the failed one: stock's tokens


def test_after_an_lm_restart_the_first_follow_up_stores_again_though_the_prober_lags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store is marked down by a follow-up during the outage; the server comes back empty
    while the background prober never runs (a machine too loaded to schedule it). The first
    follow-up after that probes once itself, finds the store answering and stores the document
    again; the second reuses it."""
    from kmesh_blend.segments.health import Health

    monkeypatch.setattr(Health, "_probe_until_up", lambda self: None)  # the starved prober
    family = prompts(seed=9)
    port = _free_port()
    server = [start_lm_server(port)]

    def run(llm: Any) -> list[Out]:
        out = [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2)]
        _stop(server[0])
        out.append(_generate(llm, family[2][0], {"segments": family[2][1]}))  # marks it down
        server[0] = start_lm_server(port)  # back, empty
        time.sleep(RETRY_S + 0.1)  # the last failure is older than one probe interval
        return out + [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in (3, 4)]

    try:
        got = _engine(run, store=f"lm://127.0.0.1:{port}", retention_bytes=0, store_timeout_s=0.3)
    finally:
        _stop(server[0])
    reports = [r for _, r in got]
    assert reports[1]["reused_tokens"] == DOC_LEN
    assert reports[2]["reused_tokens"] == 0 and "unavailable" in reports[2]["fallback"]
    assert reports[3]["reused_tokens"] == 0  # the store answered again, without the master
    assert reports[4]["reused_tokens"] == DOC_LEN and reports[4]["fallback"] is None
    assert [g[0] for g in got[2:4]] == _stock([family[2][0], family[3][0]])


def test_a_hung_lm_server_costs_its_requests_their_reuse_not_the_engine() -> None:
    """SIGSTOP on the `lm://` server: the follow-ups that need it fall back within the deadline,
    naming the store; unannotated traffic is served as before; after SIGCONT reuse resumes."""
    family, other = prompts(seed=11), prompts(seed=12)[0][0]
    port = _free_port()
    server = start_lm_server(port)
    url = f"lm://127.0.0.1:{port}"
    waits: list[float] = []

    def run(llm: Any) -> list[Out]:
        out = [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2)]
        pause(server)
        for ids, spans in [family[2], (other, None), family[3]]:
            start = time.monotonic()
            out.append(_generate(llm, ids, {"segments": spans} if spans else None))
            waits.append(time.monotonic() - start)
        os.kill(server.pid, signal.SIGCONT)
        _wait_stores_up(llm)  # the background probes find it answering
        return [*out, _generate(llm, family[4][0], {"segments": family[4][1]})]

    try:
        got = _engine(run, store=url, retention_bytes=0, store_timeout_s=0.3)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        _stop(server)
    reports = [r for _, r in got]
    assert reports[1]["reused_tokens"] == DOC_LEN
    for report in (reports[2], reports[4]):
        assert report["reused_tokens"] == 0
        assert report["fallback"].startswith(f"load error: kmesh.store {url} unavailable: ")
    assert reports[3] == {}  # unannotated: no report, served as stock serves it
    assert max(waits) < 5.0, waits  # one 0.3 s deadline at most (it was 30 s before)
    assert reports[5]["reused_tokens"] == DOC_LEN and reports[5]["fallback"] is None
    assert [g[0] for g in got[2:5]] == _stock([family[2][0], other, family[3][0]])


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
        server.append(start_lm_server(port))
        _wait_stores_up(llm)  # the background probes find it answering
        out += [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2, 4)]
        return out

    try:
        got = _engine(run, store=f"lm://127.0.0.1:{port}", retention_bytes=0)
    finally:
        for proc in server:
            _stop(proc)
    reused = [r["reused_tokens"] for _, r in got]
    assert reused[:2] == [0, 0]  # nothing could be stored: served on the stock path
    for _, report in got[:2]:  # each says which store and why
        assert report["fallback"].startswith(f"kmesh.store lm://127.0.0.1:{port} unavailable: ")
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


@pytest.mark.parametrize("fault", ["flip", "truncate", "positions", "delete", "rmdir", "swap"])
def test_a_damaged_master_on_disk_is_refused_and_stored_again(fault: str, tmp_path: Path) -> None:
    """The disk store's files of document A are damaged after A and B were read: a bit flipped,
    the KV file cut short, its positions altered, its files deleted, the whole directory
    removed, or B's files copied over A's. A's next follow-up is served on the stock path naming
    why, and stores A again; the one after reuses it."""
    a, b = prompts(seed=13), prompts(seed=14)
    root = tmp_path / "kv"
    files: list[set[Path]] = []

    def run(llm: Any) -> list[Out]:
        out = [_generate(llm, a[0][0], {"segments": a[0][1]})]
        files.append(set(root.iterdir()))
        out.append(_generate(llm, b[0][0], {"segments": b[0][1]}))
        _damage(fault, files[0], set(root.iterdir()) - files[0])
        return out + [_generate(llm, a[i][0], {"segments": a[i][1]}) for i in (1, 2)]

    got = _engine(run, store=f"disk://{root}", retention_bytes=0)
    reports = [r for _, r in got]
    assert [r["reused_tokens"] for r in reports] == [0, 0, 0, DOC_LEN]
    why = reports[2]["fallback"]
    if fault in ("delete", "rmdir"):
        assert why.startswith("load error: segment ") and why.endswith(" miss")
    else:
        assert "failed its integrity check" in why, why
    assert reports[3]["fallback"] is None
    assert got[2][0] == _stock([a[1][0]])[0]  # the refused one: stock's tokens


def _damage(fault: str, doc_a: set[Path], doc_b: set[Path]) -> None:
    kv_a = next(p for p in doc_a if not p.name.startswith("kmesh-meta@"))
    if fault == "flip":
        data = bytearray(kv_a.read_bytes())
        data[len(data) // 2] ^= 0x10
        kv_a.write_bytes(bytes(data))
    elif fault == "truncate":
        kv_a.write_bytes(kv_a.read_bytes()[: kv_a.stat().st_size // 2])
    elif fault == "positions":  # consistent bytes, positions moved by 7: the seal breaks
        meta_a = next(p for p in doc_a if p.name.startswith("kmesh-meta@"))
        raw = meta_a.read_bytes()
        meta = MasterMeta.decode(raw)
        moved = dataclasses.replace(meta, positions=tuple(p + 7 for p in meta.positions)).encode()
        meta_a.write_bytes(moved + raw[len(moved) :])
    elif fault == "delete":
        for path in doc_a:
            path.unlink()
    elif fault == "rmdir":
        shutil.rmtree(next(iter(doc_a)).parent)
    else:  # B's consistent master under A's names
        for path in doc_a:
            kind = "kmesh-meta@" if path.name.startswith("kmesh-meta@") else "kmesh@"
            source = next(p for p in doc_b if p.name.startswith(kind))
            path.write_bytes(source.read_bytes())


def test_redis_killed_and_restarted_under_a_serving_engine() -> None:
    """Redis killed after a document was stored: its follow-ups fall back naming the store
    (fast), unannotated traffic is served; Redis restarted empty: the next follow-up stores the
    document again and the one after reuses it."""
    from tests.segments.test_store_faults import _start

    family, other = prompts(seed=15), prompts(seed=16)[0][0]
    port = _free_port()
    url = f"redis://127.0.0.1:{port}"
    server = [_start("redis", port)]

    def run(llm: Any) -> list[Out]:
        out = [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2)]
        _stop(server[0])
        out += [
            _generate(llm, family[2][0], {"segments": family[2][1]}),
            _generate(llm, other, None),
        ]
        server[0] = _start("redis", port)
        _wait_stores_up(llm)  # the background probes find it answering
        return out + [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in (3, 4)]

    try:
        got = _engine(run, store=url, retention_bytes=0, store_timeout_s=0.3)
    finally:
        _stop(server[0])
    reports = [r for _, r in got]
    assert [r.get("reused_tokens") for r in reports] == [0, DOC_LEN, 0, None, 0, DOC_LEN]
    assert reports[2]["fallback"].startswith(f"load error: kmesh.store {url} unavailable: ")
    assert reports[4]["fallback"].startswith("load error: segment ")  # restarted empty: a miss
    assert reports[5]["fallback"] is None
    assert [g[0] for g in got[2:4]] == _stock([family[2][0], other])
