"""Multi-document chat tasks for a real chat model: the case CacheBlend was built for.

A task is a set of 1–4 documents read by a family of requests. Each request is one chat prompt
built with the model's own chat template: a system prompt and a preamble of its own, then the
task's documents in an order of its own (each under a private header line), then a question
whose answer is in the documents (quote what follows a cue, say which document mentions a
phrase, or summarise one). Each document is also read first, alone, by a *reader* prompt of its
own: that is where its stored KV (its master) comes from, so every follow-up reuses documents
that were cached independently and never saw each other.

Text ships with Python, nothing is downloaded: prose from the Python Language Reference in
``pydoc_data.topics`` (`kmesh_blend.quality.text.reference_text`) and code from standard library
modules. Documents are cut to a fixed number of tokens, so a recompute share maps to the same
token count in every document.

Prompts are token ids: the templated text is cut at each document, and the pieces around the
documents are tokenized on their own, so a document's ids are the same in every prompt.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kmesh_blend.blend import BlendRequest, SegmentUse

__all__ = [
    "ChatDocument", "ChatPrompt", "ChatTask", "chat_prompt", "chat_tasks", "document_pool",
    "encode_text",
]  # fmt: skip

PROSE_TOPICS = (
    "exceptions", "raise", "assert", "try", "with", "for", "while", "import", "class",
    "function", "lambda", "naming", "execmodel", "comparisons", "booleans", "types", "yield",
    "global", "del", "return", "if", "calls", "slicings", "strings", "integers", "floating",
    "dict", "lists", "truth", "context-managers", "customization", "numbers",
)  # fmt: skip
CODE_MODULES = (
    "textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "bisect.py", "heapq.py", "glob.py",
    "queue.py", "sched.py", "string.py", "keyword.py", "graphlib.py", "cmd.py", "getopt.py",
)  # fmt: skip
SYSTEMS = (
    "You are a careful assistant. Answer only from the documents the user gives you.",
    "You are a helpful assistant for software engineers.",
    "You answer questions about technical documents briefly and exactly.",
    "You are a teaching assistant for a Python course.",
    "You are a code reviewer who reads documentation closely.",
    "You are a concise assistant. Quote the documents where you can.",
    "You help new programmers understand Python.",
    "You are an expert on programming languages.",
)
QUESTION_KINDS = ("quote", "which", "summary")
PREAMBLES = (
    "Here are some documents I am reading.",
    "Please read the following material carefully.",
    "I will paste a few texts, then ask a question.",
    "Below are documents from our team's notes.",
    "Read these before you answer.",
    "Some context for my question follows.",
)


@dataclass(frozen=True)
class ChatDocument:
    """A shared document: ``token_ids`` (its exact ids in every prompt) and a short title."""

    name: str
    title: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatPrompt:
    """A chat prompt's ids and its documents' half-open spans ``(start, end, document name)``."""

    token_ids: tuple[int, ...]
    spans: tuple[tuple[int, int, str], ...]
    kind: str = "reader"  # the question: "quote", "which" or "summary" (readers: "reader")

    def blend_request(self) -> BlendRequest:
        """The prompt [T] int64 with every document marked as a reused segment (its name is the
        segment id)."""
        uses = tuple(SegmentUse(s, e, name) for s, e, name in self.spans)
        return BlendRequest(torch.tensor(self.token_ids, dtype=torch.int64), uses)

    def annotation(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params["kmesh"]`` annotation (docs/contract.md)."""
        return {"segments": [[s, e] for s, e, _ in self.spans]}


@dataclass(frozen=True)
class ChatTask:
    """Documents, one reader prompt per document (its master's source), and the family."""

    documents: tuple[ChatDocument, ...]
    readers: tuple[ChatPrompt, ...]
    requests: tuple[ChatPrompt, ...]


