"""The main demo: KMesh reuses a shared document inside real vLLM, on a real pretrained model.

Model: SmolLM2-135M-Instruct in bf16 (shipped as a wheel, converted once; nothing is downloaded).
Document: three sections of the Python Language Reference as they ship with Python in
``pydoc_data.topics`` — "Exceptions", "The raise statement" and "The assert statement"
(topics ``exceptions``, ``raise``, ``assert``; footnotes and version notes dropped), about
1,500 tokens.

Follow-ups are chats through the model's own chat template: each has its own system prompt and
its own lead-in *before* the document and its own question *after* it, so prefix caching cannot
help and the document sits at a different position in every prompt. The document's token span is
computed per prompt from the pieces (template head, document, template tail, each tokenized on
its own); the demo checks that tokenizing each whole prompt gives the same ids, so the document's
tokens are the same in every prompt, and stops otherwise.

1. Stock vLLM (bf16, prefix caching on, one request at a time) answers the four follow-ups
   after a short warm-up request; TTFT is each request's engine-measured first-token latency
   (``RequestOutput.metrics``).
2. vLLM with the KMesh connector (store ``cpu``, recompute ratio 0.15): the first reader (its own
   system prompt and question) publishes the document, then the four follow-ups reuse it. Printed
   per follow-up: the question, stock's and KMesh's answers side by side (48 greedy tokens at
   most), the reuse report; then the median follow-up TTFT, KMesh / stock.
3. vLLM with KMesh at recompute ratio 1.0: after the first reader, the first follow-up's first
   16 tokens must equal stock's exactly. One short follow-up only: on a 2-core AVX2 CPU a bf16
   prefill of the document takes ~20 s and the demo should finish in about three minutes
   (tests/vllm/test_own_model.py checks ratio 1.0 against stock on more prompts).

vLLM's, LMCache's and the libraries' log lines go to ``.kmesh-demo.log`` at the repository root
(named in the output), not to the terminal. Exit status 1 on a mismatch or a failed check.

Run: ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOG_FILE = Path(__file__).resolve().parent.parent / ".kmesh-demo.log"

# Before vllm, transformers or lmcache are imported: their logging reads these at import time.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM logs through the root logger below
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import gc  # noqa: E402
import statistics  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

from kmesh_blend.quality.text import DEMO_TOPICS, reference_text  # noqa: E402

RATIO = 0.15
MAX_TOKENS = 48
NUM_EXACT = 1  # follow-ups checked at ratio 1.0; each costs a full prefill
EXACT_TOKENS = 16  # tokens each of them generates and compares with stock's first ones
TOPICS = DEMO_TOPICS
COLUMN = 50  # characters per answer column

READER = (
    "You are a librarian who files reference documents.",
    "File the following section of the Python Language Reference:",
    "Reply with one word: filed.",
)
FOLLOW_UPS = (
    (
        "You are a concise Python tutor. Answer in one or two sentences.",
        "Use this excerpt from the Python Language Reference to answer the question after it:",
        "What does a bare raise statement, with no expression, do?",
    ),
    (
        "You are a senior engineer reviewing a beginner's code. Be brief and exact.",
        "Here is the part of the Python documentation the beginner was reading:",
        "What happens to assert statements when Python runs with the -O option?",
    ),
    (
        "You answer questions about Python precisely, quoting the reference where you can.",
        "Reference text follows:",
        "In 'raise X from Y', which attribute of the new exception holds Y?",
    ),
    (
        "You are a friendly teacher explaining Python to students who are new to programming.",
        "Read this page from the Python reference with me:",
        "What does the interpreter do when an exception is not handled at all?",
    ),
)


class Prompt(NamedTuple):
    """One chat prompt as token ids [num_tokens], the document's half-open span and its question."""

    ids: list[int]
    span: tuple[int, int]
    question: str


class Request(NamedTuple):
    """One generate call: prompt ids, the shared spans to annotate (None: no annotation) and how
    many tokens to generate."""

    ids: list[int]
    spans: list[list[int]] | None
    max_tokens: int


class Answer(NamedTuple):
    """One request's outcome: generated ids, text, TTFT (s) and the kmesh report (or None)."""

    ids: list[int]
    text: str
    ttft: float
    report: dict[str, Any] | None


