"""`FamilyHeader` as an ASGI middleware, without a server: which requests it rewrites and how.
(Through vLLM's real OpenAI server: tests/vllm/test_routing.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kmesh_blend.vllm.family_header import FamilyHeader, with_session


def test_with_session_fills_the_session_and_keeps_everything_else() -> None:
    body = {"model": "m", "prompt": [1, 2], "kv_transfer_params": {"kmesh": {"segments": [[0, 1]]}}}
    out = json.loads(with_session(json.dumps(body).encode(), "fam"))
    assert out == {**body, "kv_transfer_params": {"kmesh": {"segments": [[0, 1]]},
                                                  "kmesh_session": "fam"}}  # fmt: skip
    plain = json.loads(with_session(b'{"model": "m", "kv_transfer_params": null}', "f"))
    assert plain["kv_transfer_params"] == {"kmesh_session": "f"}


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'{"kv_transfer_params": [1]}',
     b'{"kv_transfer_params": {"kmesh_session": "set-by-the-client"}}'],
)  # fmt: skip
def test_with_session_leaves_what_it_cannot_or_need_not_rewrite(body: bytes) -> None:
    assert with_session(body, "fam") == body


def _call(path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> dict[str, Any]:
    """Run the middleware over a recording app; what the app received."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.update(scope=scope, body=message["body"], more=message.get("more_body", False))

    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(FamilyHeader(app)(scope, receive, None))  # type: ignore[arg-type]
    return seen


def test_the_middleware_rewrites_a_chunked_completion_body_and_its_length() -> None:
    body = json.dumps({"model": "m", "messages": []}).encode()
    headers = [(b"content-type", b"application/json"), (b"X-Session-ID", b"team-3"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    seen = _call("/v1/chat/completions", headers, [body[:5], body[5:]])
    assert json.loads(seen["body"])["kv_transfer_params"] == {"kmesh_session": "team-3"}
    assert not seen["more"]
    lengths = [v for k, v in seen["scope"]["headers"] if k == b"content-length"]
    assert lengths == [str(len(seen["body"])).encode()]


@pytest.mark.parametrize(
    ("path", "headers"),
    [("/v1/completions", [(b"x-user-id", b"u")]),  # another header: not ours
     ("/tokenize", [(b"x-session-id", b"s")])],  # another endpoint
)  # fmt: skip
def test_the_middleware_passes_other_requests_untouched(
    path: str, headers: list[tuple[bytes, bytes]]
) -> None:
    seen = _call(path, headers, [b'{"model": "m"}'])
    assert seen["body"] == b'{"model": "m"}' and seen["scope"]["headers"] == headers
