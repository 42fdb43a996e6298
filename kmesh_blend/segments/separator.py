"""Separator mode: a configured token sequence splits an unannotated prompt into segments, for
clients that cannot send request parameters (`kmesh.separator`; the client side is
`kmesh_blend.segments.client.encode_with_separator`)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["split_on_separator"]


def split_on_separator(
    token_ids: Sequence[int], separator: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """Separator mode: spans of the non-empty pieces that are *followed* by ``separator``.

    ``"P <sep> D <sep> Q"`` gives the spans of ``P`` and ``D``; the piece after the last
    separator (the question, which holds the prompt's last token) stays private. Separator
    tokens themselves belong to no span. Occurrences do not overlap (scanned left to right).
    """
    sep = list(separator)
    if not sep:
        raise ValueError("separator must be a non-empty token sequence")
    ids = list(token_ids)
    n, m = len(ids), len(sep)
    spans: list[tuple[int, int]] = []
    piece_start = i = 0
    while i + m <= n:
        if ids[i : i + m] == sep:
            if i > piece_start:
                spans.append((piece_start, i))
            i += m
            piece_start = i
        else:
            i += 1
    return tuple(spans)
