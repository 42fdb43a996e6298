"""Annotation parsing and span validation (pure Python; hypothesis fuzzing of the validator)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh_blend.segments.annotation import (
    Annotation,
    AnnotationError,
    parse_annotation,
    parse_request,
    split_on_separator,
    validate_spans,
)


def test_valid_request() -> None:
    params = {"kmesh": {"segments": [[1, 5], [5, 9], [12, 20]], "family": "doc-42", "round": 3}}
    parsed = parse_request(params, 24, max_model_len=4096)
    assert parsed.fallback is None
    assert parsed.annotation == Annotation(((1, 5), (5, 9), (12, 20)), "doc-42", 3)
    assert parsed.annotation.num_shared_tokens == 4 + 4 + 8


def test_unannotated_request_is_not_a_fallback() -> None:
    assert parse_request(None, 10, max_model_len=100) == (None, None)
    assert parse_request({"other_connector": 1}, 10, max_model_len=100) == (None, None)


@pytest.mark.parametrize(
    ("kmesh", "needle"),
    [
        ({"segments": [[3, 2]]}, "empty or reversed"),
        ({"segments": [[2, 2]]}, "empty or reversed"),
        ({"segments": [[0, 11]]}, "outside the prompt"),
        ({"segments": [[-1, 3]]}, "outside the prompt"),
        ({"segments": [[5, 8], [0, 3]]}, "sorted"),
        ({"segments": [[0, 5], [4, 8]]}, "overlaps"),
        ({"segments": [[0, 2.0]]}, "int pair"),
        ({"segments": [[0, True]]}, "int pair"),
        ({"segments": [[0, 1, 2]]}, "int pair"),
        ({"segments": ["ab"]}, "int pair"),
        ({"segments": []}, "empty"),
        ({"segments": "0:3"}, "segments="),
        ({}, "missing 'segments'"),
        ({"segments": [[0, 3]], "segmnets": 1}, "unknown key(s) 'segmnets'"),
        ({"segments": [[0, 3]], "family": ""}, "family="),
        ({"segments": [[0, 3]], "round": -1}, "round="),
        ({"segments": [[0, 3]], "round": 2**63}, "round=9223372036854775808; valid: an int in"),
        ({"segments": [[0, 3]], "round": 10**400}, "chars); valid"),
        ({"segments": [[0, 3]], "prepare": True}, "prepare: removed: every request with a"),
        ({"segments": [[0, 3]], "close": 1}, "close="),
        ({"segments": [[0, 3]], "close": True}, "needs the 'family'"),
        ({"segments": [[0, 3]], "recompute_ratio": 1.5}, "recompute_ratio=1.5"),
        ({"segments": [[0, 3]], "recompute_ratio": "0.2"}, "recompute_ratio="),
        ({"segments": [[0, 3]], "recompute_ratio": True}, "recompute_ratio="),
        ({"segments": [[0, 3]], "sink_tokens": -1}, "sink_tokens=-1"),
        ({"segments": [[0, 3]], "sink_tokens": 2.0}, "sink_tokens="),
        ({"segments": [[0, 3]], "drift_correction": "on"}, "drift_correction='on'; valid: 'off'"),
        ({"segments": [[0, 3]], "drift_correction": 1}, "drift_correction=1"),
        ([[0, 3]], "not a dict"),
    ],
)
def test_bad_annotations_fall_back_with_a_clear_message(kmesh: object, needle: str) -> None:
    parsed = parse_request({"kmesh": kmesh}, 10, max_model_len=4096)
    assert parsed.annotation is None
    assert parsed.fallback is not None and needle in parsed.fallback, parsed.fallback
    with pytest.raises(AnnotationError, match=r"\w"):
        parse_annotation(kmesh, 10, 4096)


def test_prompt_longer_than_model() -> None:
    parsed = parse_request({"kmesh": {"segments": [[0, 3]]}}, 200, max_model_len=128)
    assert parsed.annotation is None and "max length 128" in str(parsed.fallback)


def test_error_names_the_field() -> None:
    with pytest.raises(AnnotationError) as info:
        validate_spans([[0, 2], [1, 3]], 10, 100)
    assert info.value.field == "segments[1]"


def test_parse_request_never_raises_on_garbage() -> None:
    class Weird(dict):  # type: ignore[type-arg]
        def get(self, *_: object) -> object:
            raise RuntimeError("boom")

    for bad in (Weird(), 42, "x", {"kmesh": object()}, {"kmesh": {"segments": [[None, 1]]}}):
        parsed = parse_request(bad, 10, max_model_len=100)
        assert parsed.annotation is None and parsed.fallback


def test_numpy_ints_are_accepted() -> None:
    import numpy as np

    assert validate_spans([[np.int64(1), np.int32(4)]], 10, 100) == ((1, 4),)
    with pytest.raises(AnnotationError):
        validate_spans([[np.float64(1), 4]], 10, 100)


def test_separator_mode() -> None:
    sep = [7, 7]
    ids = [1, 2, 7, 7, 3, 4, 5, 7, 7, 7, 7, 6, 9]
    assert split_on_separator(ids, sep) == ((0, 2), (4, 7))  # empty piece between seps skipped
    parsed = parse_request(None, len(ids), max_model_len=100, token_ids=ids, separator=sep)
    assert parsed.annotation is not None and parsed.annotation.source == "separator"
    assert parsed.annotation.spans == ((0, 2), (4, 7))
    assert split_on_separator([1, 2, 3], [9]) == ()
    # an explicit annotation wins over the separator
    parsed = parse_request(
        {"kmesh": {"segments": [[11, 13]]}},
        len(ids),
        max_model_len=100,
        token_ids=ids,
        separator=sep,
    )
    assert parsed.annotation is not None and parsed.annotation.spans == ((11, 13),)


def test_separator_mode_takes_segments_from_separators_when_the_annotation_has_none() -> None:
    sep, ids = [7], [1, 2, 7, 3, 4, 7, 9]

    def parse(kmesh: object, separator: list[int] | None = sep) -> object:
        params = {"kmesh": kmesh}
        return parse_request(
            params, len(ids), max_model_len=100, token_ids=ids, separator=separator
        )

    got = parse({"family": "doc-1", "round": 2, "close": True})
    assert got.annotation is not None and got.fallback is None  # type: ignore[attr-defined]
    a = got.annotation  # type: ignore[attr-defined]
    assert a.spans == ((0, 2), (3, 5)) and a.source == "separator"
    assert (a.family, a.round, a.close) == ("doc-1", 2, True)
    assert parse({}).annotation.spans == ((0, 2), (3, 5))  # type: ignore[attr-defined]
    assert "round" in parse({"round": -1}).fallback  # type: ignore[attr-defined]
    # without a separator configured, segments stay required
    assert "missing 'segments'" in parse({}, separator=None).fallback  # type: ignore[attr-defined]
    no_seps = parse_request({"kmesh": {}}, 3, max_model_len=100, token_ids=[1, 2, 3], separator=sep)
    assert no_seps == (None, None)


@st.composite
def _span_lists(draw: st.DrawFn) -> tuple[int, list[list[int]]]:
    n = draw(st.integers(0, 60))
    raw = draw(st.lists(st.tuples(st.integers(-5, 70), st.integers(-5, 70)), max_size=6))
    return n, [list(p) for p in raw]


def _is_valid(n: int, spans: list[list[int]]) -> bool:
    if not spans:
        return False
    prev_end = 0
    for start, end in spans:
        if not (0 <= start < end <= n) or start < prev_end:
            return False
        prev_end = end
    return True


@settings(max_examples=400, deadline=None)
@given(_span_lists())
def test_fuzz_validate_spans_agrees_with_a_reference(case: tuple[int, list[list[int]]]) -> None:
    n, spans = case
    parsed = parse_request({"kmesh": {"segments": spans}}, n, max_model_len=64)
    expect = _is_valid(n, spans) and n <= 64
    assert (parsed.annotation is not None) == expect, (n, spans, parsed.fallback)
    if parsed.annotation is not None:
        covered = [t for s, e in parsed.annotation.spans for t in range(s, e)]
        assert covered == sorted(set(covered)) and all(0 <= t < n for t in covered)
    else:
        assert parsed.fallback


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), max_size=40),
    st.lists(st.integers(0, 4), min_size=1, max_size=3),
)
def test_fuzz_separator_spans_are_valid_and_separator_free(ids: list[int], sep: list[int]) -> None:
    spans = split_on_separator(ids, sep)
    if spans:
        validate_spans(spans, len(ids), 1000)
    for start, end in spans:
        piece = ids[start:end]
        assert ids[end : end + len(sep)] == sep  # every segment is followed by the separator
        assert piece


def test_a_request_may_carry_its_own_blend_setting() -> None:
    a = parse_annotation({"segments": [[0, 3]], "recompute_ratio": 1, "sink_tokens": 8}, 10, 64)
    assert (a.recompute_ratio, a.sink_tokens) == (1.0, 8)
    assert isinstance(a.recompute_ratio, float)
    import numpy as np

    c = parse_annotation({"segments": [[0, 3]], "sink_tokens": np.int64(4)}, 10, 64)
    assert type(c.sink_tokens) is int and c.sink_tokens == 4  # what the blend's options accept
    b = parse_annotation({"segments": [[0, 3]]}, 10, 64)
    assert (b.recompute_ratio, b.sink_tokens, b.drift_correction) == (None, None, None)
    d = parse_annotation({"segments": [[0, 3]], "drift_correction": "auto"}, 10, 64)
    assert d.drift_correction == "auto"
