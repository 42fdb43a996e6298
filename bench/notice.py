"""The application notice: a follow-up's wait for its masters with vs without a notice (one
request of its family sent ahead: every request with a ``family`` holds its segments for it).

Real SmolLM2-135M-Instruct (bf16) through real vLLM with KMesh on an ``lm://`` store (LMCache's
server as a separate process, started here). A first engine reads 2·N real-text documents
(sections of the Python Reference, a different set per document) and stores their masters, then
exits. A second engine (host-RAM retention empty, as after a restart or on another replica)
serves, for each pair of documents, one chat follow-up of the first document as is, and one of
the second after a request of its family that reads the document (sent ahead, not timed). Measured
side by side in that engine: the follow-up's ``load_ms`` (its report: time spent getting its
masters) and its TTFT (``max_tokens=1``).

Result: median ``load_ms`` with the notice / without (goal ≤ 0.5×), TTFTs next to it.

Run: ``.venv/bin/python bench/notice.py [--quick] [--pairs 3] [--doc-len 2048]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, use_allocator

from kmesh_blend.quality.text import reference_text
from kmesh_blend.testing import smollm2_checkpoint
from kmesh_blend.testing.engine import make_llm
from kmesh_blend.testing.services import free_port, wait_port

Prompt = tuple[list[int], list[list[int]]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="2 pairs of 512-token documents")
    args = parser.parse_args()
    pairs, doc_len = (2, 512) if args.quick else (args.pairs, args.doc_len)
    allocator = use_allocator("tcmalloc")  # vLLM's documented CPU set-up, as the other benches
    path = smollm2_checkpoint()
    readers, follow_ups = _prompts(path, 2 * pairs, doc_len)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    try:
        wait_port(port, server)
        config = {
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kmesh.store": f"lm://127.0.0.1:{port}"},
        }
        common = {"dtype": "bfloat16", "max_model_len": 4096, "max_num_batched_tokens": 4096,
                  "kv_transfer_config": config}  # fmt: skip
        writer = make_llm(path, **common)
        for ids, spans in readers:  # each document stored once
            _ask(writer, ids, {"segments": spans})
        del writer
        gc.collect()
        llm = make_llm(path, **common)
        # Warm-up, unmeasured, on a prompt no measured request shares a prefix with (a shared
        # one would be served from vLLM's prefix cache and skip the blend).
        _ask(llm, *_plain(readers[0]))
        rows: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
        for i in range(pairs):
            plain_doc, prepared_doc = follow_ups[2 * i], follow_ups[2 * i + 1]
            rows["without"].append(_ask(llm, plain_doc[0], {"segments": plain_doc[1],
                                                            "family": f"a{i}"}))  # fmt: skip
            _ask(llm, readers[2 * i + 1][0], {"segments": readers[2 * i + 1][1],
                                              "family": f"b{i}"}, notice=True)  # fmt: skip
            rows["with"].append(_ask(llm, prepared_doc[0], {"segments": prepared_doc[1],
                                                            "family": f"b{i}"}))  # fmt: skip
            print(f"pair {i}: without notice load {rows['without'][-1][0]:.1f} ms, TTFT "
                  f"{rows['without'][-1][1]:.3f} s; with notice load {rows['with'][-1][0]:.1f} "
                  f"ms, TTFT {rows['with'][-1][1]:.3f} s", flush=True)  # fmt: skip
        del llm
        gc.collect()
    finally:
        server.terminate()
        server.wait(timeout=30)
    load = {k: statistics.median(r[0] for r in v) for k, v in rows.items()}
    ttft = {k: statistics.median(r[1] for r in v) for k, v in rows.items()}
    emit({
        "name": "notice",
        "metric": "follow-up load_ms with notice / without (median)",
        "value": round(load["with"] / load["without"], 4),
        "unit": "x",
        "goal": 0.5,
        "baseline": "the same engine, a follow-up whose family sent no notice",
        "quick": args.quick,
        "config": {"model": "SmolLM2-135M-Instruct bf16", "store": "lm:// (LMCache server)",
                   "allocator": allocator,
                   "doc_len": doc_len, "pairs": pairs, "load_ms": load, "ttft_s": ttft,
                   "ttft_ratio": round(ttft["with"] / ttft["without"], 4),
                   "rows": rows},
    })  # fmt: skip


def _ask(llm: Any, ids: list[int], kmesh: dict[str, Any] | None,
         notice: bool = False) -> tuple[float, float]:  # fmt: skip
    """(the report's load_ms, TTFT in s) of one request with ``max_tokens=1``; a follow-up
    (not a ``notice``) must reuse its document."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kmesh": kmesh}} if kmesh else None
    sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    spent = time.perf_counter() - start
    report = (out.kv_transfer_params or {}).get("kmesh", {})
    if kmesh and kmesh.get("family") and not notice and not report.get("reused_tokens"):
        raise RuntimeError(f"a follow-up did not reuse its document: {report}")
    return float(report.get("load_ms", 0.0)), spent


def _plain(prompt: Prompt) -> tuple[list[int], None]:
    return prompt[0], None


def _prompts(path: Path, count: int, doc_len: int) -> tuple[list[Prompt], list[Prompt]]:
    """``count`` distinct real-text documents of ``doc_len`` SmolLM2 tokens, each in two chat
    prompts (its reader, its follow-up) with their own system prompt and question."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    names = sorted(topics)
    docs: list[list[int]] = []
    while len(docs) < count:
        ids: list[int] = []
        while len(ids) < doc_len:
            ids += encode(reference_text((names.pop(0),)) + "\n\n")
        docs.append(ids[:doc_len])
    placeholder = "\x00DOCUMENT\x00"

    def chat(system: str, question: str, doc: list[int]) -> Prompt:
        user = f"Read this.\n\n{placeholder}\n\n{question}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = text.split(placeholder)
        head = encode(before)
        return head + doc + encode(after), [[len(head), len(head) + len(doc)]]

    readers = [chat("You summarise documents.", "Summarise it.", d) for d in docs]
    system, question = "You review Python documentation.", "Which statement comes first?"
    follow_ups = [chat(system, question, d) for d in docs]
    return readers, follow_ups


if __name__ == "__main__":
    main()
