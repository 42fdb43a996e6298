"""KMeshConnector end to end on real vLLM (CPU, in-process engine), the issue's acceptance."""

from __future__ import annotations

from typing import Any

import pytest

import kmesh_blend.vllm.scheduler_reuse as scheduler_reuse
from kmesh_blend.blend import keep_count
from kmesh_blend.vllm.meta import SegmentRef
from tests.vllm.family import DOC_LEN, NUM_FOLLOW_UPS, prompts, run_family, run_stock

pytestmark = pytest.mark.vllm

_runs: dict[tuple[Any, ...], Any] = {}


def _family(**extra: Any) -> Any:
    key = tuple(sorted(extra.items()))
    if key not in _runs:
        _runs[key] = run_family(**extra)
    return _runs[key]


@pytest.fixture(scope="module")
def stock() -> list[list[int]]:
    return run_stock()


def test_follow_ups_reuse_the_document() -> None:
    results = _family(store="cpu", recompute_ratio=0.15)
    first, follow_ups = results[0], results[1 : NUM_FOLLOW_UPS + 1]
    assert first[1] is not None and first[1]["reused_tokens"] == 0  # nothing stored yet
    assert len(follow_ups) == NUM_FOLLOW_UPS
    for tokens, report in follow_ups:
        assert report is not None and report["fallback"] is None
        assert report["reused_tokens"] >= DOC_LEN
        assert report["recomputed_tokens"] == keep_count(0.15, DOC_LEN)
        assert len(tokens) == 8


def test_a_blend_that_stops_after_the_segment_answers_like_one_over_the_whole_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blend that stops at the document's end (vLLM's forward computes the question over the
    blended KV) gives the same tokens, and recomputes the same document tokens, as one over the
    whole prompt (the selection sees only what precedes each token)."""
    stop, ends = scheduler_reuse.blend_end, []

    def spy(*args: Any) -> int | None:
        ends.append(stop(*args))
        return ends[-1]

    monkeypatch.setattr(scheduler_reuse, "blend_end", spy)
    whole = run_family(store="cpu", recompute_ratio=0.15)
    assert ends and all(end is None for end in ends)  # a short question: the blend takes it
    monkeypatch.setattr(
        scheduler_reuse, "blend_end", lambda n, loads, *a: max(r.end for r in loads)
    )
    stopped = run_family(store="cpu", recompute_ratio=0.15)
    assert [t for t, _ in whole] == [t for t, _ in stopped]
    pairs = zip(whole[1 : NUM_FOLLOW_UPS + 1], stopped[1 : NUM_FOLLOW_UPS + 1], strict=True)
    for (_, a), (_, b) in pairs:
        assert a is not None and b is not None
        assert a["fallback"] is None and b["fallback"] is None
        assert (a["reused_tokens"], a["recomputed_tokens"]) == (
            b["reused_tokens"], b["recomputed_tokens"])  # fmt: skip


def test_the_blend_takes_a_tail_after_its_last_segment_up_to_its_own_size() -> None:
    """`blend_end`: the whole prompt (None) when the tail after the last loaded segment is no
    longer than what the blend computes anyway; the segment's end otherwise."""
    end = scheduler_reuse.blend_end
    doc = [SegmentRef(20, 420, "doc")]  # type: ignore[arg-type]
    # before it 20 private tokens; at ratio 0.15 it recomputes 60 of the 400: it computes 80
    assert end(500, doc, 0.15, False) is None  # 80 after it
    assert end(501, doc, 0.15, False) == 420  # 81 after it
    assert end(440, doc, 0.0, False) is None and end(441, doc, 0.0, False) == 420  # 20 own
    assert end(2000, doc, 1.0, False) is None and end(2000, doc, 0.0, True) is None
    assert end(421, doc, 0.0, False) is None  # within vLLM's last tokens: always the blend's
    # an exact prefix of 10 tokens: 10 private tokens of its own before the document
    assert end(430, doc, 0.0, False, 10) is None and end(431, doc, 0.0, False, 10) == 420
    two = [SegmentRef(0, 100, "a"), SegmentRef(110, 300, "b")]  # type: ignore[arg-type]
    assert end(310, two, 0.0, False) is None and end(311, two, 0.0, False) == 300  # a gap of 10


def test_outputs_identical_across_stores_and_schedules(lm_server: str) -> None:
    base = _family(store="cpu", recompute_ratio=0.15)
    sequential = _family(store="cpu", recompute_ratio=0.15, schedule="sequential")
    remote = _family(store=lm_server, recompute_ratio=0.15)
    assert [t for t, _ in sequential] == [t for t, _ in base]
    assert [t for t, _ in remote] == [t for t, _ in base]
    assert all(r["reused_tokens"] >= DOC_LEN for _, r in remote[1 : NUM_FOLLOW_UPS + 1])


def test_ratio_one_generates_stock_tokens(stock: list[list[int]]) -> None:
    results = _family(store="cpu", recompute_ratio=1.0)
    assert [t for t, _ in results[: NUM_FOLLOW_UPS + 1]] == stock
    assert all(r["recomputed_tokens"] == DOC_LEN for _, r in results[1 : NUM_FOLLOW_UPS + 1])


def test_one_load_failure_recomputes_only_that_request(stock: list[list[int]]) -> None:
    target = prompts()[2][0]
    results = run_family(
        lambda load: "injected fault" if load.token_ids == target else None,
        store="cpu", recompute_ratio=0.15,
    )  # fmt: skip
    normal = _family(store="cpu", recompute_ratio=0.15)
    failed_tokens, failed_report = results[2]
    assert failed_report["fallback"].startswith("load error: injected fault")
    assert failed_report["reused_tokens"] == 0
    assert failed_tokens == stock[2]  # recomputed from scratch by vLLM
    for i in (1, 3, 4):
        assert results[i][1]["reused_tokens"] >= DOC_LEN and results[i][1]["fallback"] is None
        assert results[i][0] == normal[i][0]


def test_unannotated_and_bad_annotations_take_the_stock_path(stock: list[list[int]]) -> None:
    results = _family(store="cpu", recompute_ratio=0.15)
    plain_tokens, plain_report = results[NUM_FOLLOW_UPS + 1]
    assert plain_report is None  # unannotated: no report, stock path
    assert plain_tokens == stock[1]
    bad_tokens, bad_report = results[NUM_FOLLOW_UPS + 2]
    assert bad_report is not None and bad_report["reused_tokens"] == 0
    assert "segments" in bad_report["fallback"]  # names the bad field
    assert bad_tokens == stock[2]


def test_bad_setting_is_refused_at_start() -> None:
    from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
    from kmesh_blend.testing.engine import make_llm
    from tests.vllm.family import kv_transfer_config

    with pytest.raises(Exception, match=r"kmesh\.recompute_ratio"):
        make_llm(
            build_checkpoint(TINY_LLAMA),
            kv_transfer_config=kv_transfer_config(recompute_ratio=2.0),
            enable_prefix_caching=False,
        )