def main() -> int:
    t0 = time.perf_counter()
    from kmesh_blend.testing import smollm2_checkpoint

    path = smollm2_checkpoint()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    document = load_document()
    reader, *follow_ups = build_prompts(tokenizer, document, (READER, *FOLLOW_UPS))
    start, end = reader.span
    print(f"model: SmolLM2-135M-Instruct, bf16 ({path})")
    print(f"document: pydoc_data.topics {', '.join(TOPICS)}: {end - start} tokens")
    print(f"prompts: {', '.join(str(len(p.ids)) for p in (reader, *follow_ups))} tokens; "
          f"document at {', '.join(str(p.span[0]) for p in (reader, *follow_ups))}; "
          "its tokens identical in every prompt")  # fmt: skip
    print(f"logs: {LOG_FILE}")

    print("\n[1/3] stock vLLM (bf16, prefix caching on, one request at a time)", flush=True)
    warm_up = Request(reader.ids[:64], None, 1)  # unmeasured; the first request of an engine
    stock = run_engine(path, tokenizer, None, [warm_up, *_requests(follow_ups, annotate=False)])
    stock = stock[1:]
    print(f"  follow-up TTFT: {_times(stock)}")

    print(f"\n[2/3] vLLM + KMesh (store cpu, recompute ratio {RATIO})", flush=True)
    publish = Request(reader.ids, [list(reader.span)], 1)  # the first reader: 1 token is enough
    first, *kmesh = run_engine(path, tokenizer, RATIO, [publish, *_requests(follow_ups)])
    print(f"  first reader publishes the document: {first.report}")
    for i, (prompt, s, k) in enumerate(zip(follow_ups, stock, kmesh, strict=True), 1):
        print(f"\n  follow-up {i}: {prompt.question}")
        print(_side_by_side("stock vLLM", s.text, "KMesh", k.text))
        print(f"    reuse report: {k.report}")
        print(f"    TTFT: stock {s.ttft:.3f} s, KMesh {k.ttft:.3f} s")
    ratio = _median(kmesh) / _median(stock)
    print(f"\n  median follow-up TTFT: KMesh {_median(kmesh):.3f} s / stock {_median(stock):.3f} s"
          f" = {ratio:.2f}x")  # fmt: skip
    doc_len = end - start
    reused = all(
        a.report is not None
        and a.report["reused_tokens"] == doc_len
        and a.report["fallback"] is None
        for a in kmesh
    )
    if not reused:
        print(f"  FAILED: not every follow-up reused the {doc_len}-token document")

    # A full prefill costs ~20 s here (bf16 on AVX2): one short follow-up keeps the demo short.
    print("\n[3/3] vLLM + KMesh at recompute ratio 1.0: tokens must equal stock vLLM's", flush=True)
    checked = follow_ups[:NUM_EXACT]
    requests = [r._replace(max_tokens=EXACT_TOKENS) for r in _requests(checked)]
    exact = run_engine(path, tokenizer, 1.0, [publish, *requests])[1:]
    same = [a.ids == s.ids[:EXACT_TOKENS] for a, s in zip(exact, stock, strict=False)]
    for i, (a, ok) in enumerate(zip(exact, same, strict=True), 1):
        verdict = "equal to stock" if ok else "MISMATCH with stock"
        print(f"  follow-up {i}: {len(a.ids)} tokens {verdict}; report {a.report}")
    ok = reused and all(same)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s (three engines, one after another)")
    print("RESULT: OK" if ok else "RESULT: MISMATCH")
    return 0 if ok else 1


def load_document() -> str:
    """The document every request shares (`kmesh_blend.quality.text.reference_text`)."""
    return reference_text(TOPICS)