def document_pool(tokenizer: Any, doc_tokens: int) -> list[ChatDocument]:
    """Prose and code documents of exactly ``doc_tokens`` tokens, interleaved two prose : one
    code. ``tokenizer``: a Hugging Face tokenizer."""
    from kmesh_blend.quality.text import reference_text

    prose = []
    for name in PROSE_TOPICS:
        ids = encode_text(tokenizer, reference_text((name,)))
        if len(ids) >= doc_tokens:
            title = f"Python reference: {name}"
            prose.append(ChatDocument(f"ref:{name}", title, tuple(ids[:doc_tokens])))
    code = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for module in CODE_MODULES:
        path = stdlib / module
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        body = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
        ids = encode_text(tokenizer, "".join(lines[body[0] :])) if body else []
        if len(ids) >= doc_tokens:
            code.append(ChatDocument(f"code:{module}", f"source of {module}",
                                     tuple(ids[:doc_tokens])))  # fmt: skip
    pool: list[ChatDocument] = []
    while prose or code:
        pool.extend(prose[:2])
        pool.extend(code[:1])
        prose, code = prose[2:], code[1:]
    return pool


def chat_tasks(
    tokenizer: Any,
    num_tasks: int,
    doc_tokens: int = 192,
    group_size: int = 4,
    docs_per_task: Sequence[int] = (2, 3, 4, 1),
    seed: int = 0,
) -> list[ChatTask]:
    """``num_tasks`` tasks; task j has ``docs_per_task[j % len]`` documents (distinct across
    tasks while the pool lasts) and ``group_size`` follow-ups, each with its own system prompt,
    preamble, document order and question."""
    gen = torch.Generator().manual_seed(seed)
    pool = document_pool(tokenizer, doc_tokens)
    tasks, cursor = [], 0
    for j in range(num_tasks):
        count = docs_per_task[j % len(docs_per_task)]
        if not 1 <= count <= len(pool):
            raise ValueError(f"a task of {count} documents from a pool of {len(pool)}")
        docs = tuple(pool[(cursor + k) % len(pool)] for k in range(count))
        cursor += count
        readers = tuple(
            chat_prompt(tokenizer, SYSTEMS[(j + k) % len(SYSTEMS)], "Read this document.", [doc],
                    "What is this document about?")
            for k, doc in enumerate(docs)
        )  # fmt: skip
        requests = []
        for i in range(group_size):
            order = [docs[int(k)] for k in torch.randperm(count, generator=gen)]
            question = _question(tokenizer, order, i, gen)
            system = SYSTEMS[(3 * j + i + 1) % len(SYSTEMS)]
            preamble = PREAMBLES[(j + 2 * i) % len(PREAMBLES)]
            prompt = chat_prompt(tokenizer, system, preamble, order, question)
            requests.append(dataclasses.replace(prompt, kind=QUESTION_KINDS[i % 3]))
        tasks.append(ChatTask(docs, readers, tuple(requests)))
    return tasks


def _question(tokenizer: Any, order: list[ChatDocument], i: int, gen: torch.Generator) -> str:
    """Question ``i % 3`` of the three `QUESTION_KINDS` about a random document of ``order``."""
    k = int(torch.randint(len(order), (), generator=gen))
    doc = order[k]
    at = int(torch.randint(8, len(doc.token_ids) - 40, (), generator=gen))
    cue = _decode(tokenizer, list(doc.token_ids[at : at + 10])).strip()
    kind = i % 3
    if kind == 0:
        return f'In the documents above, what text comes right after "{cue}"? Quote it.'
    if kind == 1:
        return f'Which document mentions "{cue}"? Give its number and title, then explain.'
    return f"Summarize document {k + 1} ({doc.title}) in two sentences."


def chat_prompt(
    tokenizer: Any, system: str, preamble: str, docs: list[ChatDocument], question: str
) -> ChatPrompt:
    """The chat template over ``system`` and a user turn ``preamble``, the documents (each after
    a header line), ``question``; the assistant turn opened."""
    marks = [f"\x00DOC{k}\x00" for k in range(len(docs))]
    body = "".join(f"Document {k + 1} ({d.title}):\n{m}\n\n" for k, (d, m) in
                   enumerate(zip(docs, marks, strict=True)))  # fmt: skip
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{preamble}\n\n{body}{question}"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    spans = []
    for doc, mark in zip(docs, marks, strict=True):
        head, text = text.split(mark)
        ids += encode_text(tokenizer, head)
        spans.append((len(ids), len(ids) + len(doc.token_ids), doc.name))
        ids += doc.token_ids
    ids += encode_text(tokenizer, text)
    return ChatPrompt(tuple(ids), tuple(spans))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))
