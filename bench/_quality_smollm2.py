"""`bench/quality.py --model smollm2`: reuse quality and follow-up TTFT on the real model, per
selection rule and ratio, side by side in one run of one vLLM engine.

Engine: SmolLM2-135M-Instruct, fp32, in-process vLLM with the KMesh connector (``cpu`` store,
prefix caching off so stock timings are full prefills). Answers are greedy, at most 32 tokens,
ending with the turn (``<|im_end|>``). Tasks: `kmesh_blend.quality.chat`
(1–4 documents of 192 tokens per prompt, prose from the Python reference and stdlib code,
families of 4, the model's chat template).

1. Quality (`kmesh_blend.quality.chat_harness`) on the model the engine loaded — the blend's own
   `VllmModel`, i.e. vLLM's modules and weights: every rule × ratio × selection against the full
   prefill's greedy 32-token answer, teacher-forced.
2. Through the served path: each document's reader request stores its master; every follow-up
   is then sent (a) unannotated — vLLM's own full prefill — and (b) annotated with a setting of
   its own (``recompute_ratio`` / ``sink_tokens`` in the annotation). Measured: time to first
   token per setting (1-token generate, settings interleaved per follow-up, the first
   `TIMED_PER_TASK` follow-ups of each task) and, for the settings in `SERVED_ANSWERS`, the
   share of greedy answers (every follow-up) equal to vLLM's full prefill's.

3. Reference points: the deviation rule at `GOAL_RATIOS` (0.5, 0.7: how far toward 0.99);
   the same full prefills on a second engine in bf16, scored against the fp32 answers (the
   model's own numerical floor); the share of answer positions that are near ties.

Rules at equal recomputed tokens (documents all have ``doc_tokens`` tokens): ``deviation`` at
ratio r; ``sink`` = ratio 0 with keep_count(r, S) sink tokens; ``sink+deviation`` = 4 sinks and
the deviation ratio that brings the total to the same count.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from kmesh_blend.blend import keep_count
from kmesh_blend.quality.chat import ChatPrompt, ChatTask
from kmesh_blend.quality.harness import RATIOS, SELECTIONS, Setting

DOC_TOKENS = 192
ANSWER_TOKENS = 32
COMBINED_SINKS = 4
SERVED_ANSWERS = ("deviation 0.15", "sink 0.15")
GOAL_RATIOS = (0.5, 0.7)  # deviation rule only, per request: how far the ratio must go for 0.99
NEAR_TIE_GAPS = (0.1, 0.5)
TIMED_PER_TASK = 2  # follow-ups per task whose TTFT is measured under every setting


def rule_settings(doc_tokens: int = DOC_TOKENS) -> list[Setting]:
    """Every rule at every ratio, per selection mode; ratios 0 and 1.0 once per mode; then the
    deviation rule per request at `GOAL_RATIOS`."""
    out = []
    for selection in SELECTIONS:
        for ratio in RATIOS:
            out.append(Setting(ratio, selection))
        for ratio in RATIOS[1:-1]:
            count = keep_count(ratio, doc_tokens)
            out.append(Setting(0.0, selection, sink_tokens=count))
            if count > COMBINED_SINKS:  # else the combination is the sink rule itself
                rest = (count - COMBINED_SINKS) / (doc_tokens - COMBINED_SINKS)
                out.append(Setting(rest, selection, sink_tokens=COMBINED_SINKS))
    out.extend(Setting(ratio) for ratio in GOAL_RATIOS)
    return out


def nominal(setting: Setting, doc_tokens: int = DOC_TOKENS) -> str:
    """``rule ratio`` at the recompute share it matches: 'deviation 0.15', 'sink 0.15', …"""
    if setting.rule in ("none", "all"):
        return setting.rule
    count = setting.sink_tokens + keep_count(setting.ratio, doc_tokens - setting.sink_tokens)
    share = min(RATIOS + GOAL_RATIOS, key=lambda r: abs(keep_count(r, doc_tokens) - count))
    return f"{setting.rule} {share:g}"


def served(llm: Any, tasks: list[ChatTask], settings: list[Setting], answers: bool,
           log: Any) -> dict[str, Any]:  # fmt: skip
    """TTFT per setting (and stock), and served greedy-answer identity (see the docstring)."""
    from vllm import SamplingParams

    def params(prompt: ChatPrompt, setting: Setting | None, tokens: int) -> Any:
        extra = None
        if setting is not None:
            own = {"recompute_ratio": setting.ratio, "sink_tokens": setting.sink_tokens}
            extra = {"kv_transfer_params": {"kmesh": {**prompt.annotation(), **own}}}
        return SamplingParams(temperature=0.0, max_tokens=tokens, extra_args=extra)

    def generate(prompt: ChatPrompt, setting: Setting | None, tokens: int) -> Any:
        p = params(prompt, setting, tokens)
        (out,) = llm.generate([{"prompt_token_ids": list(prompt.token_ids)}], p, use_tqdm=False)
        return out

    for task in tasks:  # the first readers store every document's master
        for reader in task.readers:
            generate(reader, Setting(0.0), 1)
    follow_ups = [r for t in tasks for r in t.requests]
    timed = [r for t in tasks for r in t.requests[:TIMED_PER_TASK]]
    labels = ["stock"] + [nominal(s) for s in settings]
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
    identity: dict[str, float] = {}
    if answers:
        stock = [list(generate(p, None, ANSWER_TOKENS).outputs[0].token_ids) for p in follow_ups]
        for setting in settings:
            label = nominal(setting)
            if label not in SERVED_ANSWERS:
                continue
            same = [list(generate(p, setting, ANSWER_TOKENS).outputs[0].token_ids) == s
                    for p, s in zip(follow_ups, stock, strict=True)]  # fmt: skip
            identity[label] = sum(same) / len(same)
            log(f"served answers {label}: {identity[label]:.3f} identical")
    fallbacks = sorted({r.get("fallback") for rs in reports.values() for r in rs} - {None})
    if fallbacks:  # a fallen-back request is a full prefill: its TTFT would mislead
        raise SystemExit(f"served follow-ups fell back: {fallbacks}")
    return {
        "ttft_median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "ttft_vs_stock": {
            k: round(statistics.median(v) / statistics.median(times["stock"]), 4)
            for k, v in times.items()
        },
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


def engine(check_layers: tuple[int, ...], dtype: str = "float32") -> tuple[Any, Any]:
    """(vllm.LLM with KMesh, the blend's model inside it)."""
    from kmesh_blend.testing import smollm2_checkpoint
    from kmesh_blend.testing.engine import kv_transfer_config, live_worker, make_llm

    llm = make_llm(
        smollm2_checkpoint(),
        dtype,
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config(store="cpu", check_layers=list(check_layers)),
    )
    return llm, live_worker().model


def close(llm: Any) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    del llm
    gc.collect()
    ensure_kv_transfer_shutdown()  # the next in-process engine gets a connector of its own
    torch.set_num_threads(2)


def precision_floor(tasks: list[ChatTask], refs: Any, log: Any) -> dict[str, Any]:
    """The same full prefills on the same weights in bf16 (a second engine), scored against the
    fp32 engine's answers like a blend: how much the model's own numerics move them."""
    from kmesh_blend.quality.chat_harness import full_prefill_agreement

    llm, model = engine((1,), "bfloat16")
    try:
        r = full_prefill_agreement(model, tasks, refs)
    finally:
        close(llm)
    log(f"bf16 full prefill vs fp32: agreement {r.agreement:.4f}, KL {r.kl:.2e}")
    return {
        "agreement": round(r.agreement, 4),
        "agreement_se": round(r.agreement_se, 4),
        "kl": float(f"{r.kl:.4g}"),
        "identical_answers": round(r.identical_answers, 4),
    }


def run(quick: bool, num_tasks: int, check_layers: tuple[int, ...]) -> dict[str, Any]:
    """The whole measurement; returns the result object (the JSON line `bench/run_all.py` reads)."""
    from transformers import AutoTokenizer

    from kmesh_blend.quality.chat import chat_tasks
    from kmesh_blend.quality.chat_harness import evaluate_chat, near_ties, references
    from kmesh_blend.testing import smollm2_checkpoint

    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.0f} s] {message}", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    tasks = chat_tasks(tokenizer, num_tasks, doc_tokens=DOC_TOKENS)
    settings = rule_settings()
    llm, model = engine(check_layers)
    try:
        stop = (int(tokenizer.eos_token_id),)  # <|im_end|>: answers end with the turn
        refs = references(model, tasks, ANSWER_TOKENS, log, stop)
        report = evaluate_chat(model, tasks, settings, check_layers, ANSWER_TOKENS, log,
                               refs=refs, stop_ids=stop)  # fmt: skip
        per_request = [s for s in settings if s.selection == "per_request"]
        serving = served(llm, tasks, per_request, answers=True, log=log)
    finally:
        close(llm)
    floor = precision_floor(tasks, refs, log)
    seconds = time.perf_counter() - began
    table = [
        {
            "rule": r.setting.rule,
            "nominal": nominal(r.setting),
            "selection": r.setting.selection,
            "ratio": round(r.setting.ratio, 4),
            "sink_tokens": r.setting.sink_tokens,
            "recomputed": round(r.recomputed, 4),
            "agreement": round(r.agreement, 4),
            "agreement_se": round(r.agreement_se, 4),
            "kl": float(f"{r.kl:.4g}"),
            "kl_se": float(f"{r.kl_se:.3g}"),
            "identical_answers": round(r.identical_answers, 4),
            "answer_prefix": round(r.answer_prefix, 4),
            "blend_s_per_family": round(r.blend_s, 3),
            "agreement_by_question": {k: round(v, 4) for k, v in r.agreement_by_kind.items()},
            "ttft_vs_stock": serving["ttft_vs_stock"].get(nominal(r.setting))
            if r.setting.selection == "per_request"
            else None,
        }
        for r in report.results
    ]
    headline = report.result(Setting(0.15))
    mine = [r for r in table if r["selection"] == "per_request"]
    best = max((r for r in mine if r["rule"].startswith("sink")), key=lambda r: r["agreement"])
    share = best["nominal"].split()[-1]
    rival = next(r for r in mine if r["nominal"] == f"deviation {share}")
    reached = [r for r in mine if r["rule"] == "deviation" and r["agreement"] >= 0.99]
    exact = report.result(Setting(1.0))
    if not (exact.agreement == 1.0 and exact.kl == 0.0 and exact.identical_answers == 1.0):
        raise SystemExit(f"ratio 1.0 is not identical to full prefill: {exact}")
    return {
        "name": "quality_smollm2",
        "metric": "top-1 agreement with full prefill at ratio 0.15 (multi-document chat)",
        "value": round(headline.agreement, 4),
        "unit": "fraction",
        "goal": 0.99,
        "baseline": "full prefill, same engine",
        "quick": quick,
        "config": {
            "model": "SmolLM2-135M-Instruct (fp32), vLLM in-process, prefix caching off",
            "check_layers": list(check_layers),
            "tasks": report.num_tasks,
            "follow_ups": report.num_requests,
            "positions": report.num_positions,
            "documents_per_follow_up": {
                str(k): report.documents.count(k) for k in sorted(set(report.documents))
            },
            "document_tokens": DOC_TOKENS,
            "answer_tokens": ANSWER_TOKENS,
            "headline_se": round(headline.agreement_se, 4),
            "se": "clustered by task (families share documents and one group blend)",
            "reference_flips": report.reference_flips,
            "second_rule_best": {"best_sink_variant": best, "deviation_at_equal_tokens": rival},
            "goal_reached_at_ratio": min((r["ratio"] for r in reached), default=None),
            "bf16_full_prefill_vs_fp32": floor,
            "near_ties": {str(g): round(v, 4) for g, v in near_ties(refs, NEAR_TIE_GAPS).items()},
            "table": table,
            **serving,
            "seconds": round(seconds, 1),
        },
    }


