"""The reuse-quality report: per setting, how close reuse comes to the full prefill on a model,
and what it saves, measured through a vLLM engine with the KMesh connector (the served path).

Engine: the checkpoint in fp32, in-process vLLM with the KMesh connector (``cpu`` store, prefix
caching off so stock timings are full prefills). Answers are greedy, at most `ANSWER_TOKENS`
tokens, ending with the turn (the tokenizer's end-of-sequence token).

1. Quality (`kmesh_blend.quality.chat_harness`) on the model the engine loaded — the blend's own
   `VllmModel`, i.e. vLLM's modules and weights: every setting of `frontier.rule_settings`
   against the full prefill's greedy answer, teacher-forced (top-1 agreement, KL, identical
   answers, standard errors clustered by task).
2. Through the served path: each document's reader request stores its master; follow-ups are
   sent unannotated (vLLM's own full prefill) and annotated with each per-request setting of
   their own (``recompute_ratio`` / ``sink_tokens`` in the annotation): time to first token per
   setting (1-token generates, settings interleaved per follow-up), and for `SERVED_ANSWERS` the
   share of whole greedy answers equal to vLLM's full prefill's.
3. The yardstick: the same full prefills on a second engine in bf16, scored against the fp32
   answers — how much the model's own numerics move them — and the share of near-tie positions.

`run` returns the result in the shape of the benchmark results (``name``, ``metric``, ``value``,
``config``); ``config.recommended`` is `frontier.recommend`'s choice.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kmesh_blend.quality.chat import ChatPrompt, ChatTask
from kmesh_blend.quality.frontier import nominal, recommend, rule_settings
from kmesh_blend.quality.harness import Setting

__all__ = ["ANSWER_TOKENS", "close", "engine", "run"]

ANSWER_TOKENS = 32
SERVED_ANSWERS = ("deviation 0.15", "sink 0.15", "deviation+drift 0.15")
NEAR_TIE_GAPS = (0.1, 0.5)
Log = Callable[[str], None]


def run(checkpoint: str | Path, tasks: Sequence[ChatTask], *, check_layers: tuple[int, ...],
        quick: bool, log: Log, target: float | None = None, max_ttft: float = 1.0,
        timed_per_task: int = 2) -> dict[str, Any]:  # fmt: skip
    """Measure every setting on ``tasks`` (see the module docstring). ``target``: the agreement
    the recommendation must reach (None: the bf16 full prefill's); ``max_ttft``: the largest
    follow-up TTFT / stock that still pays."""
    from transformers import AutoTokenizer

    from kmesh_blend.quality.chat_harness import evaluate_chat, near_ties, references

    began = time.perf_counter()
    lengths = [len(d.token_ids) for t in tasks for d in t.documents]
    doc_tokens = int(statistics.median(lengths))
    settings = rule_settings(doc_tokens, quick)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    stop = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    max_len = max(len(p.token_ids) for t in tasks for p in (*t.readers, *t.requests))
    max_len += ANSWER_TOKENS + 8
    llm, model = engine(checkpoint, check_layers, max_len)
    try:
        refs = references(model, list(tasks), ANSWER_TOKENS, log, stop)
        report = evaluate_chat(model, list(tasks), settings, check_layers, ANSWER_TOKENS, log,
                               refs=refs, stop_ids=stop)  # fmt: skip
        per_request = [s for s in settings if s.selection == "per_request"]
        serving = _served(llm, tasks, per_request, doc_tokens, timed_per_task, log)
    finally:
        close(llm)
    floor = _precision_floor(checkpoint, tasks, refs, max_len, log)
    exact = report.result(Setting(1.0))
    if not (exact.agreement == 1.0 and exact.kl == 0.0 and exact.identical_answers == 1.0):
        raise SystemExit(f"ratio 1.0 is not identical to full prefill: {exact}")
    table = [_row(r, doc_tokens, serving["ttft_vs_stock"]) for r in report.results]
    goal = floor["agreement"] if target is None else target
    return {
        "metric": "top-1 agreement with full prefill (multi-document chat)",
        "unit": "fraction",
        "baseline": "full prefill, same engine",
        "quick": quick,
        "config": {
            "model": f"{Path(checkpoint).name} (fp32), vLLM in-process, prefix caching off",
            "check_layers": list(check_layers),
            "tasks": report.num_tasks,
            "follow_ups": report.num_requests,
            "positions": report.num_positions,
            "documents_per_follow_up": {
                str(k): report.documents.count(k) for k in sorted(set(report.documents))
            },
            "document_tokens": doc_tokens,
            "answer_tokens": ANSWER_TOKENS,
            "se": "clustered by task (families share documents and one group blend)",
            "reference_flips": report.reference_flips,
            "bf16_full_prefill_vs_fp32": floor,
            "near_ties": {str(g): round(v, 4) for g, v in near_ties(refs, NEAR_TIE_GAPS).items()},
            "recommended": recommend(table, goal, max_ttft),
            "max_ttft": max_ttft,
            "table": table,
            **serving,
            "seconds": round(time.perf_counter() - began, 1),
        },
    }


def _row(r: Any, doc_tokens: int, ttft: dict[str, float]) -> dict[str, Any]:
    label = nominal(r.setting, doc_tokens)
    return {
        "rule": r.setting.rule,
        "nominal": label,
        "selection": r.setting.selection,
        "ratio": round(r.setting.ratio, 4),
        "sink_tokens": r.setting.sink_tokens,
        "drift_correction": r.setting.drift,
        "recomputed": round(r.recomputed, 4),
        "agreement": round(r.agreement, 4),
        "agreement_se": round(r.agreement_se, 4),
        "kl": float(f"{r.kl:.4g}"),
        "kl_se": float(f"{r.kl_se:.3g}"),
        "identical_answers": round(r.identical_answers, 4),
        "answer_prefix": round(r.answer_prefix, 4),
        "blend_s_per_family": round(r.blend_s, 3),
        "agreement_by_question": {k: round(v, 4) for k, v in r.agreement_by_kind.items()},
        "ttft_vs_stock": ttft.get(label) if r.setting.selection == "per_request" else None,
    }


def _served(llm: Any, tasks: Sequence[ChatTask], settings: list[Setting], doc_tokens: int,
            timed_per_task: int, log: Log) -> dict[str, Any]:  # fmt: skip
    """TTFT per setting (and stock), and served greedy-answer identity (see the docstring)."""
    from vllm import SamplingParams

    def generate(prompt: ChatPrompt, setting: Setting | None, tokens: int) -> Any:
        extra = None
        if setting is not None:
            own = {"recompute_ratio": setting.ratio, "sink_tokens": setting.sink_tokens,
                   "drift_correction": setting.drift}  # fmt: skip
            extra = {"kv_transfer_params": {"kmesh": {**prompt.annotation(), **own}}}
        p = SamplingParams(temperature=0.0, max_tokens=tokens, extra_args=extra)
        (out,) = llm.generate([{"prompt_token_ids": list(prompt.token_ids)}], p, use_tqdm=False)
        return out

    for task in tasks:  # the first readers store every document's master
        for reader in task.readers:
            generate(reader, Setting(0.0), 1)
    follow_ups = [r for t in tasks for r in t.requests]
    timed = [r for t in tasks for r in t.requests[:timed_per_task]]
    labels = ["stock"] + [nominal(s, doc_tokens) for s in settings]
    times: dict[str, list[float]] = {label: [] for label in labels}
    reports: dict[str, list[dict[str, Any]]] = {label: [] for label in labels[1:]}
    generate(timed[0], None, 1)  # warm-up
    for n, prompt in enumerate(timed):
        for label, setting in zip(labels, [None, *settings], strict=True):
            start = time.perf_counter()
            out = generate(prompt, setting, 1)
            times[label].append(time.perf_counter() - start)
            if setting is not None:
                reports[label].append((out.kv_transfer_params or {}).get("kmesh") or {})
        log(f"TTFT: follow-up {n + 1}/{len(timed)}")
    stock = [list(generate(p, None, ANSWER_TOKENS).outputs[0].token_ids) for p in follow_ups]
    identity: dict[str, float] = {}
    for setting in settings:
        label = nominal(setting, doc_tokens)
        if label in SERVED_ANSWERS and label not in identity:
            same = [list(generate(p, setting, ANSWER_TOKENS).outputs[0].token_ids) == s
                    for p, s in zip(follow_ups, stock, strict=True)]  # fmt: skip
            identity[label] = sum(same) / len(same)
            log(f"served answers {label}: {identity[label]:.3f} identical")
    fallbacks = sorted({str(r["fallback"]) for rs in reports.values() for r in rs
                        if r.get("fallback")})  # fmt: skip
    if fallbacks:  # a fallen-back request is a full prefill: its TTFT would mislead
        raise SystemExit(f"served follow-ups fell back: {fallbacks}")
    stock_s = statistics.median(times["stock"])
    return {
        "ttft_median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "ttft_vs_stock": {k: round(statistics.median(v) / stock_s, 4) for k, v in times.items()},
        "served_identical_answers": identity,
        "served_recomputed_tokens": {
            k: sum(r.get("recomputed_tokens", 0) for r in v) for k, v in reports.items()
        },
        "served_reused_tokens": {
            k: sum(r.get("reused_tokens", 0) for r in v) for k, v in reports.items()
        },
        "fallbacks": fallbacks,
        "timed_follow_ups": len(timed),
    }


def engine(checkpoint: str | Path, check_layers: tuple[int, ...], max_len: int,
            dtype: str = "float32") -> tuple[Any, Any]:  # fmt: skip
    """(an in-process ``vllm.LLM`` with KMesh on ``checkpoint``, the blend's model inside it)."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # its worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM

    from kmesh_blend.vllm.seam.engine import worker_connector

    config = {
        "kv_connector": "KMeshConnector", "kv_connector_module_path": "kmesh_blend.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kmesh.store": "cpu",
                                      "kmesh.check_layers": list(check_layers)},
    }  # fmt: skip
    llm = LLM(model=str(checkpoint), dtype=dtype, max_model_len=max_len, seed=0,
              enforce_eager=True, enable_prefix_caching=False,
              kv_transfer_config=config)  # fmt: skip
    worker = getattr(worker_connector(), "worker", None)
    if worker is None or worker.model is None:
        raise SystemExit("the engine started without a KMesh worker model (see its log)")
    return llm, worker.model


def close(llm: Any) -> None:
    from kmesh_blend.vllm.seam.engine import drop_leaked_connector

    del llm
    gc.collect()
    drop_leaked_connector()  # the next in-process engine gets a connector of its own
    torch.set_num_threads(2)


def _precision_floor(checkpoint: str | Path, tasks: Sequence[ChatTask], refs: Any,
                     max_len: int, log: Log) -> dict[str, Any]:  # fmt: skip
    """The same full prefills on the same weights in bf16 (a second engine), scored against the
    fp32 engine's answers like a blend: how much the model's own numerics move them."""
    from kmesh_blend.quality.chat_harness import full_prefill_agreement

    llm, model = engine(checkpoint, (1,), max_len, "bfloat16")
    try:
        r = full_prefill_agreement(model, list(tasks), refs)
    finally:
        close(llm)
    log(f"bf16 full prefill vs fp32: agreement {r.agreement:.4f}, KL {r.kl:.2e}")
    return {
        "agreement": round(r.agreement, 4),
        "agreement_se": round(r.agreement_se, 4),
        "kl": float(f"{r.kl:.4g}"),
        "identical_answers": round(r.identical_answers, 4),
    }
