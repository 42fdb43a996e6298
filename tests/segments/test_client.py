"""Client helper on the project's local tokenizer: each segment is tokenized on its own."""

from __future__ import annotations

import pytest

from kmesh_blend.segments.annotation import parse_request
from kmesh_blend.segments.client import (
    Shared,
    encode_marked,
    encode_parts,
    encode_with_separator,
    split_marked,
)
from kmesh_blend.segments.separator import split_on_separator

DOC = "def frobnicate(x):\n    return x + 1\n"


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from kmesh_blend.testing import TINY_LLAMA, build_checkpoint

    return AutoTokenizer.from_pretrained(build_checkpoint(TINY_LLAMA))


def test_segment_has_the_same_ids_at_any_offset(tokenizer) -> None:  # type: ignore[no-untyped-def]
    alone = tokenizer.encode(DOC, add_special_tokens=False)
    for before in ("", "Summarize:", "You are an assistant. Read carefully"):
        enc = encode_marked(tokenizer, f"{before}<kmesh>{DOC}</kmesh>What does it do?")
        assert len(enc.spans) == 1
        start, end = enc.spans[0]
        assert enc.token_ids[start:end] == alone
        assert enc.token_ids[0] == tokenizer.bos_token_id and start >= 1


def test_boundary_merge_is_avoided(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # Joined text lets BPE merge across the boundary ("return" + "value" style merges):
    # find a pair where it does, to show the helper's tokenization differs from naive joining.
    pairs = [("x = self.", "value"), ("impo", "rt os"), ("retu", "rn x"), ("de", "f f")]
    merged = 0
    for left, right in pairs:
        enc = encode_parts(tokenizer, [left, Shared(right)], add_bos=False)
        start, end = enc.spans[0]
        assert enc.token_ids[start:end] == tokenizer.encode(right, add_special_tokens=False)
        naive = tokenizer.encode(left + right, add_special_tokens=False)
        merged += naive != enc.token_ids
    assert merged > 0  # the guard: naive tokenization really does merge for some of these


def test_several_segments_and_params(tokenizer) -> None:  # type: ignore[no-untyped-def]
    enc = encode_marked(tokenizer, "Q1 <kmesh>alpha</kmesh> and <kmesh>beta gamma</kmesh> end")
    assert len(enc.spans) == 2
    params = enc.kv_transfer_params(family="f", round=1)
    parsed = parse_request(params, len(enc.token_ids), max_model_len=4096)
    assert parsed.fallback is None and parsed.annotation is not None
    assert parsed.annotation.spans == tuple(enc.spans)
    assert parsed.annotation.family == "f" and parsed.annotation.round == 1
    texts = [tokenizer.decode(enc.token_ids[s:e]) for s, e in enc.spans]
    assert texts == ["alpha", "beta gamma"]
    own = enc.kv_transfer_params(recompute_ratio=0.3, sink_tokens=8)
    annotation = parse_request(own, len(enc.token_ids), max_model_len=4096).annotation
    assert annotation is not None
    assert (annotation.recompute_ratio, annotation.sink_tokens) == (0.3, 8)
    assert set(own["kmesh"]) == {"segments", "recompute_ratio", "sink_tokens"}


def test_marker_errors() -> None:
    assert split_marked("a<kmesh>b</kmesh>c") == ["a", Shared("b"), "c"]
    for bad in ("<kmesh>a", "a</kmesh>", "<kmesh>a<kmesh>b</kmesh></kmesh>"):
        with pytest.raises(ValueError, match="kmesh"):
            split_marked(bad)


def test_separator_round_trip(tokenizer) -> None:  # type: ignore[no-untyped-def]
    sep = [tokenizer.convert_tokens_to_ids("<|pad|>")]
    ids = encode_with_separator(tokenizer, ["system text", DOC, "the question"], sep)
    spans = split_on_separator(ids, sep)
    assert len(spans) == 2
    start, end = spans[1]
    assert ids[start:end] == tokenizer.encode(DOC, add_special_tokens=False)
    with pytest.raises(ValueError, match="separator"):
        encode_with_separator(tokenizer, ["a<|pad|>b"], sep)
