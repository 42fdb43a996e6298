"""Parse and validate the per-request ``kv_transfer_params["kmesh"]`` annotation.

A request names its shared segments as half-open token spans of its prompt (docs/contract.md)::

    {"kmesh": {"segments": [[start, end], ...], "family": "doc-42", "round": 0,
               "keep": false, "close": false,
               "recompute_ratio": 0.3, "sink_tokens": 16, "drift_correction": "auto"}}

or, for clients that cannot send parameters, a configured separator token sequence splits the
prompt (`split_on_separator`). `parse_request` is what the engine side calls: it never raises;
a bad annotation yields ``annotation=None`` and a ``fallback`` message, and the request runs
without reuse (never with doubtful KV, never a crashed engine). `validate_spans` is the strict
form and raises `AnnotationError` with a message naming the field, the bad value and what is valid.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from kmesh_blend.rules import (
    DRIFTS,
    MAX_FAMILY_LEN,
    family_problem,
    ratio_problem,
    sink_tokens_problem,
)
from kmesh_blend.segments.separator import split_on_separator

__all__ = [
    "KNOWN_FIELDS", "MAX_FAMILY_LEN", "MAX_ROUND", "SESSION_KEY", "Annotation", "AnnotationError",
    "ParsedRequest", "Span", "parse_annotation", "parse_request", "validate_spans",
]  # fmt: skip

Span = tuple[int, int]
"""A half-open token span ``(start, end)`` of the prompt, ``0 <= start < end <= num_tokens``."""

KNOWN_FIELDS: tuple[str, ...] = (
    "segments", "family", "round", "keep", "close", "recompute_ratio", "sink_tokens",
    "drift_correction",
)  # fmt: skip
# Fields an earlier release took, with what to do instead.
REMOVED_FIELDS = {
    "prepare": "removed: every request with a 'family' holds its segments in host RAM for the "
    "family; send one ahead of the follow-ups instead",
}
SESSION_KEY = "kmesh_session"
"""The ``kv_transfer_params`` key `kmesh_blend.vllm.family_header.FamilyHeader` fills from a
request's ``X-Session-ID`` header: the family of a request whose annotation names none."""
MAX_ROUND = (1 << 63) - 1  # a round is a signed 64-bit int wherever it travels
_SPANS_VALID = (
    "a non-empty list of [start, end] int pairs, 0 <= start < end <= prompt length, "
    "sorted by start and not overlapping"
)


class AnnotationError(ValueError):
    """A bad kmesh annotation; ``field`` names the offending key (e.g. ``segments[2]``)."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Annotation:
    """A validated annotation of one request.

    ``spans`` are sorted, non-overlapping and non-empty, each within the prompt.
    """

    spans: tuple[Span, ...]
    family: str | None = None
    round: int | None = None
    keep: bool = False
    """Keep the prompt's KV as mirrors so the next turn restores it (`kmesh_blend.vllm.turns`)."""
    source: Literal["params", "separator"] = "params"
    close: bool = False
    """The family is done once this request is served: its pins and retention are released."""
    recompute_ratio: float | None = None
    """This request's own ``kmesh.recompute_ratio`` (None: the engine's)."""
    sink_tokens: int | None = None
    """This request's own ``kmesh.sink_tokens`` (None: the engine's)."""
    drift_correction: str | None = None
    """This request's own ``kmesh.drift_correction`` (None: the engine's)."""

    def _replace_source(self, source: Literal["params", "separator"]) -> Annotation:
        return dataclasses.replace(self, source=source)

    @property
    def blend_settings(self) -> tuple[float | None, int | None, str | None]:
        """The request's own (recompute_ratio, sink_tokens, drift_correction); None: engine's."""
        return self.recompute_ratio, self.sink_tokens, self.drift_correction

    @property
    def num_shared_tokens(self) -> int:
        """Tokens covered by the spans."""
        return sum(end - start for start, end in self.spans)


class ParsedRequest(NamedTuple):
    """Outcome of `parse_request`: an annotation, or ``None`` with (maybe) a fallback reason.

    ``annotation is None and fallback is None``: the request is simply not annotated.
    """

    annotation: Annotation | None
    fallback: str | None


