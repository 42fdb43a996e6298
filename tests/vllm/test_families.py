"""Families and rounds act in the served path (real vLLM, real Redis store).

A segment published in round r is deleted from the store once the engine reaches round
r + ``round_lifetime``, unless an open family pins it; a request annotated ``"close": true``
closes its family after it is served, and what only that family held is deleted. A follow-up of
a retired document says so, is served on the stock path and stores the document again.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.family import DOC_LEN, prompts
from tests.vllm.test_store_registry import Out, _engine, _generate

pytestmark = pytest.mark.vllm


def test_rounds_retire_masters_and_families_hold_them_until_closed(redis_server: str) -> None:
    import redis

    a, b = prompts(seed=21), prompts(seed=22)
    host, port = redis_server.removeprefix("redis://").split(":")
    client = redis.Redis(host=host, port=int(port))
    before = set(client.keys("kmesh-meta@*metadata"))  # other tests share this server
    seen: list[set[Any]] = []  # the masters' metadata keys in Redis at each checkpoint

    def stored() -> None:
        seen.append(set(client.keys("kmesh-meta@*metadata")) - before)

    def ask(llm: Any, fam: Any, i: int, **fields: Any) -> Out:
        return _generate(llm, fam[i][0], {"segments": fam[i][1], **fields})

    def run(llm: Any) -> list[Out]:
        out = [ask(llm, a, 0, round=0)]  # A: round 0, no family
        stored()
        out.append(ask(llm, a, 1, round=0))
        out.append(ask(llm, b, 0, round=0, family="fb"))  # B: round 0, held by family fb
        stored()
        out.append(ask(llm, b, 1, round=1, family="fb"))  # round 1: A retired, B held
        stored()
        out.append(ask(llm, a, 2, round=1))  # A's follow-up: retired, stores it again
        out.append(ask(llm, a, 3, round=1))  # reuses the new copy
        out.append(ask(llm, b, 2, round=1, family="fb", close=True))  # fb done after it
        out.append(_generate(llm, a[4][0], None))  # a step after the close: B retired
        stored()
        return out

    try:
        got = _engine(run, store=redis_server, round_lifetime=1)
    finally:
        client.close()
    reports = [r for _, r in got]
    reused = [r.get("reused_tokens") for r in reports]
    assert reused[:7] == [0, DOC_LEN, 0, DOC_LEN, 0, DOC_LEN, DOC_LEN]
    (key_a,) = seen[0]
    (key_b,) = seen[1] - {key_a}
    assert seen[2] == {key_b}  # round 1 retired A (round 0, no family), fb held B
    assert seen[3] == {key_a}  # A stored again in round 1; closing fb retired B
    assert reports[4]["fallback"].startswith("master retired: segment ")
    assert "round 0" in reports[4]["fallback"]
    assert got[4][0] == _engine(lambda llm: _generate(llm, a[2][0], None)[0])  # stock's tokens


def test_a_prepared_family_reads_nothing_in_its_follow_ups(redis_server: str) -> None:
    """Another engine stored the document; this engine's follow-ups read it from Redis unless a
    request of their family sent ahead (the notice) read it first (then they read nothing)."""
    doc = prompts(seed=23)

    def ask(llm: Any, i: int, **fields: Any) -> Out:
        return _generate(llm, doc[i][0], {"segments": doc[i][1], **fields})

    _engine(lambda llm: ask(llm, 0), store=redis_server)  # the reader, in its own engine
    unprepared = _engine(lambda llm: [ask(llm, i, family="f1") for i in (1, 2)],
                         store=redis_server)  # fmt: skip
    prepared = _engine(
        lambda llm: [ask(llm, 3, family="f2")] + [ask(llm, i, family="f2") for i in (1, 2)],
        store=redis_server,
    )
    assert [r["storage_reads"] for _, r in unprepared] == [1, 0]  # the first follow-up reads
    assert [r["storage_reads"] for _, r in prepared] == [1, 0, 0]  # the notice read it
    assert all(r["reused_tokens"] == DOC_LEN for _, r in unprepared + prepared)
    assert all(r["load_ms"] >= 0 for _, r in unprepared + prepared)  # the wait for masters
    assert [t for t, _ in prepared[1:]] == [t for t, _ in unprepared]


def _ask(llm: Any, ids: list[int], kmesh: dict[str, Any], salt: str | None = None) -> Out:
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    sp = SamplingParams(temperature=0.0, max_tokens=6,
                        extra_args={"kv_transfer_params": {"kmesh": kmesh}})  # fmt: skip
    (o,) = llm.generate([prompt], sp, use_tqdm=False)
    return list(o.outputs[0].token_ids), (o.kv_transfer_params or {}).get("kmesh", {})


def test_one_tenants_round_cannot_move_anothers() -> None:
    """Rounds count per tenant (cache_salt): another tenant's round 60 leaves tenant x's round-22
    masters alone, a round out of 64-bit range is refused at parse time and one too far ahead
    of its tenant's round by ``kmesh.max_round_jump``, each naming the field."""
    x, y = prompts(seed=31), prompts(seed=32)

    def run(llm: Any) -> list[Out]:
        out = [_ask(llm, x[0][0], {"segments": x[0][1], "round": 22}, salt="x")]
        out.append(_ask(llm, y[0][0], {"segments": y[0][1], "round": 2**63}, salt="y"))
        out.append(_ask(llm, y[1][0], {"segments": y[1][1], "round": 2**62}, salt="y"))
        out.append(_ask(llm, y[2][0], {"segments": y[2][1], "round": 60}, salt="y"))
        out.append(_ask(llm, y[3][0], {"segments": y[3][1], "round": 60}, salt="y"))
        out += [_ask(llm, x[i][0], {"segments": x[i][1], "round": 22}, salt="x") for i in (1, 2)]
        out.append(_ask(llm, x[3][0], {"segments": x[3][1], "round": 2**62}))  # no salt
        return out

    reports = [r for _, r in _engine(run, round_lifetime=2)]
    assert (
        reports[1]["fallback"].startswith("bad annotation: round=")
        and "[0, " in reports[1]["fallback"]
    )
    assert reports[2]["fallback"].startswith("round refused: round=")
    assert "kmesh.max_round_jump" in reports[2]["fallback"]
    assert reports[3]["fallback"] is None and reports[4]["reused_tokens"] == DOC_LEN  # y's own
    for report in reports[5:7]:  # x's follow-ups: its round-22 master still there
        assert report["fallback"] is None and report["reused_tokens"] == DOC_LEN, report
    assert "kmesh.max_round_jump" in reports[7]["fallback"]  # the default tenant: from 0


def test_a_round_announced_late_is_retired_when_stored() -> None:
    """With the engine at round 10 and ``round_lifetime`` 2, a document first stored by a
    request of round 0 is past its lifetime: deleted at once, its readers told why."""
    a, b = prompts(seed=33), prompts(seed=34)

    def run(llm: Any) -> list[Out]:
        out = [_ask(llm, b[0][0], {"segments": b[0][1], "round": 10})]  # the engine: round 10
        out.append(_ask(llm, a[0][0], {"segments": a[0][1], "round": 0}))  # stores A, late
        out += [_ask(llm, a[i][0], {"segments": a[i][1], "round": 10}) for i in (1, 2)]
        return out

    got = _engine(run, round_lifetime=2)
    retired, again = got[2][1], got[3][1]
    assert retired["reused_tokens"] == 0, retired  # not reused: deleted when stored
    assert retired["fallback"].startswith("master retired: segment "), retired
    assert "round 0" in retired["fallback"]
    assert got[2][0] == _engine(lambda llm: _generate(llm, a[1][0], None)[0])  # stock's tokens
    assert again["fallback"] is None and again["reused_tokens"] == DOC_LEN  # stored in round 10
