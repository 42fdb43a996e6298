"""ArtifactStore with the real loaders: singleflight, copy-on-write, release, notice, errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kmesh_blend.artifacts import (
    ArtifactInputError,
    ArtifactLoadError,
    ArtifactStore,
    DoubleReleaseError,
    MiniLMEmbedder,
    SharedArtifact,
    ToolClient,
    ToolServer,
    UnknownArtifactError,
    UnknownFamilyError,
    embedding_loader,
    tool_loader,
)

MiB = 1 << 20
Children = Callable[[Callable[[int], object]], list[object]]
DOCS = ["The cat sat on the mat.", "Stock markets fell sharply today.", "A kitten naps on a rug."]


def _files_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


def test_children_share_one_tool_call(
    tool_server: ToolServer, tool_client: ToolClient, run_children: Children
) -> None:
    store = ArtifactStore(4 * MiB, 4 * MiB)
    store.open_family("f")
    store.declare("t", tool_loader(tool_client, "lookup", "agents", size=4096), kind="tool")
    out = run_children(lambda i: store.get("t", family="f"))
    assert all(not isinstance(r, BaseException) for r in out), out
    assert tool_server.num_calls["lookup"] == 1  # 8 children, one HTTP call
    first = out[0].artifact  # type: ignore[attr-defined]
    assert all(r.artifact is first for r in out)  # type: ignore[attr-defined]
    sources = sorted(r.source for r in out)  # type: ignore[attr-defined]
    assert sources.count("loaded") == 1 and set(sources) <= {"loaded", "joined", "ram"}
    assert len(json.loads(first.payload)["text"]) == 4096
    assert store.stats()["reads"]["origin"] == 1  # type: ignore[index]
    store.close()


def test_without_singleflight_each_child_calls_the_tool(
    tool_server: ToolServer, tool_client: ToolClient, run_children: Children
) -> None:
    # Guard: the test above can fail — eight independent calls of the same tool are eight calls.
    run_children(lambda i: tool_client.call("lookup", "agents", size=64))
    assert tool_server.num_calls["lookup"] == 8


def test_children_share_one_embedding_run(embedder: MiniLMEmbedder, run_children: Children) -> None:
    store = ArtifactStore(4 * MiB, 0)
    store.open_family("f")
    store.declare("emb", embedding_loader(embedder, DOCS), kind="embedding", family="f")
    calls = embedder.num_calls
    out = run_children(lambda i: store.get("emb", family="f").artifact)
    assert embedder.num_calls == calls + 1
    emb = out[0]
    assert isinstance(emb, SharedArtifact) and all(o is emb for o in out)
    assert isinstance(emb.payload, np.ndarray) and emb.payload.shape == (3, 384)
    store.close()


def test_copy_on_write_isolation() -> None:
    store = ArtifactStore(4 * MiB, 0)
    store.open_family("f")
    store.declare("a", lambda: np.arange(1000, dtype=np.float32), family="f")
    mine, sibling = (store.view("a", family="f", child=c) for c in ("c0", "c1"))
    shared = sibling.read()
    assert isinstance(shared, np.ndarray)
    with pytest.raises(ValueError):
        shared[0] = -1  # the shared object is read-only
    used = store.ram_used_bytes
    copy = mine.write()
    assert isinstance(copy, np.ndarray)
    copy[:10] = -7
    assert store.ram_used_bytes == used + 4000  # the copy is charged to the budget
    assert float(sibling.read()[0]) == 0.0  # type: ignore[index]
    assert float(store.get("a", family="f").artifact.payload[0]) == 0.0  # type: ignore[index]
    assert float(mine.read()[0]) == -7.0  # type: ignore[index]
    mine.close()
    assert store.ram_used_bytes == used  # the child's copy is gone with its view
    with pytest.raises(DoubleReleaseError, match="already closed"):
        mine.close()
    store.close()


def test_byte_payload_copy_is_a_bytearray() -> None:
    store = ArtifactStore(MiB, 0)
    store.open_family("f")
    store.declare("b", lambda: b"hello")
    view = store.view("b", family="f", child="c")
    view.write()[0:1] = b"J"  # type: ignore[index]
    assert bytes(view.read()) == b"Jello"  # type: ignore[arg-type]
    assert store.get("b").artifact.payload == b"hello"
    store.close()


def test_release_frees_ram_and_disk() -> None:
    store = ArtifactStore(8 * MiB, 8 * MiB)
    store.open_family("f")
    store.open_family("g")
    store.declare("global", lambda: np.ones(1000, np.uint8))
    for i in range(3):
        store.declare(f"f/{i}", lambda i=i: np.full(100_000, i, np.uint8), family="f")
        store.get(f"f/{i}", family="f")
    store.get("global", family="f")
    store.declare("both", lambda: np.zeros(5000, np.uint8), family="f")
    store.get("both", family="g")  # another open family uses it
    view = store.view("f/0", family="f", child="c")
    view.write()
    ram, disk = store.ram_used_bytes, store.disk_used_bytes
    assert _files_bytes(store.disk.root) == disk > 300_000
    released = store.close_family("f")
    assert released.num_views == 1 and view.closed
    assert released.num_dropped == 3  # f's own artifacts; "both" stays while g is open
    assert released.freed_ram_bytes == ram - store.ram_used_bytes >= 400_000
    assert released.freed_disk_bytes == disk - store.disk_used_bytes > 300_000
    assert _files_bytes(store.disk.root) == store.disk_used_bytes
    assert store.get("global").source == "ram"  # not declared for f: stays
    with pytest.raises(UnknownArtifactError, match="f/0"):
        store.get("f/0")
    assert store.get("both", family="g").source == "ram"
    assert store.close_family("g").num_dropped == 1
    store.close()


def test_notice_prepares_before_children_arrive(
    tool_server: ToolServer, tool_client: ToolClient, run_children: Children
) -> None:
    store = ArtifactStore(4 * MiB, 0)
    store.open_family("f")
    keys = [f"t{i}" for i in range(3)]
    for key in keys:
        store.declare(key, tool_loader(tool_client, "word_stats", key), kind="tool", family="f")
    prepared = store.prepare("f", keys)
    assert prepared.report.num_ready == 3 and prepared.report.reads == 3
    assert [f.source for f in prepared.fetched if f is not None] == ["loaded"] * 3
    assert store.pinned_bytes == store.ram_used_bytes > 0
    out = run_children(lambda i: [store.get(k, family="f").source for k in keys])
    assert all(o == ["ram"] * 3 for o in out)
    assert sum(tool_server.num_calls.values()) == 3
    assert store.metrics.as_dict()["prepare_seconds"] > 0
    store.close()


def test_children_join_an_async_preparation(
    tool_server: ToolServer, tool_client: ToolClient, run_children: Children
) -> None:
    store = ArtifactStore(4 * MiB, 0)
    store.open_family("f")
    store.declare("t", tool_loader(tool_client, "lookup", "x"), kind="tool", family="f")
    future = store.prepare_async("f", ["t"])
    out = run_children(lambda i: store.get("t", family="f").source)
    assert future.result(timeout=10).num_ready == 1
    assert tool_server.num_calls["lookup"] == 1
    assert set(out) <= {"joined", "ram", "loaded"} and out.count("loaded") <= 1
    store.close()


def test_clear_errors() -> None:
    store = ArtifactStore(MiB, 0)
    store.declare("k", lambda: b"x")
    with pytest.raises(UnknownFamilyError, match="'nope' was never opened"):
        store.get("k", family="nope")
    with pytest.raises(UnknownFamilyError, match="'nope'"):
        store.close_family("nope")
    store.open_family("f")
    store.close_family("f")
    with pytest.raises(DoubleReleaseError, match="'f' was already released"):
        store.close_family("f")
    with pytest.raises(DoubleReleaseError, match="already released"):
        store.get("k", family="f")
    with pytest.raises(ArtifactInputError, match="already released"):
        store.open_family("f")
    with pytest.raises(UnknownArtifactError, match="'missing'"):
        store.get("missing")
    with pytest.raises(ArtifactInputError, match="ram_bytes"):
        ArtifactStore(-1)
    with pytest.raises(ArtifactInputError, match="disk_bytes"):
        ArtifactStore(1, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ArtifactInputError, match="kind of 'k2'"):
        store.declare("k2", lambda: b"", kind="video")  # type: ignore[arg-type]
    with pytest.raises(ArtifactInputError, match="loader of 'k3'"):
        store.declare("k3", b"not callable")  # type: ignore[arg-type]
    with pytest.raises(ArtifactInputError, match="key must be"):
        store.declare("", lambda: b"")
    with pytest.raises(ArtifactInputError, match="child must be"):
        store.view("k", family="f", child="")
    store.declare("bad", lambda: {"not": "a payload"})
    with pytest.raises(ArtifactLoadError, match="payload of 'bad' must be bytes") as info:
        store.get("bad")
    assert info.value.__cause__ is not None
    store.declare("boom", lambda: 1 / 0)
    with pytest.raises(ArtifactLoadError, match="loader of 'boom'"):
        store.get("boom")
    store.close()


def test_tool_errors_are_load_errors(tool_client: ToolClient) -> None:
    store = ArtifactStore(MiB, 0)
    store.declare("t", tool_loader(tool_client, "no_such_tool", "x"), kind="tool")
    with pytest.raises(ArtifactLoadError, match="no_such_tool"):
        store.get("t")
    with pytest.raises(ArtifactInputError, match="base_url"):
        ToolClient("http://example.com")
    store.close()


def test_round_scoped_artifacts_retire() -> None:
    store = ArtifactStore(MiB, MiB)  # keep_rounds=2: round 0's outputs live through round 1
    store.declare("out/r0", lambda: b"round 0 output", round=0)
    store.get("out/r0")
    assert store.advance_round() == 0 and store.get("out/r0").source == "ram"
    assert store.advance_round() == 1
    assert store.ram_used_bytes == 0 and store.disk_used_bytes == 0
    with pytest.raises(UnknownArtifactError):
        store.get("out/r0")
    with pytest.raises(ArtifactInputError, match="round of 'bad'"):
        store.declare("bad", lambda: b"", round=-1)
    store.close()