def parse_request(
    kv_transfer_params: object,
    num_tokens: int,
    *,
    max_model_len: int,
    token_ids: Sequence[int] | None = None,
    separator: Sequence[int] | None = None,
) -> ParsedRequest:
    """Engine-side entry point; **never raises**.

    ``kv_transfer_params``: the request's dict (or ``None``); only its ``"kmesh"`` entry is read.
    ``token_ids`` [num_tokens] and ``separator`` are used when a separator is configured
    (separator mode) and the request has no ``"kmesh"`` entry, or one without ``"segments"``
    (it then carries only ``family`` / ``round`` / ``keep`` / ``close`` and the
    request's own ``recompute_ratio`` / ``sink_tokens`` / ``drift_correction``).
    """
    try:
        kmesh = session = None
        if isinstance(kv_transfer_params, Mapping):
            kmesh, session = kv_transfer_params.get("kmesh"), kv_transfer_params.get(SESSION_KEY)
            if session is not None:
                _check_family(session, SESSION_KEY)
        elif kv_transfer_params is not None:
            bad = f"kv_transfer_params={kv_transfer_params!r} is not a dict"
            raise AnnotationError(bad, field="kv_transfer_params")
        separated = None
        if separator and token_ids is not None:
            if len(token_ids) != num_tokens:
                raise AnnotationError(
                    f"token_ids has {len(token_ids)} tokens, prompt has {num_tokens}",
                    field="token_ids",
                )
            separated = split_on_separator(token_ids, separator)
        if isinstance(kmesh, Mapping) and session is not None and kmesh.get("family") is None:
            kmesh = {**kmesh, "family": session}  # the router's session names the family
        if kmesh is not None:
            if isinstance(kmesh, Mapping) and "segments" not in kmesh and separated is not None:
                # Separator mode: the annotation carries only lifetimes and settings.
                if not separated:
                    return ParsedRequest(None, None)
                annotation = parse_annotation({**kmesh, "segments": separated}, num_tokens,
                                              max_model_len)  # fmt: skip
                return ParsedRequest(annotation._replace_source("separator"), None)
            return ParsedRequest(parse_annotation(kmesh, num_tokens, max_model_len), None)
        if separated:
            validate_spans(separated, num_tokens, max_model_len)
            return ParsedRequest(Annotation(separated, session, source="separator"), None)
        return ParsedRequest(None, None)
    except AnnotationError as exc:
        return ParsedRequest(None, f"bad annotation: {exc}")
    except Exception as exc:  # never let a client's input crash the engine
        return ParsedRequest(None, f"annotation not understood: {type(exc).__name__}: {exc}")


def parse_annotation(kmesh: object, num_tokens: int, max_model_len: int) -> Annotation:
    """Validate the ``kv_transfer_params["kmesh"]`` dict; raises `AnnotationError`."""
    if not isinstance(kmesh, Mapping):
        raise AnnotationError(
            f"kmesh={kmesh!r} is not a dict; valid: {{'segments': [[start, end], ...], ...}}",
            field="kmesh",
        )
    removed = next((str(k) for k in kmesh if k in REMOVED_FIELDS), None)
    if removed is not None:
        raise AnnotationError(f"{removed}: {REMOVED_FIELDS[removed]}", field=removed)
    unknown = sorted(str(k) for k in kmesh if k not in KNOWN_FIELDS)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise AnnotationError(
            f"unknown key(s) {names}; known: {', '.join(KNOWN_FIELDS)}", field=unknown[0]
        )
    if "segments" not in kmesh:
        raise AnnotationError(f"missing 'segments'; valid: {_SPANS_VALID}", field="segments")
    spans = validate_spans(kmesh["segments"], num_tokens, max_model_len)
    family = kmesh.get("family")
    if family is not None:
        _check_family(family, "family")
    round_ = kmesh.get("round")
    if round_ is not None and (not _is_int(round_) or not 0 <= round_ <= MAX_ROUND):
        raise AnnotationError(
            f"round={_clip(round_)}; valid: an int in [0, {MAX_ROUND}]", field="round"
        )
    keep = kmesh.get("keep", False)
    if not isinstance(keep, bool):
        raise AnnotationError(f"keep={keep!r}; valid: true or false", field="keep")
    close = kmesh.get("close", False)
    if not isinstance(close, bool):
        raise AnnotationError(f"close={close!r}; valid: true or false", field="close")
    if close and family is None:
        raise AnnotationError("close=true needs the 'family' to close", field="close")
    ratio = kmesh.get("recompute_ratio")
    if ratio is not None and ratio_problem(ratio) is not None:
        raise AnnotationError(
            f"recompute_ratio={ratio!r}; valid: a number in [0, 1]", field="recompute_ratio"
        )
    sinks = kmesh.get("sink_tokens")
    if sinks is not None and sink_tokens_problem(sinks) is not None:
        raise AnnotationError(f"sink_tokens={sinks!r}; valid: an int >= 0", field="sink_tokens")
    drift = kmesh.get("drift_correction")
    if drift is not None and drift not in DRIFTS:
        raise AnnotationError(f"drift_correction={_clip(drift)}; valid: 'off' or 'auto'",
                              field="drift_correction")  # fmt: skip
    return Annotation(
        spans, family, round_, keep, close=close,
        recompute_ratio=None if ratio is None else float(ratio),
        sink_tokens=None if sinks is None else int(sinks), drift_correction=drift,
    )  # fmt: skip


