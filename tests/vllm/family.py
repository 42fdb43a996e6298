"""The issue's family workload on real vLLM: a 416-token document read once, then four follow-ups
with their own private instructions before it and a question after it, 8 greedy tokens each."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import kv_transfer_config, live_worker, make_llm

DOC_LEN, NUM_FOLLOW_UPS, MAX_TOKENS = 416, 4, 8


def prompts(seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    """[(token ids, segment spans)]: the first reader, then the follow-ups."""
    gen = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, 2048, (DOC_LEN,), generator=gen).tolist()
    out = []
    for i in range(NUM_FOLLOW_UPS + 1):
        private = torch.randint(3, 2048, (17 + 6 * i,), generator=gen).tolist()
        question = torch.randint(3, 2048, (9 + i,), generator=gen).tolist()
        out.append((private + doc + question, [[len(private), len(private) + DOC_LEN]]))
    return out


def params(spans: list[list[int]] | None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if spans is not None else None
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args=extra)


def run_family(
    fault: Callable[[Any], str | None] | None = None, **extra: Any
) -> list[tuple[list[int], dict[str, Any] | None]]:
    """Start an engine with KMesh, read the document once, then run the follow-ups in one call.
    ``fault``: the worker's fault hook (`WorkerHooks.fault`) for this engine.

    Returns (generated tokens, kmesh report) for the first reader, each follow-up, then the
    second prompt unannotated and the third with a bad (reversed) span."""
    llm = make_llm(
        build_checkpoint(TINY_LLAMA),
        kv_transfer_config=kv_transfer_config(**extra),
        enable_prefix_caching=False,
    )
    live_worker().hooks.fault = fault
    try:
        family = prompts()
        first = llm.generate(
            [{"prompt_token_ids": family[0][0]}], params(family[0][1]), use_tqdm=False
        )
        rest = llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in family[1:]],
            [params(spans) for _, spans in family[1:]],
            use_tqdm=False,
        )
        # Then: a follow-up without annotation (stock path) and one with a bad annotation.
        extra_out = llm.generate(
            [{"prompt_token_ids": family[1][0]}, {"prompt_token_ids": family[2][0]}],
            [params(None), params([[30, 20]])],
            use_tqdm=False,
        )
        return [_result(o) for o in first + rest + extra_out]
    finally:
        del llm
        gc.collect()


def run_stock() -> list[list[int]]:
    """Stock vLLM (no connector, prefix caching on) on the same prompts: generated tokens."""
    llm = make_llm(build_checkpoint(TINY_LLAMA))
    try:
        outs = llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in prompts()], params(None), use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()


def _result(output: Any) -> tuple[list[int], dict[str, Any] | None]:
    report = (output.kv_transfer_params or {}).get("kmesh")
    return list(output.outputs[0].token_ids), report
