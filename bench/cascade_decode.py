"""Decode-step time of a family in vLLM, cascade decode on vs off, and its cost for the rest.

Workload: SmolLM2-135M-Instruct (bf16 by default; CPU, in-process engine), the chat prompts of
`follow_up_ttft --model smollm2` (`smollm2_prompts`): a real-text document D of 2,048 tokens
between each prompt's own system prompt/preamble and question. The first reader stores D's
master; then a family of 8 follow-ups is added at once (each reuses D at ratio 0.15) and the
engine is stepped by hand: after every follow-up has its first token, each ``step()`` is one
decode step of the 8 (greedy, ``ignore_eos``). One KMesh engine with ``kmesh.cascade_decode``
on serves the family in rounds, each round once in cascade and once with the path paused
(`CascadeDecode.paused`: vLLM's own forward, the same engine and memory), then
the same 8 prompts unannotated; a stock vLLM engine serves them unannotated before and after it
(engines run one after another in this process: vLLM's KV connector is process-global).

value = median over rounds of (median decode-step time with cascade / paused) (goal ≤ 0.75);
config.round_ratios lists each round's (on and paused back to back, order alternating), with
their mean and its standard error (``round_ratio_se``).
config.unannotated_on_vs_paused = the 8 prompts unannotated on the cascade engine, path on /
paused: median over rounds of back-to-back pairs, order alternating (what the installed path costs
requests it does not serve; goal ≤ 1.03); config.unannotated_round_ratios lists each round's.
config.unannotated_vs_stock = their median decode-step time on the cascade engine / on stock vLLM
(two engines one after the other, so it carries this machine's drift between them: ±15 %).
config.bytes_model: KV bytes read per decode step (all layers), off = Σ_r context_r rows; on =
one read of D's master + Σ_r (context_r − rows it reads from the master), at the KV dtype (as
the CPU kernel reads them; the torch fallback reads fp32 copies), next to the weights' bytes;
limit_ratio = (weights + on) / (weights + off), the step ratio a step bound by memory reaches;
shared_level_ms: the shared level alone per step (the CPU kernel on either level, every layer).

``--speed-guard off`` (default) measures the raw path; ``auto`` runs the cascade engine with the
speed guard at the engine's default (result ``cascade_decode_guard``): the family decodes
wherever the guard sends it (in cascade, or on vLLM's kernel with ``cascade_off`` saying why), and
value is then the step the user gets / vLLM's own (goal ≤ 1.03; 8 rounds, not 4, since both
sides then mostly run vLLM's kernel); config.guard holds its decision.

Run: python bench/cascade_decode.py [--quick] [--dtype bfloat16|float32] [--block-size N]
[--speed-guard off|auto] (block size: vLLM's KV block size, 128; config.attn_isa names the
attention kernel vLLM picked for it)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, plot_bars, use_allocator
from _serving import BLOCK_SIZE, attn_isa, guard_decision
from follow_up_ttft import smollm2_prompts

from kmesh_blend.testing import SMOLLM2
from kmesh_blend.testing.engine import kv_transfer_config, live_worker, make_llm

RATIO = 0.15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--family", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help="vLLM's KV block size (on an AMX CPU, bf16: 32 runs vLLM's amx "
                        "kernel, 16 its vec16 one: config.attn_isa names it)")  # fmt: skip
    parser.add_argument("--speed-guard", default="off", choices=["off", "auto"],
                        help="off: the raw path; auto: the engine's default decides")  # fmt: skip
    args = parser.parse_args()
    if args.block_size < 16 or args.block_size % 16:
        raise SystemExit(f"--block-size: a multiple of 16, got {args.block_size}")
    allocator = use_allocator("tcmalloc")
    doc_len = 512 if args.quick else 2048
    decode_steps = 8 if args.quick else 32
    # guard auto: both sides mostly run vLLM's kernel, so the ratio is this machine's spread
    # around 1.0 (±10 % a round): twice the rounds to tell 1.03 from it
    rounds = 1 if args.quick else (8 if args.speed_guard == "auto" else 4)
    path, prompts, details = smollm2_prompts(doc_len, args.family + 1)
    reader, family = prompts[0], prompts[1:]
    common = {
        "max_model_len": 4096,
        "max_num_batched_tokens": 4096,
        "dtype": args.dtype,
        "max_num_seqs": 16,
        "block_size": args.block_size,
    }

    steps: dict[str, list[float]] = {
        "on": [],
        "off": [],
        "plain_on": [],
        "plain_paused": [],
        "plain_stock": [],
    }
    reports: list[dict[str, Any]] = []
    per_round: dict[str, list[float]] = {}  # label → median step of each round
    new_tokens = decode_steps + 1
    guard: dict[str, Any] = {}
    parts: dict[str, float] = {}  # median ms per cascade step of the family, over every layer

    def stock_engine() -> None:
        llm = make_llm(path, **common)
        steps["plain_stock"] += _run(llm, family, annotate=False, new_tokens=new_tokens)[0]
        del llm
        gc.collect()

    def kmesh_engine() -> None:
        """The family in rounds, cascade on then paused (vLLM's forward) in the same engine;
        then the family's prompts unannotated."""
        llm = make_llm(
            path,
            # off: the raw path, cascade itself on vs paused (the guard would send the family to
            # vLLM's kernel wherever its timings say so); auto: what a user gets
            kv_transfer_config=kv_transfer_config(
                cascade_decode=True, recompute_ratio=RATIO, speed_guard=args.speed_guard
            ),
            **common,
        )
        _run(llm, [reader], annotate=True, new_tokens=1)
        cascade = live_worker().cascade
        assert cascade is not None, "cascade decode did not install"

        def pause(paused: bool) -> None:
            cascade.paused = paused

        seen = cascade.clock.serial
        for i in range(rounds):  # on / paused back to back, order alternating
            sides = (("on", False), ("off", True))
            for label, paused in sides if i % 2 == 0 else sides[::-1]:
                pause(paused)
                durations, outs = _run(llm, family, annotate=True, new_tokens=new_tokens)
                steps[label] += durations
                per_round.setdefault(label, []).append(statistics.median(durations))
                if not paused:
                    reports[:] = [o.kv_transfer_params["kmesh"] for o in outs]
        for i in range(rounds):  # unannotated, on / paused back to back, order alternating
            pairs = (("plain_on", False), ("plain_paused", True))
            for label, paused in pairs if i % 2 == 0 else pairs[::-1]:
                pause(paused)
                durations = _run(llm, family, annotate=False, new_tokens=new_tokens)[0]
                steps[label] += durations
                per_round.setdefault(label, []).append(statistics.median(durations))
        pause(False)
        guard.update(guard_decision(cascade.guard))
        # the cascade steps' own parts (`cascade_clock`): planning, arming, the kernel
        full = [p for p in cascade.clock.since(seen) if p.cascade == len(family) and not p.arm_s]
        if full:
            parts.update({name: round(statistics.median(getattr(p, f"{name}_s") for p in full)
                                      * 1e3, 3) for name in ("plan", "cascade")})  # fmt: skip
        del llm
        gc.collect()

    # stock before and after: the unannotated comparison is not an engine-order effect
    stock_engine()
    kmesh_engine()
    stock_engine()

    med = {k: statistics.median(v) for k, v in steps.items()}
    # Each round's on/off pair ran back to back: the median of their ratios cancels the drift
    # of this shared machine's speed between rounds.
    ratios = [a / b for a, b in zip(per_round["on"], per_round["off"], strict=True)]
    value = statistics.median(ratios)
    # the spread of the rounds' mean ratio: what a value this close to its goal is judged with
    spread = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    plain = med["plain_on"] / med["plain_stock"]
    hooks = [a / b for a, b in zip(per_round["plain_on"], per_round["plain_paused"], strict=True)]
    hook = statistics.median(hooks)
    fell_back = [r.get("fallback") or r.get("cascade_off") for r in reports]
    cascaded = [int(r.get("cascade_steps", 0)) for r in reports]
    model = _bytes_model(path, args.dtype, family, reports, doc_len, decode_steps)
    model["shared_level_ms"] = _shared_level_ms(path, len(family), doc_len)
    for k, v in med.items():
        print(f"{k:12s} median decode step {v * 1e3:8.2f} ms  ({len(family) / v:7.1f} tok/s)")
    print(f"cascade on / off = {value:.3f} (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"unannotated: cascade engine / stock = {plain:.3f}, path on / paused = {hook:.3f}")
    print(
        f"bytes per step: off {model['off_MiB']:.1f} MiB, on {model['on_MiB']:.1f} MiB "
        f"({model['ratio']:.3f}x), weights {model['weights_MiB']:.1f} MiB; with the weights "
        f"{model['limit_ratio']:.3f}x (the bytes limit of the step ratio)"
    )
    if model["shared_level_ms"]:
        level = model["shared_level_ms"]
        print(f"shared level alone, one step over every layer (bf16, the kernel alone, from "
              f"evicted caches): loops {level['loops']:.2f} ms, matrix products "
              f"{level['gemm']:.2f} ms")  # fmt: skip
    if parts:
        print(f"a cascade step of the family in parts (median, every layer): planning "
              f"{parts['plan']:.2f} ms, the kernel {parts['cascade']:.2f} ms, the rest of the "
              f"step {med['on'] * 1e3 - parts['plan'] - parts['cascade']:.2f} ms")  # fmt: skip
    kept_out = [str(r).startswith("speed guard") for r in fell_back]
    if args.speed_guard == "auto" and all(kept_out) and not any(cascaded):
        print(f"the speed guard kept the family on vLLM's kernel: {fell_back[0]}")
    elif any(fell_back) or min(cascaded) < decode_steps - 1:
        raise SystemExit(f"a follow-up did not decode in cascade: {reports}")
    name = "cascade_decode" + ("_guard" if args.speed_guard == "auto" else "")
    plot_bars(  # named after the result: a variant never overwrites the raw run's plot
        name,
        ["family, cascade off", "family, cascade on", "unannotated, stock", "unannotated, ours"],
        [med["off"], med["on"], med["plain_stock"], med["plain_on"]],
        f"{SMOLLM2}: decode step of {len(family)} requests over a {doc_len}-token document",
    )
    emit(
        {
            "name": name,
            "metric": "decode-step time of the family, cascade on / off",
            "value": round(value, 4),
            "unit": "x",
            "goal": 0.75 if args.speed_guard == "off" else 1.03,
            "baseline": "the same engine, cascade paused (vLLM's forward), rounds interleaved",
            "quick": args.quick,
            "config": {
                "model": SMOLLM2,
                "dtype": args.dtype,
                "block_size": args.block_size,
                "attn_isa": attn_isa(args.dtype, args.block_size),
                "speed_guard": args.speed_guard,
                "guard": guard,
                "allocator": allocator,
                "family": len(family),
                "document_tokens": doc_len,
                "recompute_ratio": RATIO,
                "decode_steps_timed": decode_steps,
                "rounds": rounds,
                "round_ratios": [round(r, 4) for r in ratios],
                "round_ratio_mean": round(statistics.fmean(ratios), 4),
                "round_ratio_se": None if spread is None else round(spread, 4),
                "median_step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                "family_tokens_per_s": {k: round(len(family) / v, 2) for k, v in med.items()},
                "unannotated_vs_stock": round(plain, 4),
                "unannotated_goal": 1.03,
                "unannotated_on_vs_paused": round(hook, 4),
                "unannotated_round_ratios": [round(r, 4) for r in hooks],
                "cascade_steps": cascaded,
                "shared_rows": [int(r.get("cascade_shared_rows", 0)) for r in reports],
                "bytes_model": model,
                "cascade_step_parts_ms": parts,
                **details,
            },
        }
    )


def _run(
    llm: Any, prompts: list[Any], annotate: bool, new_tokens: int
) -> tuple[list[float], list[Any]]:
    """Add ``prompts`` at once and step the engine to the end; the durations of the steps in
    which every request was decoding (each had its first token), and the final outputs."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = []
    for i, (tokens, spans) in enumerate(prompts):
        extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if annotate else None
        params = SamplingParams(
            temperature=0.0, max_tokens=new_tokens, ignore_eos=True, extra_args=extra
        )
        req_id = f"{'a' if annotate else 'p'}{time.monotonic_ns()}-{i}"
        engine.add_request(req_id, {"prompt_token_ids": tokens}, params)
        ids.append(req_id)
    started: set[str] = set()
    finished: dict[str, Any] = {}
    durations = []
    while engine.has_unfinished_requests():
        decoding = len(started) == len(ids)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if decoding and len(finished) == 0:
            durations.append(dt)
        for out in outs:
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                finished[out.request_id] = out
    return durations, [finished[i] for i in ids]


def _bytes_model(
    path: Path,
    dtype: str,
    family: list[Any],
    reports: list[dict[str, Any]],
    doc_len: int,
    steps: int,
) -> dict[str, Any]:
    """KV bytes read by one decode step in the middle of the timed steps, and the weights'."""
    import json

    cfg = json.loads((path / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = 2 if dtype == "bfloat16" else 4
    row = layers * kv_heads * head_dim * 2 * width  # K and V of one token, all layers
    contexts = [len(tokens) + steps // 2 for tokens, _ in family]
    shared = [int(r.get("cascade_shared_rows", 0)) for r in reports]
    off = sum(contexts) * row
    on = (doc_len + sum(c - s for c, s in zip(contexts, shared, strict=True))) * row
    from safetensors import safe_open

    weights = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_slice(name)
                weights += _numel(t.get_shape()) * width
    mib = 1 << 20
    return {
        "off_MiB": off / mib,
        "on_MiB": on / mib,
        "ratio": on / off,
        # the step's bytes with weights: what a step bound by memory could at best gain
        "limit_ratio": (weights + on) / (weights + off),
        "weights_MiB": weights / mib,
        "row_bytes": row,
    }


def _shared_level_ms(path: Path, family: int, rows: int) -> dict[str, float] | None:
    """One decode step of the shared level alone (every layer): the CPU kernel's call for
    ``family`` readers of a ``rows``-row master (16 own rows each), on either level
    (`kmesh_blend.cpu.level.time_levels`, bf16, from evicted caches) × the model's layers;
    None where the kernel is not built."""
    import json

    from kmesh_blend.cpu import cascade_decode_op
    from kmesh_blend.cpu.level import time_levels

    kernel, _ = cascade_decode_op()
    if kernel is None:
        return None
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads[0]
    timing = time_levels(kernel, (*heads, dim), family=family, rows=rows)
    layers = cfg["num_hidden_layers"]
    return {"loops": timing.loops_s * 1e3 * layers, "gemm": timing.gemm_s * 1e3 * layers}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()
