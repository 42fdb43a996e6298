"""The routing header names the family: an ASGI middleware for vLLM's OpenAI-compatible server.

Start the server with ``--middleware kmesh_blend.vllm.family_header.FamilyHeader`` (a public
server argument; nothing of vLLM is patched). For a ``POST`` to ``/v1/completions`` or
``/v1/chat/completions`` carrying the ``X-Session-ID`` header (the key vLLM's router keeps
together), it copies the header into the JSON body as ``kv_transfer_params["kmesh_session"]``
(`kmesh_blend.segments.annotation.SESSION_KEY`). The engine takes that as the family of a request
whose annotation names none, so in separator mode an agent framework sets one header and nothing
else. The body is left as it came when it is not a JSON object, when its ``kv_transfer_params`` is
not an object (the engine reports that one), or when it already has ``kmesh_session``. The engine
validates the value like a ``family`` (a bad one: that request runs without reuse and its report
says why). No vLLM import: the server loads this module by its path.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kmesh_blend.segments.annotation import SESSION_KEY

__all__ = ["PATHS", "FamilyHeader", "with_session"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_HEADER = b"x-session-id"  # ASGI header names are lower-case bytes


def with_session(body: bytes, session: str) -> bytes:
    """``body`` (a request's JSON) with ``kv_transfer_params["kmesh_session"] = session``; the
    same bytes when it is not a JSON object, its ``kv_transfer_params`` is neither absent, null
    nor an object, or it already names a session."""
    try:
        request = json.loads(body)
    except ValueError:
        return body
    if not isinstance(request, dict):
        return body
    params = request.get("kv_transfer_params")
    if params is None:
        params = request["kv_transfer_params"] = {}
    if not isinstance(params, dict) or SESSION_KEY in params:
        return body
    params[SESSION_KEY] = session
    return json.dumps(request).encode()


class FamilyHeader:
    """ASGI middleware (``app.add_middleware(FamilyHeader)``): see the module docstring."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        session = _session(scope)
        if session is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:  # the whole body: it is rewritten as one JSON document
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to serve
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = with_session(b"".join(chunks), session)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:  # after the body: whatever the client sends next (a disconnect)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)


def _session(scope: Scope) -> str | None:
    """The ``X-Session-ID`` of a POST to one of `PATHS`; None for anything else."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    if scope.get("path") not in PATHS:
        return None
    for key, value in scope.get("headers", ()):
        if key.lower() == _HEADER:
            return bytes(value).decode("latin-1")
    return None
