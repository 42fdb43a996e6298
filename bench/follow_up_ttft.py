"""Follow-up time to first token on real vLLM: stock (prefix caching on) vs KMesh, and the
overhead KMesh adds to unannotated requests.

Workload (the issue's anchor): the 24-layer bench model (bf16 by default, as the stock-vLLM anchor;
``--dtype float32`` too; CPU, in-process engine), a shared
document D of 2,048 tokens, follow-ups = 64 private instruction tokens + D + 32 question tokens.
Prefix caching cannot help stock vLLM (the private part comes first). KMesh reads D once (the
first reader publishes its master), then each follow-up reuses it at recompute ratio 0.15.
The engines run in this process one after another (vLLM's KV connector is process-global): stock,
KMesh, stock again; each is warmed up first; requests go one at a time. TTFT = wall time of a
1-token generate.

``--model smollm2``: the same measurement on the real SmolLM2-135M-Instruct (bf16) with real text:
D = Python's own Language Reference text (`kmesh_blend.quality.text.reference_text`: the demo's
sections exceptions, raise, assert, then try) cut to 2,048 SmolLM2 tokens; every follow-up is a
ChatML chat prompt built with the model's chat template: a system prompt and a preamble of its
own before D, a question after it. The prompt is tokenized in pieces (template text before D, D's
tokens, template text after D), so D's tokens are the same in every prompt; the script asserts
that, and that the pieces decode to the templated text. Result name ``follow_up_ttft_smollm2``
(the bench model's stays ``follow_up_ttft``).

Both engines run with vLLM's prefix caching on (its default), otherwise the same settings.

value = median KMesh follow-up TTFT / median stock follow-up TTFT (goal ≤ 0.25).
config.ttft_vs_floor = median KMesh follow-up TTFT / its compute floor (goal ≤ 1.2), measured in
the same run: in the second stock phase, stock's cold prefill of a prompt holding as many tokens
as the blend computed for each follow-up (its private tokens + the reused ones it recomputed, from
its report), plus the share of stock's full prefill the tokens it did not compute cost up to the
check layer (``(last check layer + 1) / layers``, none at ratio 0 or 1.0).
config.ttft_vs_floor_all_keys = the same against a floor whose tokens attend to every key, as the
blend's computed tokens do: those fresh tokens after the follow-up's own head, which stock's
prefix cache holds from its measured prefill (cut to whole blocks, so they see up to a block
fewer keys; ``floor_all_keys_shape``: tokens computed, keys). The gap between the two floors is
the attention of the computed tokens over the reused ones, which the first floor leaves out.
config.unannotated_overhead = median KMesh-engine TTFT of unannotated prompts / stock − 1
(goal ≤ 3%); config.unannotated_cached_tokens: vLLM's prefix-cache hits (``num_cached_tokens``)
of every unannotated request on each engine (goal: equal).

``--workload mixed``: the unannotated request of each round is a chat sharing one 1,024-token
system prompt with every other chat (`_chats.shared_system_chats`), so stock vLLM's prefix cache
serves the system prompt to every chat after the first; interleaved with the annotated document
follow-ups. It shows that KMesh leaves exact-prefix reuse intact while it blends the families.
Result name gets ``_mixed``.
config.kmesh_vs_unannotated_same_engine = the same ratio against unannotated prompts measured
interleaved on the KMesh engine (the stock path there): a cross-check free of engine order.

Both engines run under tcmalloc by default, the allocator vLLM's CPU guide requires for
performance (``--allocator system`` for glibc's malloc; config.allocator says which ran).

``--drift-correction``: the KMesh engine's ``kmesh.drift_correction`` (default ``auto``, the
engine's default); ``off`` measures the blend without it, and the result name gets ``_nodrift``.
``--recompute-ratio R``: the KMesh engine's ``kmesh.recompute_ratio`` (default 0.15, the
issue's anchor); any other value adds ``_r<R>`` to the result name (the frontier's TTFT side at
the ratios `bench/quality.py` measures).

Run: python bench/follow_up_ttft.py [--quick] [--model bench|smollm2] [--workload families|mixed]
     [--drift-correction auto|off] [--recompute-ratio R]
     [--allocator tcmalloc|system]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _chats import shared_system_chats
from _common import cpu_flags, emit, plot_bars, progress, use_allocator
from _serving import attn_isa

from kmesh_blend.quality.text import DEMO_TOPICS, reference_text
from kmesh_blend.testing import BENCH_LLAMA, SMOLLM2, build_checkpoint, smollm2_checkpoint
from kmesh_blend.testing.engine import make_llm

RATIO = 0.15
DOCUMENT_TOPICS = (*DEMO_TOPICS, "try")  # ≈ 3,450 SmolLM2 tokens: enough for a 2,048 cut

Prompt = tuple[list[int], list[list[int]]]
"""A follow-up: token ids ``[T]`` and the shared document's half-open span ``[[start, end]]``."""


