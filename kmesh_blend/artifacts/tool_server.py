"""A small tool served over HTTP on 127.0.0.1 (stdlib ``http.server`` in a thread).

``GET /tool/<name>?q=<query>[&size=<bytes>]`` answers a JSON body. Tools:

* ``word_stats`` — word and character counts of ``q`` and its most frequent words.
* ``lookup`` — a deterministic pseudo-document about ``q`` of ``size`` bytes (default 1024), a
  stand-in for a search or database tool whose answer is a large blob.

Responses depend only on the request, never on the server's state, so repeated calls return the
same bytes. ``latency_s`` delays every answer (to emulate a remote tool); `ToolServer.num_calls`
counts calls per tool, so tests can see how often the tool really ran.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

__all__ = ["ToolServer"]

_MAX_SIZE = 64 << 20  # largest ``lookup`` answer served (64 MiB)


class ToolServer:
    """Serves the tools on ``127.0.0.1:<free port>`` while started (use as a context manager)."""

    def __init__(self, *, latency_s: float = 0.0) -> None:
        if not latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
        self.latency_s = latency_s
        self.num_calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("ToolServer is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ToolServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner._handle(self)

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet: tests and benchmarks print their own lines

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kmesh-tool-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ToolServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the tools -----------------------------------------------------------------------------

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(request.path)
        params = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "tool":
            return _reply(request, 404, {"error": f"no such path {url.path!r}"})
        name, query = parts[1], params.get("q", "")
        with self._lock:
            self.num_calls[name] += 1
        if self.latency_s:
            time.sleep(self.latency_s)
        if name == "word_stats":
            words = query.split()
            top = collections.Counter(w.lower() for w in words).most_common(5)
            return _reply(request, 200, {"words": len(words), "chars": len(query), "top": top})
        if name == "lookup":
            try:
                size = int(params.get("size", "1024"))
            except ValueError:
                size = -1
            if not 0 <= size <= _MAX_SIZE:
                return _reply(request, 400, {"error": f"size must be in [0, {_MAX_SIZE}]"})
            return _reply(request, 200, {"query": query, "text": _pseudo_text(query, size)})
        return _reply(request, 404, {"error": f"no such tool {name!r}"})


def _reply(request: BaseHTTPRequestHandler, status: int, body: dict[str, object]) -> None:
    data = json.dumps(body, sort_keys=True).encode()
    request.send_response(status)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(data)))
    request.end_headers()
    request.wfile.write(data)


def _pseudo_text(query: str, size: int) -> str:
    """``size`` hex characters derived from ``query`` (SHA-256 in counter mode)."""
    seed = query.encode()
    blocks = []
    for i in range((size + 63) // 64):
        blocks.append(hashlib.sha256(seed + i.to_bytes(8, "little")).hexdigest())
    return "".join(blocks)[:size]
