"""The bit-exactness matrix through real vLLM: what one engine run produces, and how runs compare.

One engine per (model, dtype, store, schedule). In it, for every segment layout and group size, a
first reader publishes the family's segments, then the group's follow-ups run in one `generate`
call (so they are blended as one group in one step). Each follow-up yields its generated tokens,
the log-probability of each (bit patterns compared), and its prompt KV of every layer, read back
from vLLM's paged cache after the forward (the live worker's `hooks.capture`).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch

from kmesh_blend.testing import (
    TINY_LLAMA,
    TINY_QWEN2,
    TINY_QWEN3,
    build_checkpoint,
    smollm2_checkpoint,
)
from kmesh_blend.testing.engine import live_worker, make_llm

# name → (checkpoint directory, vocabulary size); SmolLM2 is the real pretrained model.
MODELS: dict[str, tuple[Any, int]] = {
    "llama": (lambda: build_checkpoint(TINY_LLAMA), TINY_LLAMA.vocab_size),
    "qwen2": (lambda: build_checkpoint(TINY_QWEN2), TINY_QWEN2.vocab_size),
    "qwen3": (lambda: build_checkpoint(TINY_QWEN3), TINY_QWEN3.vocab_size),
    "smollm2": (smollm2_checkpoint, 49152),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
LAYOUTS = (
    "leading", "middle", "reordered", "repeated", "repeated_adjacent", "repeated_apart", "several"
)  # fmt: skip
GROUPS = (1, 4, 8)
MAX_TOKENS = 4
FULL = os.environ.get("KMESH_BITEXACT") == "full"  # `make bitexact`: the whole matrix


@dataclass
class Outcome:
    """One follow-up: tokens [n], their log-probabilities, prompt KV [L, 2, T, Hkv, D], report."""

    tokens: list[int]
    logprobs: list[float]
    kv: torch.Tensor | None
    report: dict[str, Any]


def follow_ups(vocab: int) -> list[tuple[str, list[int], list[list[int]]]]:
    """[(family key, token ids, spans)] for first readers (key ends in "/reader") and follow-ups
    (key "layout/group/i"), in the order they run. Seeded: the same in every engine."""
    gen = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    out = []
    for layout in LAYOUTS:
        for group in GROUPS:
            seg = {"A": toks(64), "B": toks(40), "C": toks(24)}
            reader = toks(7) + seg["A"] + seg["B"] + seg["C"] + toks(5)
            a, b, c = 7, 7 + 64, 7 + 104
            out.append((f"{layout}/{group}/reader", reader, [[a, b], [b, c], [c, c + 24]]))
            for i in range(group):
                names = {
                    "leading": ["A"],
                    "middle": ["A"],
                    "reordered": ["A", "B"] if i % 2 == 0 else ["B", "A"],
                    "repeated": ["A", "A"],
                    "repeated_adjacent": ["A", "A"],
                    "repeated_apart": ["A", "A"],
                    "several": ["C", "A", "B"],
                }[layout]
                ids = [] if layout == "leading" else toks(5 + 3 * i)
                spans = []
                for j, name in enumerate(names):
                    if j:  # the gap between two segments
                        gap = {"repeated_adjacent": 0, "repeated_apart": 40 + i}.get(layout)
                        ids += toks(3 + i % 3 if gap is None else gap)
                    spans.append([len(ids), len(ids) + len(seg[name])])
                    ids += seg[name]
                out.append((f"{layout}/{group}/{i}", ids + toks(4 + i % 4), spans))
    return out


def run_engine(
    model: str,
    dtype: str,
    store: str,
    schedule: str,
    fail: str | None = None,
    cascade: bool = False,
    drift: str = "auto",
) -> dict[str, Outcome]:
    """Run every family on a fresh engine; ``fail``: the key of a follow-up whose load fails;
    ``cascade``: with ``kmesh.cascade_decode`` on; ``drift``: ``kmesh.drift_correction``.

    Returns key → `Outcome` for every follow-up, and ``key + "/plain"`` for the failed one run
    again unannotated (vLLM's own full prefill) when ``fail`` is set.
    """
    from vllm import SamplingParams

    checkpoint, vocab = MODELS[model]
    extra = {"kmesh.store": store, "kmesh.schedule": schedule, "kmesh.recompute_ratio": 0.15,
             "kmesh.cascade_decode": cascade, "kmesh.drift_correction": drift,
             "kmesh.speed_guard": "off"}  # fmt: skip
    llm = make_llm(
        checkpoint(),
        dtype=DTYPES[dtype],
        enable_prefix_caching=False,
        max_model_len=512,
        kv_transfer_config={
            "kv_connector": "KMeshConnector",
            "kv_connector_module_path": "kmesh_blend.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    captured: dict[str, torch.Tensor] = {}
    # vLLM's engine ids are the caller's id + "-" + 8 random characters.
    hooks = live_worker().hooks
    hooks.capture = lambda req_id, kv: captured.__setitem__(req_id.rsplit("-", 1)[0], kv.clone())
    plan = follow_ups(vocab)
    targets = {tuple(ids) for key, ids, _ in plan if key == fail}
    hooks.fault = lambda load: "injected" if tuple(load.token_ids) in targets else None

    def params(spans: list[list[int]] | None) -> Any:
        extra_args = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if spans else None
        return SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, extra_args=extra_args
        )

    results: dict[str, Outcome] = {}
    try:
        batches: list[list[tuple[str, list[int], list[list[int]] | None]]] = []
        for key, ids, spans in plan:  # a reader alone, then its group's follow-ups in one call
            if key.endswith("/reader") or not batches or batches[-1][0][0].endswith("/reader"):
                batches.append([])
            batches[-1].append((key, ids, spans))
        if fail is not None:
            batches.append([(f"{fail}/plain", ids, None) for k, ids, _ in plan if k == fail])
        for batch in batches:
            outs = llm.generate(
                [{"prompt_token_ids": ids} for _, ids, _ in batch],
                [params(spans) for _, _, spans in batch],
                use_tqdm=False,
            )
            for (key, _, _), out in zip(batch, outs, strict=True):
                if not key.endswith("/reader"):
                    results[key] = _outcome(out, captured.pop(out.request_id, None))
    finally:
        del llm
        gc.collect()
    return results


def _outcome(out: Any, kv: torch.Tensor | None) -> Outcome:
    comp = out.outputs[0]
    steps = zip(comp.token_ids, comp.logprobs, strict=True)
    logprobs = [float(step[tok].logprob) for tok, step in steps]
    report = (out.kv_transfer_params or {}).get("kmesh") or {}
    return Outcome(list(comp.token_ids), logprobs, kv, report)


def difference(a: Outcome, b: Outcome) -> str | None:
    """The first way ``b`` differs from ``a`` bit for bit, or None when identical."""
    if a.tokens != b.tokens:
        return f"tokens {a.tokens} vs {b.tokens}"
    bits_a = torch.tensor(a.logprobs, dtype=torch.float64).view(torch.int64)
    bits_b = torch.tensor(b.logprobs, dtype=torch.float64).view(torch.int64)
    if not torch.equal(bits_a, bits_b):
        return f"log-probabilities {a.logprobs} vs {b.logprobs}"
    if a.kv is None or b.kv is None:
        return "KV not captured"
    if a.kv.shape != b.kv.shape or not torch.equal(a.kv.view(-1).view(torch.uint8),
                                                   b.kv.view(-1).view(torch.uint8)):  # fmt: skip
        bad = (a.kv != b.kv).nonzero()
        return f"KV differs at {bad.shape[0]} entries, first [layer, k/v, token, head, dim] " + (
            f"{bad[0].tolist()}" if bad.numel() else "(bit pattern only)"
        )
    return None


# Rows of the summary table `make bitexact` prints (tests/bitexact/conftest.py).
SUMMARY: list[tuple[str, str, int, str]] = []  # (case, compared with, follow-ups, result)