class Workload(NamedTuple):
    """What one run of the benchmark serves."""

    name: str  # result name: bench/results/<name>.json and .png
    model: str  # model name in the result
    label: str  # model in the plot title
    path: Path  # checkpoint directory
    doc_len: int  # tokens of the shared document
    rounds: list[tuple[Prompt, list[int]]]  # per round: annotated follow-up, unannotated one
    reader: Prompt  # the first reader: publishes the document's master
    warmup: Callable[[], list[int]]  # a fresh prompt for each unmeasured warm-up request
    tokens: int  # follow-up length (median over the annotated follow-ups)
    details: dict[str, Any]  # workload facts for the result's config


def bench_workload(doc_len: int, rounds: int) -> Workload:
    """Random tokens on the bench model: 64 private tokens + the document + 32 question tokens
    (seeded: the same prompts every run)."""
    path = build_checkpoint(BENCH_LLAMA)
    gen = torch.Generator().manual_seed(0)
    vocab = BENCH_LLAMA.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    doc = tokens(doc_len)

    def follow_up() -> Prompt:
        private, question = tokens(64), tokens(32)
        return private + doc + question, [[64, 64 + doc_len]]

    rounds_ids = [(follow_up(), follow_up()[0]) for _ in range(rounds)]
    reader = follow_up()
    return Workload(
        "follow_up_ttft", BENCH_LLAMA.name, "bench model", path, doc_len, rounds_ids, reader,
        lambda: tokens(doc_len + 96), doc_len + 96, {},
    )  # fmt: skip


# Chat follow-ups on SmolLM2: each its own system prompt (first words differ, so stock vLLM's
# prefix cache shares no block between two prompts), its own preamble and its own question.
SYSTEM_PROMPTS = [
    "You are a patient Python tutor who explains language rules with short examples.",
    "Act as a senior code reviewer; answer tersely and cite the relevant rule.",
    "As a technical writer, you answer in clear, plain English for beginners.",
    "Answer as an exam grader would: be precise and mention any edge cases.",
    "Be a helpful assistant for a team that is migrating a large codebase to Python 3.",
    "Imagine you are teaching an evening class on programming languages.",
    "Respond like a documentation maintainer who values accuracy above all.",
    "Your role: support engineer at a company that runs Python training courses.",
    "Playing the part of a compiler engineer, you explain semantics carefully.",
    "Keep your answers short; you are a chat assistant inside a code editor.",
    "Think like a language lawyer and quote the reference where it helps.",
    "Speak as a friendly mentor who is helping a junior developer.",
    "Work as an interview coach who prepares candidates for Python questions.",
    "Consider yourself a reference librarian for programming manuals.",
    "Pretend you are a static-analysis tool that explains its findings in prose.",
    "Serve as a teaching assistant who grades homework on Python statements.",
    "Help users of a notebook service understand the Python documentation.",
]
PREAMBLES = [
    "Here is an excerpt from the Python language reference. Please read it carefully, because "
    "my question depends on the exact wording.",
    "I copied the following section of the Python documentation for our discussion; it is "
    "long, but the details matter for what I want to ask.",
    "Below is some documentation a colleague sent me. I need help understanding it before "
    "our code review tomorrow morning.",
    "Use only the text below when you answer, and say so if the text does not cover my "
    "question at all.",
    "The following pages come from the official Python reference manual, as shipped with the "
    "interpreter I am using.",
    "Please study this reference material before answering my question; I will paste my "
    "question right after it.",
    "Context for my question, taken word for word from the Python documentation that ships "
    "with the standard library:",
]
QUESTIONS = [
    "What does the assert statement do when Python runs with optimization turned on?",
    "In two sentences, how does raise ... from ... differ from a plain raise?",
    "Which statements does this excerpt describe? List them briefly.",
    "What happens to an exception that no handler catches?",
    "What is the simple form of the assert statement equivalent to?",
    "Can a bare raise statement be used outside an except clause? Explain.",
    "Summarize the excerpt for a beginner in three bullet points.",
    "How does the text say exceptions are identified by class instances?",
]