def plot(result: dict[str, Any], path: Any) -> None:
    """Two panels over the recomputed share: top-1 agreement (per_request and collective) and
    TTFT / stock (per_request), one line per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["config"]["table"]
    fig, (ax_q, ax_t) = plt.subplots(1, 2, figsize=(10, 3.8))
    for rule, marker in (("deviation", "o"), ("sink", "s"), ("sink+deviation", "^")):
        for selection, style in (("per_request", "-"), ("collective", ":")):
            pts = sorted(
                (r["recomputed"], r["agreement"], r["ttft_vs_stock"])
                for r in rows
                if r["selection"] == selection and r["rule"] in (rule, "none", "all")
            )
            xs = [p[0] for p in pts]
            ax_q.plot(xs, [p[1] for p in pts], style, marker=marker, label=f"{rule} {selection}")
            if selection == "per_request":
                ax_t.plot(xs, [p[2] for p in pts], "-", marker=marker, label=rule)
    ax_q.axhline(0.99, color="gray", linestyle="--", linewidth=1)
    ax_q.set_xscale("symlog", linthresh=0.05)
    ax_q.set_xlabel("recomputed share of reused tokens")
    ax_q.set_ylabel("top-1 agreement with full prefill")
    ax_t.set_xscale("symlog", linthresh=0.05)
    ax_t.set_xlabel("recomputed share of reused tokens")
    ax_t.set_ylabel("follow-up TTFT / stock vLLM")
    for ax in (ax_q, ax_t):
        ax.legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(f"SmolLM2-135M-Instruct, {cfg['follow_ups']} multi-document follow-ups, "
                 f"{cfg['positions']} answer positions", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