def validate_spans(spans: object, num_tokens: int, max_model_len: int) -> tuple[Span, ...]:
    """Check ``spans`` against a prompt of ``num_tokens``; return them as a tuple of int pairs.

    Raises `AnnotationError` for: not a list, empty list, an entry that is not a pair of ints
    (bools and floats are rejected), an empty or reversed span, a span outside the prompt,
    unsorted or overlapping spans, or a prompt longer than ``max_model_len``.
    """
    if not _is_int(num_tokens) or num_tokens < 0:
        raise AnnotationError(f"prompt length {num_tokens!r} is not an int >= 0", field="prompt")
    if num_tokens > max_model_len:
        raise AnnotationError(
            f"prompt has {num_tokens} tokens, longer than the model's max length {max_model_len}",
            field="prompt",
        )
    if isinstance(spans, str | bytes) or not isinstance(spans, Sequence):
        raise AnnotationError(f"segments={spans!r}; valid: {_SPANS_VALID}", field="segments")
    if not spans:
        raise AnnotationError(f"segments is empty; valid: {_SPANS_VALID}", field="segments")
    out: list[Span] = []
    for i, item in enumerate(spans):
        where = f"segments[{i}]"
        if (
            isinstance(item, str | bytes)
            or not isinstance(item, Sequence)
            or len(item) != 2
            or not all(_is_int(x) for x in item)
        ):
            raise AnnotationError(f"{where}={item!r} is not a [start, end] int pair", field=where)
        start, end = operator.index(item[0]), operator.index(item[1])
        if start >= end:
            raise AnnotationError(
                f"{where}=[{start}, {end}] is empty or reversed (start must be < end)", field=where
            )
        if start < 0 or end > num_tokens:
            raise AnnotationError(
                f"{where}=[{start}, {end}] is outside the prompt of {num_tokens} tokens "
                f"(valid: 0 <= start < end <= {num_tokens})",
                field=where,
            )
        if out and start < out[-1][0]:
            raise AnnotationError(
                f"{where}=[{start}, {end}] starts before segments[{i - 1}]={list(out[-1])}: "
                "spans must be sorted by start",
                field=where,
            )
        if out and start < out[-1][1]:
            raise AnnotationError(
                f"{where}=[{start}, {end}] overlaps segments[{i - 1}]={list(out[-1])}",
                field=where,
            )
        out.append((start, end))
    return tuple(out)


def _is_int(x: object) -> bool:
    """True for ints (numpy ints included, via ``__index__``); False for bools and floats."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _clip(x: object) -> str:
    """``repr(x)``, cut to 40 characters (a bad value may be huge)."""
    text = repr(x)
    return text if len(text) <= 40 else text[:30] + f"… ({len(text)} chars)"


def _check_family(family: object, field: str) -> None:
    problem = family_problem(family)
    if problem is not None:
        raise AnnotationError(f"{field}={family!r}; {problem}", field=field)
