"""Shared fixtures: the real MiniLM embedder (loaded once per session) and an HTTP tool server."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kmesh_blend.artifacts import MiniLMEmbedder, ToolClient, ToolServer
from tests.threads import run_together

N_CHILDREN = 8


@pytest.fixture(scope="session")
def embedder() -> MiniLMEmbedder:
    # The model packages are part of the install set: a missing one is an error, not a skip.
    return MiniLMEmbedder()


@pytest.fixture
def tool_server() -> Iterator[ToolServer]:
    with ToolServer(latency_s=0.2) as server:
        yield server


@pytest.fixture
def tool_client(tool_server: ToolServer) -> ToolClient:
    return ToolClient(tool_server.url)


Children = Callable[[Callable[[int], object]], list[object]]


@pytest.fixture
def run_children() -> Children:
    """``run_children(target)``: N_CHILDREN threads behind a barrier; each one's result or
    exception, in order."""
    return _run_children


def _run_children(target: Callable[[int], object], n: int = N_CHILDREN) -> list[object]:
    return run_together(target, n)