def build_prompts(
    tokenizer: Any, document: str, chats: tuple[tuple[str, str, str], ...]
) -> list[Prompt]:
    """Token ids of each (system prompt, lead-in, question) chat around ``document``.

    The templated text is cut at the document; head, document and tail are tokenized on their
    own and concatenated, so the document's ids are the same in every prompt. Raises
    ``RuntimeError`` when that differs from tokenizing the whole templated text (the document's
    tokens would then depend on their neighbours) or when the document's ids differ anywhere.
    """
    marker = "\x00DOCUMENT\x00"

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    doc_ids = encode(document)
    prompts = []
    for system, lead_in, question in chats:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"{lead_in}\n{marker}\n{question}"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = text.split(marker)
        head_ids = encode(head)
        ids = head_ids + doc_ids + encode(tail)
        if ids != encode(head + document + tail):
            raise RuntimeError(
                f"tokenizing the prompt for {question!r} whole differs from tokenizing its pieces:"
                " the document's tokens depend on the text around it"
            )
        span = (len(head_ids), len(head_ids) + len(doc_ids))
        if ids[span[0] : span[1]] != doc_ids:
            raise RuntimeError(f"the document's tokens differ in the prompt for {question!r}")
        prompts.append(Prompt(ids, span, question))
    return prompts


def run_engine(
    path: Path, tokenizer: Any, ratio: float | None, requests: list[Request]
) -> list[Answer]:
    """Start an engine (stock when ``ratio`` is None, else KMesh at that recompute ratio), run
    ``requests`` one at a time, close it."""
    from vllm import SamplingParams

    from kmesh_blend.testing.engine import make_llm

    extra: dict[str, Any] = {}
    if ratio is not None:
        extra["kv_transfer_config"] = {
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kmesh.store": "cpu", "kmesh.recompute_ratio": ratio},
        }
    t0 = time.perf_counter()
    llm = make_llm(path, dtype="bfloat16", disable_log_stats=False, **extra)
    print(f"  engine started in {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        answers = []
        for request in requests:
            kv = None if request.spans is None else {"kmesh": {"segments": request.spans}}
            params = SamplingParams(
                temperature=0.0,
                max_tokens=request.max_tokens,
                extra_args=None if kv is None else {"kv_transfer_params": kv},
            )
            (out,) = llm.generate([{"prompt_token_ids": request.ids}], params, use_tqdm=False)
            ids = list(out.outputs[0].token_ids)
            answers.append(
                Answer(
                    ids,
                    tokenizer.decode(ids, skip_special_tokens=True).strip(),
                    float(out.metrics.first_token_latency),  # engine-measured, from arrival
                    (out.kv_transfer_params or {}).get("kmesh"),
                )
            )
        return answers
    finally:
        del llm
        gc.collect()


def _requests(prompts: list[Prompt], annotate: bool = True) -> list[Request]:
    """Follow-up requests: ``MAX_TOKENS`` greedy tokens, annotated with the document's span."""
    return [Request(p.ids, [list(p.span)] if annotate else None, MAX_TOKENS) for p in prompts]


def _side_by_side(left_title: str, left: str, right_title: str, right: str) -> str:
    lines_l = [left_title, "-" * len(left_title), *textwrap.wrap(left, COLUMN)]
    lines_r = [right_title, "-" * len(right_title), *textwrap.wrap(right, COLUMN)]
    rows = max(len(lines_l), len(lines_r))
    lines_l += [""] * (rows - len(lines_l))
    lines_r += [""] * (rows - len(lines_r))
    return "\n".join(f"    {a:<{COLUMN}} | {b}" for a, b in zip(lines_l, lines_r, strict=True))


def _median(answers: list[Answer]) -> float:
    return statistics.median(a.ttft for a in answers)


def _times(answers: list[Answer]) -> str:
    return ", ".join(f"{a.ttft:.3f} s" for a in answers)


def _quiet() -> Any:
    """Send the root logger and everything written to file descriptor 2 (vLLM, LMCache, torch,
    warnings, C++ libraries) to ``LOG_FILE``; return a stream on the terminal's stderr."""
    console = os.fdopen(os.dup(2), "w")
    log = open(LOG_FILE, "w")  # noqa: SIM115 - open for the life of the process
    os.dup2(log.fileno(), 2)
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    return console


if __name__ == "__main__":
    terminal = _quiet()
    try:
        code = main()
    except Exception:
        traceback.print_exc(file=terminal)
        print(f"(full logs: {LOG_FILE})", file=terminal)
        code = 1
    sys.exit(code)