def smollm2_prompts(doc_len: int, count: int) -> tuple[Path, list[Prompt], dict[str, Any]]:
    """SmolLM2 checkpoint, ``count`` chat follow-ups sharing one real-text document of
    ``doc_len`` tokens (the first is meant as its first reader), and the workload's facts.

    Each prompt is the model's chat template over a system prompt and a user message
    ``preamble + "\n\n" + document + "\n\n" + question`` (with the assistant turn opened). The
    template is rendered with a placeholder where the document goes; the text before and after it
    is tokenized on its own and the document's tokens are put in between, so the document is the
    same ``doc_len`` tokens at ``[start, start + doc_len)`` in every prompt.
    """
    from transformers import AutoTokenizer

    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    doc = encode(reference_text(DOCUMENT_TOPICS))[:doc_len]
    if len(doc) < doc_len:
        raise ValueError(f"the reference text {DOCUMENT_TOPICS} has fewer than {doc_len} tokens")
    doc_text = decode(doc)
    placeholder = "\x00DOCUMENT\x00"
    prompts: list[Prompt] = []
    for i in range(count):
        messages = [
            {"role": "system", "content": _system_prompt(i)},
            {
                "role": "user",
                "content": f"{PREAMBLES[i % len(PREAMBLES)]}\n\n{placeholder}\n\n"
                f"{QUESTIONS[(3 * i) % len(QUESTIONS)]}",
            },
        ]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = text.split(placeholder)  # exactly one placeholder
        head, tail = encode(before), encode(after)
        ids, start = head + doc + tail, len(head)
        assert ids[start : start + doc_len] == doc, "the document's tokens differ in a prompt"
        assert decode(ids) == before + doc_text + after, "the pieces do not spell the prompt"
        prompts.append((ids, [[start, start + doc_len]]))
    details = {
        "document_source": f"kmesh_blend.quality.text.reference_text({DOCUMENT_TOPICS}) "
        f"(pydoc_data.topics of Python {sys.version.split()[0]}), cut at {doc_len} SmolLM2 "
        "tokens",
        "chat_template": "the model's (ChatML): system prompt, user = preamble + document + "
        "question, assistant turn opened",
        "tokens_before_document": [spans[0][0] for _, spans in prompts],
        "tokens_after_document": [len(ids) - spans[0][1] for ids, spans in prompts],
    }
    return path, prompts, details


def _system_prompt(i: int) -> str:
    """Follow-up i's system prompt: past the list's end, one of them with the agent's number."""
    n = len(SYSTEM_PROMPTS)
    return SYSTEM_PROMPTS[i] if i < n else f"{SYSTEM_PROMPTS[i % n]} You are agent {i}."


