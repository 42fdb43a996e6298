"""A user's own documents and follow-ups for the quality report (``--prompts FILE.jsonl``).

One JSON object per line, one task each::

    {"documents": ["text of document 1", {"title": "notes", "text": "..."}],
     "follow_ups": ["What does document 1 say about X?", "Summarize the notes."],
     "system": "optional: one system prompt for every follow-up"}

Each document is read first, alone, by a reader prompt of its own (its master's source); each
follow-up is a chat prompt built with the model's chat template: a system prompt (the task's, or
one of `kmesh_blend.quality.chat.SYSTEMS` in turn), then the task's documents — in an order of
its own, each under a header line — then the follow-up's question. A model without a chat
template gets a plain one (``role: content`` lines). Bad input raises `ValueError` naming the
line and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kmesh_blend.quality.chat import (
    PREAMBLES,
    SYSTEMS,
    ChatDocument,
    ChatTask,
    chat_prompt,
    encode_text,
)

__all__ = ["PLAIN_TEMPLATE", "load_tasks"]

PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def load_tasks(tokenizer: Any, path: str | Path) -> list[ChatTask]:
    """The tasks of a JSONL file (see the module docstring). ``tokenizer``: the model's Hugging
    Face tokenizer (given `PLAIN_TEMPLATE` when it has no chat template)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    parsed = [_parse(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not parsed:
        raise ValueError(f"{path}: no tasks (one JSON object per line)")
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_TEMPLATE
    return [_task(tokenizer, task, j) for j, task in enumerate(parsed)]


def _parse(line: str, where: str) -> dict[str, Any]:
    try:
        task = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(task, dict):
        raise ValueError(f"{where}: a task is a JSON object, got {type(task).__name__}")
    docs, follow = task.get("documents"), task.get("follow_ups")
    if not isinstance(docs, list) or not docs:
        raise ValueError(f"{where}: 'documents' must be a non-empty list")
    if not isinstance(follow, list) or not follow or not all(isinstance(q, str) for q in follow):
        raise ValueError(f"{where}: 'follow_ups' must be a non-empty list of strings")
    for k, doc in enumerate(docs):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: documents[{k}] must be text or {{'title', 'text'}}")
    if "system" in task and not isinstance(task["system"], str):
        raise ValueError(f"{where}: 'system' must be a string")
    return task


def _task(tokenizer: Any, task: dict[str, Any], j: int) -> ChatTask:
    docs = []
    for k, doc in enumerate(task["documents"]):
        text = doc["text"] if isinstance(doc, dict) else doc
        title = str(doc.get("title", f"document {k + 1}")) if isinstance(doc, dict) else ""
        ids = tuple(encode_text(tokenizer, text))
        docs.append(ChatDocument(f"task{j}:doc{k}", title or f"document {k + 1}", ids))
    readers = tuple(
        chat_prompt(tokenizer, task.get("system", SYSTEMS[k % len(SYSTEMS)]),
                    "Read this document.", [doc], "What is this document about?")
        for k, doc in enumerate(docs)
    )  # fmt: skip
    requests = []
    for i, question in enumerate(task["follow_ups"]):
        order = docs[i % len(docs) :] + docs[: i % len(docs)]  # each its own order
        system = task.get("system", SYSTEMS[(3 * j + i + 1) % len(SYSTEMS)])
        preamble = PREAMBLES[(j + 2 * i) % len(PREAMBLES)]
        prompt = chat_prompt(tokenizer, system, preamble, order, question)
        requests.append(dataclasses.replace(prompt, kind="question"))
    return ChatTask(tuple(docs), readers, tuple(requests))
