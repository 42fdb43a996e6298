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
    ``prepare`` request of their family read it first (then they read nothing)."""
    doc = prompts(seed=23)

    def ask(llm: Any, i: int, **fields: Any) -> Out:
        return _generate(llm, doc[i][0], {"segments": doc[i][1], **fields})

    _engine(lambda llm: ask(llm, 0), store=redis_server)  # the reader, in its own engine
    unprepared = _engine(lambda llm: [ask(llm, i, family="f1") for i in (1, 2)],
                         store=redis_server)  # fmt: skip
    prepared = _engine(
        lambda llm: (
            [ask(llm, 3, family="f2", prepare=True)] + [ask(llm, i, family="f2") for i in (1, 2)]
        ),
        store=redis_server,
    )
    assert [r["storage_reads"] for _, r in unprepared] == [1, 0]  # the first follow-up reads
    assert [r["storage_reads"] for _, r in prepared] == [1, 0, 0]  # the notice read it
    assert all(r["reused_tokens"] == DOC_LEN for _, r in unprepared + prepared)
    assert all(r["load_ms"] >= 0 for _, r in unprepared + prepared)  # the wait for masters
    assert [t for t, _ in prepared[1:]] == [t for t, _ in unprepared]
