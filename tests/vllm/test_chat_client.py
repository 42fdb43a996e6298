"""examples/chat_client.py end to end: vLLM's OpenAI-compatible server with KMesh in separator
mode, the official ``openai`` client over ``/v1/chat/completions``, SmolLM2 in bf16.

The requests carry no annotation: the server splits each prompt at ``<file_sep>``. The first
reader publishes the document; follow-ups with other system prompts and questions reuse all of
it, and the report comes back in the chat completion response.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kmesh_blend.testing import smollm2_checkpoint

pytestmark = pytest.mark.vllm

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chat_client.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kmesh_examples_chat_client", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass/NamedTuple machinery looks the module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_chat_follow_ups_reuse_the_document_through_the_openai_client(tmp_path: Path) -> None:
    example = _example()
    model = str(smollm2_checkpoint())
    document = example.load_document()
    doc_len = example.document_tokens(model, document)
    assert doc_len > 1000  # a real document, not a stub
    server = example.start_server(model, tmp_path / "server.log")
    try:
        client = example.make_client(server)
        replies = [
            example.ask(client, server.model, system, lead_in, document, question, max_tokens=8)
            for system, lead_in, question in (example.READER, *example.FOLLOW_UPS)
        ]
    finally:
        example.stop_server(server)
    reader, *follow_ups = replies
    assert reader.report is not None, "separator mode must report on unannotated requests"
    assert reader.report["reused_tokens"] == 0 and reader.report["fallback"] is None
    assert len(follow_ups) == 3
    for reply in follow_ups:
        assert reply.report is not None and reply.report["fallback"] is None, reply.report
        assert reply.report["reused_tokens"] >= doc_len, reply.report
        assert reply.text  # the model answered
