"""The rules for values that arrive in more than one place: an engine setting (`KMeshConfig`),
a request's own annotation (`kmesh_blend.segments.annotation`), the blend's options
(`kmesh_blend.blend.BlendOptions`) and the client's routing header (`kmesh_blend.routing`). Each
returns what is wrong, in words, or None; the caller raises its own error naming its own field."""

from __future__ import annotations

import math
import operator

__all__ = ["DRIFTS", "MAX_FAMILY_LEN", "family_problem", "ratio_problem", "sink_tokens_problem"]

MAX_FAMILY_LEN = 256
DRIFTS = ("off", "auto")  # drift correction: the setting's, a request's and `BlendOptions`' choices


def ratio_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a recompute ratio (a number in [0, 1]), or None. The one
    rule for the setting, a request's own ratio and `BlendOptions`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "not a number"
    if math.isnan(value):
        return "NaN"
    return None if 0.0 <= value <= 1.0 else "out of range"


def sink_tokens_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a sink-token count (an int ≥ 0; numpy ints too), or
    None: the one rule for the setting, a request's own count and `BlendOptions`."""
    if isinstance(value, bool):
        return "not an int"
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return "not an int"
    return None if number >= 0 else "negative"


def family_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a family name (a non-empty string of at most
    `MAX_FAMILY_LEN` characters), or None: the one rule for the annotation's ``family``, the
    ``X-Session-ID`` header's and the client's."""
    if not isinstance(value, str) or not value or len(value) > MAX_FAMILY_LEN:
        return f"valid: a non-empty string of at most {MAX_FAMILY_LEN} chars"
    return None
