"""Client helper: text with segment markers → prompt token ids + the kmesh annotation.

Each piece of text (shared segment or private text) is tokenized **on its own**, so no token ever
spans a boundary: a shared segment has the same token ids wherever it sits in a prompt, which is
what its content hash (`kmesh_blend.segments.identity`) needs. Tokenizing the joined text instead
lets BPE merge the last characters of one piece with the first of the next (LMCache issue #1136).
BOS, when the tokenizer has one and ``add_bos`` is set, is added once, at the very start, and is
never part of a span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kmesh_blend.routing import session_headers
from kmesh_blend.segments.annotation import Span

__all__ = [
    "BEGIN_MARK",
    "END_MARK",
    "Encoded",
    "Routed",
    "Shared",
    "TokenizerLike",
    "encode_marked",
    "encode_parts",
    "encode_with_separator",
    "split_marked",
]

BEGIN_MARK = "<kmesh>"
END_MARK = "</kmesh>"


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the helper uses."""

    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class Shared:
    """A piece of prompt text that is a shared segment."""

    text: str


class Routed(NamedTuple):
    """One request's parts for an OpenAI client behind vLLM's router: ``extra_body`` (holds
    ``kv_transfer_params``) and ``headers`` (``X-Session-ID`` = the family)."""

    extra_body: dict[str, Any]
    headers: dict[str, str]


class Encoded(NamedTuple):
    """Prompt token ids ``[T]`` (python ints) and the half-open spans of its shared segments."""

    token_ids: list[int]
    spans: list[Span]

    def kv_transfer_params(
        self, *, family: str | None = None, round: int | None = None, close: bool = False,
        recompute_ratio: float | None = None, sink_tokens: int | None = None,
        drift_correction: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The ``kv_transfer_params`` dict of docs/contract.md for this prompt (``None`` / false
        fields are left out: the engine's settings apply)."""
        kmesh: dict[str, Any] = {"segments": [list(s) for s in self.spans]}
        optional = {"family": family, "round": round, "close": close or None,
                    "recompute_ratio": recompute_ratio, "sink_tokens": sink_tokens,
                    "drift_correction": drift_correction}  # fmt: skip
        kmesh.update({k: v for k, v in optional.items() if v is not None})
        return {"kmesh": kmesh}

    def routed(self, *, family: str, **settings: Any) -> Routed:
        """This prompt's ``kv_transfer_params`` and the routing header that keeps ``family`` on
        one engine (``settings``: the other `kv_transfer_params` arguments). With the official
        client: ``create(..., extra_body=r.extra_body, extra_headers=r.headers)``."""
        headers = session_headers(family)
        params = self.kv_transfer_params(family=family, **settings)
        return Routed({"kv_transfer_params": params}, headers)


def encode_parts(
    tokenizer: TokenizerLike, parts: Sequence[str | Shared], *, add_bos: bool = True
) -> Encoded:
    """Tokenize ``parts`` one by one; `Shared` parts become spans, plain strings are private.

    Empty parts are skipped (an empty shared part would be an empty span).
    """
    ids: list[int] = []
    spans: list[Span] = []
    if add_bos and tokenizer.bos_token_id is not None:
        ids.append(int(tokenizer.bos_token_id))
    for part in parts:
        text = part.text if isinstance(part, Shared) else part
        if not isinstance(text, str):
            raise TypeError(f"parts must be str or Shared, got {type(part).__name__}")
        piece = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] if text else []
        if not piece:
            continue
        if isinstance(part, Shared):
            spans.append((len(ids), len(ids) + len(piece)))
        ids.extend(piece)
    return Encoded(ids, spans)


def encode_marked(
    tokenizer: TokenizerLike,
    text: str,
    *,
    begin: str = BEGIN_MARK,
    end: str = END_MARK,
    add_bos: bool = True,
) -> Encoded:
    """``"Answer about <kmesh>DOCUMENT</kmesh> please"`` → ids with ``DOCUMENT`` as a span.

    Markers must pair up and not nest; raises `ValueError` naming the offending offset.
    """
    return encode_parts(tokenizer, split_marked(text, begin=begin, end=end), add_bos=add_bos)


def split_marked(text: str, *, begin: str = BEGIN_MARK, end: str = END_MARK) -> list[str | Shared]:
    """Split marked text into private strings and `Shared` pieces (markers removed)."""
    if not begin or not end:
        raise ValueError("markers must be non-empty")
    parts: list[str | Shared] = []
    pos = 0
    while True:
        b = text.find(begin, pos)
        stray = text.find(end, pos)
        if stray != -1 and (b == -1 or stray < b):
            raise ValueError(f"{end!r} at offset {stray} without a matching {begin!r}")
        if b == -1:
            parts.append(text[pos:])
            return parts
        e = text.find(end, b + len(begin))
        if e == -1:
            raise ValueError(f"{begin!r} at offset {b} is never closed by {end!r}")
        nested = text.find(begin, b + len(begin), e)
        if nested != -1:
            raise ValueError(f"{begin!r} at offset {nested} is nested inside another segment")
        parts.append(text[pos:b])
        parts.append(Shared(text[b + len(begin) : e]))
        pos = e + len(end)


def encode_with_separator(
    tokenizer: TokenizerLike,
    parts: Sequence[str],
    separator: Sequence[int],
    *,
    add_bos: bool = True,
) -> list[int]:
    """Separator mode: ``parts`` tokenized alone and joined by the ``separator`` token ids.

    Every part but the last becomes a segment on the engine side
    (`kmesh_blend.segments.annotation.split_on_separator`); the last is private.
    """
    sep = [int(t) for t in separator]
    if not sep:
        raise ValueError("separator must be a non-empty token sequence")
    ids: list[int] = []
    if add_bos and tokenizer.bos_token_id is not None:
        ids.append(int(tokenizer.bos_token_id))
    for i, text in enumerate(parts):
        if i:
            ids.extend(sep)
        piece = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        if any(piece[j : j + len(sep)] == sep for j in range(len(piece) - len(sep) + 1)):
            raise ValueError(f"parts[{i}] itself contains the separator tokens {sep}")
        ids.extend(piece)
    return ids