def smollm2_workload(doc_len: int, rounds: int) -> Workload:
    """Chat follow-ups on SmolLM2 (`smollm2_prompts`): the first reader, then per round one
    annotated follow-up and one unannotated, all distinct."""
    path, prompts, details = smollm2_prompts(doc_len, 2 * rounds + 1)
    reader, rest = prompts[0], prompts[1:]
    rounds_ids = [(rest[2 * r], rest[2 * r + 1][0]) for r in range(rounds)]
    lengths = [len(ids) for (ids, _), _ in rounds_ids]
    gen = torch.Generator().manual_seed(0)
    warm_len = int(statistics.median(lengths))

    def warmup() -> list[int]:  # random tokens (ids ≥ 3: no ChatML special tokens)
        return torch.randint(3, 49152, (warm_len,), generator=gen).tolist()

    return Workload(
        "follow_up_ttft_smollm2", SMOLLM2, SMOLLM2, path, doc_len, rounds_ids, reader, warmup,
        warm_len, {**details, "follow_up_tokens": lengths},
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--model",
        default="bench",
        choices=["bench", "smollm2"],
        help="bench: the random-weight bench model on random tokens (default); smollm2: "
        "SmolLM2-135M-Instruct on chat prompts around real text",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--workload",
        default="families",
        choices=["families", "mixed"],
        help="families: unannotated prompts are other follow-ups (no shared prefix); mixed: "
        "they are chats sharing a 1,024-token system prompt",
    )
    parser.add_argument(
        "--allocator",
        default="tcmalloc",
        choices=["tcmalloc", "system"],
        help="tcmalloc (vLLM's documented CPU setup, default) or the system malloc",
    )
    parser.add_argument("--drift-correction", default="auto", choices=["auto", "off"],
                        help="the KMesh engine's kmesh.drift_correction")  # fmt: skip
    parser.add_argument("--recompute-ratio", type=float, default=RATIO,
                        help=f"kmesh.recompute_ratio (default {RATIO})")  # fmt: skip
    args = parser.parse_args()
    allocator = use_allocator(args.allocator)
    doc_len = 512 if args.quick else 2048
    rounds = 2 if args.quick else 6
    from vllm import SamplingParams

    make_workload = bench_workload if args.model == "bench" else smollm2_workload
    work = make_workload(doc_len, rounds)
    if args.workload == "mixed":
        chats, chat_details = shared_system_chats(args.model, work.path, rounds, system_len=1024)
        work = work._replace(
            name=f"{work.name}_mixed",
            rounds=[(pair[0], chat) for pair, chat in zip(work.rounds, chats, strict=True)],
            details={**work.details, **chat_details},
        )
    if args.drift_correction == "off":
        work = work._replace(name=f"{work.name}_nodrift")
    ratio = args.recompute_ratio
    if not 0.0 <= ratio <= 1.0:
        parser.error(f"--recompute-ratio must be in [0, 1], got {ratio}")
    if ratio != RATIO:
        work = work._replace(name=f"{work.name}_r{ratio:g}")

    def ttft(llm: Any, ids: list[int], spans: list[list[int]] | None) -> tuple[float, Any]:
        extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if spans else None
        sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    common = {"max_model_len": 4096, "max_num_batched_tokens": 4096, "dtype": args.dtype}
    times: dict[str, list[float]] = {"stock": [], "kmesh": [], "stock_plain": [], "kmesh_plain": []}
    # vLLM's prefix-cache hits of each unannotated request, per engine run
    cached: dict[str, list[list[int]]] = {"stock": [], "kmesh": []}

    floor_prompts: list[list[int]] = []  # per round: as many fresh tokens as the blend computed
    floor_s: list[float] = []
    # The floor with the blend's attention span: those tokens after the prompt's cached head
    all_keys_s: list[float] = []
    all_keys_shape: list[tuple[int, int]] = []  # (tokens computed, keys they attend to)

    def run_stock() -> None:
        stock = make_llm(work.path, **common)
        block = int(stock.llm_engine.vllm_config.cache_config.block_size)  # prefix-cache unit
        for _ in range(3):  # warm-up, unmeasured
            ttft(stock, work.warmup(), None)
        hits = []
        for r, ((ids, _), plain) in enumerate(progress(work.rounds, "stock rounds")):
            times["stock"].append(ttft(stock, ids, None)[0])
            t, out = ttft(stock, plain, None)
            times["stock_plain"].append(t)
            hits.append(int(out.num_cached_tokens or 0))
            if floor_prompts:
                floor_s.append(ttft(stock, floor_prompts[r], None)[0])
                # The same tokens after this prompt's cached head: they attend to every key.
                fresh = floor_prompts[r]
                head = (len(ids) - len(fresh)) // block * block
                t, out = ttft(stock, ids[:head] + fresh, None)
                all_keys_s.append(t)
                all_keys_shape.append((len(fresh) + head - int(out.num_cached_tokens or 0),
                                       len(fresh) + head))  # fmt: skip
        cached["stock"].append(hits)
        del stock
        gc.collect()

    # Engines run one after another (vLLM's KV connector is process-global): stock, KMesh, then
    # stock again, so neither side gains from the order (the first engine of a process is slower).
    run_stock()

    # Phase 2: the same engine settings with KMesh.
    kmesh = make_llm(
        work.path,
        kv_transfer_config={
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "kmesh.store": "cpu",
                "kmesh.recompute_ratio": ratio,
                "kmesh.drift_correction": args.drift_correction,
            },
        },
        **common,
    )
    for _ in range(3):  # warm-up, unmeasured
        ttft(kmesh, work.warmup(), None)
    _, reader = ttft(kmesh, *work.reader)  # publishes the document's master
    reports, hits = [], []
    for (ids, spans), plain in progress(work.rounds, "kmesh rounds"):
        t, out = ttft(kmesh, ids, spans)
        times["kmesh"].append(t)
        reports.append(out.kv_transfer_params["kmesh"])
        t, out = ttft(kmesh, plain, None)
        times["kmesh_plain"].append(t)
        hits.append(int(out.num_cached_tokens or 0))
    cached["kmesh"].append(hits)
    del kmesh
    gc.collect()
    computed = [len(ids) - r["reused_tokens"] + r["recomputed_tokens"]
                for ((ids, _), _), r in zip(work.rounds, reports, strict=True)]  # fmt: skip
    floor_prompts.extend(work.warmup()[:n] for n in computed)
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()  # lets a connector-free engine start in this process again
    run_stock()
    med = {k: statistics.median(v) for k, v in times.items()}
    value = med["kmesh"] / med["stock"]
    upto = check_share(work.path, ratio)  # the share of layers every token passes
    floors = [f + upto * max(0.0, med["stock"] - f) for f in floor_s]
    vs_floor = med["kmesh"] / statistics.median(floors)
    floors_all = [f + upto * max(0.0, med["stock"] - f) for f in all_keys_s]
    vs_floor_all = med["kmesh"] / statistics.median(floors_all)
    same_engine = med["kmesh"] / med["kmesh_plain"]
    overhead = med["kmesh_plain"] / med["stock_plain"] - 1.0
    print(f"follow-up of {work.tokens} tokens, {rounds} rounds (medians):")
    print(f"  stock vLLM (prefix caching on): {med['stock']:.3f} s")
    print(f"  KMesh reuse at ratio {ratio}:     {med['kmesh']:.3f} s  = {value:.3f}x of stock")
    print(f"  vs unannotated requests on the same engine (interleaved): {same_engine:.3f}x")
    print(f"  compute floor (stock prefill of {statistics.median(computed):g} tokens, + "
          f"{upto:.3f} of the rest): {statistics.median(floors):.3f} s; KMesh / floor "
          f"{vs_floor:.3f}x")  # fmt: skip
    print(f"  the same tokens over every key (after the prompt's cached head, {all_keys_shape}):"
          f" {statistics.median(floors_all):.3f} s; KMesh / that {vs_floor_all:.3f}x")  # fmt: skip
    print(f"  reports: {reports}")
    print(f"  unannotated: stock {med['stock_plain']:.3f} s, KMesh engine "
          f"{med['kmesh_plain']:.3f} s ({overhead:+.1%})")  # fmt: skip
    hits_equal = all(run == cached["kmesh"][0] for run in cached["stock"])
    print(f"  prefix-cache hits of unannotated requests: stock {cached['stock']}, KMesh "
          f"{cached['kmesh']} ({'equal' if hits_equal else 'DIFFERENT'})")  # fmt: skip
    plot_bars(
        work.name,
        ["stock", "kmesh", "stock unannotated", "kmesh unannotated"],
        [med["stock"], med["kmesh"], med["stock_plain"], med["kmesh_plain"]],
        f"follow-up TTFT, {doc_len}-token shared document, {work.label}, vLLM CPU"
        + (", with chats sharing a system prompt" if args.workload == "mixed" else ""),
    )
    emit(
        {
            "name": work.name,
            "metric": "KMesh follow-up TTFT / stock vLLM follow-up TTFT",
            "value": round(value, 4),
            "unit": "x",
            "goal": 0.25,
            "baseline": "stock vLLM with prefix caching, same process, same prompts",
            "quick": args.quick,
            "config": {
                "model": work.model,
                "dtype": args.dtype,
                "allocator": allocator,
                "attn_isa": attn_isa(args.dtype, 128, head_size(work.path)),
                "cpu": cpu_flags(),
                "document": doc_len,
                "tokens": work.tokens,
                "recompute_ratio": ratio,
                "drift_correction": args.drift_correction,
                "seconds_median": {k: round(v, 4) for k, v in med.items()},
                "ttft_vs_floor": round(vs_floor, 4),
                "ttft_vs_floor_goal": 1.2,
                "floor_s_median": round(statistics.median(floors), 4),
                "floor_computed_tokens": computed,
                "floor_check_share": round(upto, 4),
                "ttft_vs_floor_all_keys": round(vs_floor_all, 4),
                "floor_all_keys_s_median": round(statistics.median(floors_all), 4),
                "floor_all_keys_shape": all_keys_shape,
                "kmesh_vs_unannotated_same_engine": round(same_engine, 4),
                "unannotated_overhead": round(overhead, 4),
                "unannotated_overhead_goal": 0.03,
                "unannotated_cached_tokens": cached,
                "unannotated_cached_tokens_equal": hits_equal,
                "workload": args.workload,
                "prefix_caching": "on in both engines",
                "reused_tokens": [r["reused_tokens"] for r in reports],
                "first_reader_report": reader.kv_transfer_params["kmesh"],
                **work.details,
            },
        }
    )


def check_share(path: Path, ratio: float) -> float:
    """The share of the model's layers every prompt token passes in a blend at ``ratio``: up to
    and including the engine's last check layer (its default `KMeshConfig.check_layers`); 0 where
    no check layer runs (ratio 0 or 1.0)."""
    from kmesh_blend.config import KMeshConfig

    if ratio <= 0.0 or ratio >= 1.0:
        return 0.0
    layers = int(_hf_config(path)["num_hidden_layers"])
    return (max(KMeshConfig().check_layers) + 1) / layers


def head_size(path: Path) -> int:
    """The checkpoint's attention head size (what vLLM's CPU kernel choice depends on)."""
    config = _hf_config(path)
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _hf_config(path: Path) -> dict[str, Any]:
    import json

    return dict(json.loads((path / "config.json").read_text()))


if __name__ == "__main__":
    main()
