"""Client side of routing several engines: a family's routing header and the end of its session.

vLLM's router (``vllm-router``) keys its sticky policies (``sticky_least_loaded``,
``consistent_hash``) on the ``X-Session-ID`` header; giving every request of a family the family's
name there keeps the family on one engine, where its masters, holds, group blends and cascade
decode live. `kmesh_blend.segments.client.Encoded.routed` gives the header with the request's
``kv_transfer_params``; `end_session` tells the router the family is done once its closing
request has been answered (its next use may go to another engine). Plain standard library: no
vLLM, no torch. docs/routing.md has the whole set-up.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from kmesh_blend.rules import family_problem

__all__ = ["SESSION_HEADER", "RoutingError", "end_session", "session_headers"]

SESSION_HEADER = "X-Session-ID"
"""The header vLLM's router takes a request's sticky key from (the first of its list)."""


class RoutingError(RuntimeError):
    """The router refused or did not answer; the message names the router and what it said."""


def session_headers(family: str) -> dict[str, str]:
    """``{"X-Session-ID": family}``; raises `ValueError` for a family the engine would refuse
    (`kmesh_blend.rules.family_problem`) or one a header cannot carry (control characters,
    non-ASCII: HTTP header values are ASCII)."""
    problem = family_problem(family)
    if problem is not None:
        raise ValueError(f"family={family!r}; {problem}")
    if not family.isascii() or not family.isprintable():
        raise ValueError(f"family={family!r} cannot travel in the {SESSION_HEADER} header: "
                         "use printable ASCII")  # fmt: skip
    return {SESSION_HEADER: family}


def end_session(router: str, family: str, *, timeout_s: float = 5.0) -> None:
    """End the router's session of ``family`` (``POST /finish_session?session_id=…``).

    ``router``: its base URL (``http://127.0.0.1:8000``). Call it after the family's closing
    request (``close: true``) is answered. Raises `RoutingError` when the router does not answer
    or refuses; the engine-side close stands either way (an unended session only keeps the
    family's name pointing at its engine until the router's own expiry).
    """
    session_headers(family)  # the same rule as the requests' header
    url = f"{router.rstrip('/')}/finish_session?{urllib.parse.urlencode({'session_id': family})}"
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise RoutingError(f"router {router}: finish_session for {family!r} failed: {exc}") from exc
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        raise RoutingError(
            f"router {router}: finish_session for {family!r} answered {body[:200]!r}"
        )
