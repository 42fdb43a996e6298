"""Sharing the document's KV in the engine's memory (``kmesh.share_kv_memory``), through real
vLLM (fp32): readers of a stored master give their segment-only blocks back to vLLM's pool once
they decode in cascade, decode to the same tokens as without sharing, and more of them fit one KV
budget. Each lifetime case — preemption, abort, a family closed and its master deleted from the
store while members still decode — stays correct, and nothing is left held afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from kmesh_blend.cpu import cpu_kernel_expected
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint, smollm2_checkpoint
from kmesh_blend.testing.engine import kv_transfer_config, live_worker, make_llm
from kmesh_blend.testing.stepping import Driven, Request, drive

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not cpu_kernel_expected(), reason="blocks go back only on the CPU kernel"),
]

T = TypeVar("T")
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
FP32_LOGPROB_BOUND = 1e-4  # own rows summed in another order (mirror after the kept rows)
NEAR_TIE = 1e-3  # fp32: vLLM recomputes a preempted request's generated rows in a prefill
MODELS: dict[str, tuple[Callable[[], Path], int]] = {
    "tiny": (lambda: build_checkpoint(TINY_LLAMA), 300),
    "smollm2": (smollm2_checkpoint, 256),
}


def _family(model: str, n: int, seed: int = 3) -> tuple[list[int], list[tuple[list[int], int]]]:
    """The document, and n + 1 prompts (the first reader first): (own head + document + own
    question, where the document starts)."""
    gen = torch.Generator().manual_seed(seed)
    doc_len = MODELS[model][1]
    vocab = TINY_LLAMA.vocab_size if model == "tiny" else 40000
    doc = torch.randint(3, vocab, (doc_len,), generator=gen).tolist()
    out = []
    for i in range(n + 1):
        head = torch.randint(3, vocab, (9 + 3 * i,), generator=gen).tolist()
        question = torch.randint(3, vocab, (6 + i % 5,), generator=gen).tolist()
        out.append((head + doc + question, len(head)))
    return doc, out


def _params(start: int | None, doc_len: int, max_tokens: int, **kmesh: Any) -> Any:
    from vllm import SamplingParams

    extra = None
    if start is not None:
        extra = {"kv_transfer_params": {"kmesh": {"segments": [[start, start + doc_len]], **kmesh}}}
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                          extra_args=extra)  # fmt: skip


def _engine(work: Callable[[Any], T], model: str, share: bool, blocks: int | None = None,
            prefix_caching: bool = False, dtype: str = "float32", **kmesh: Any) -> T:  # fmt: skip
    """``work(llm)`` on a fresh engine, which is gone (its connector with it) on return."""
    # drift correction off on both sides: cascade decode turns it off (see the contract)
    kmesh.setdefault("speed_guard", "off")  # the raw path
    config = kv_transfer_config(cascade_decode=True, share_kv_memory=share,
                                drift_correction="off", **kmesh)  # fmt: skip
    extra = {"num_gpu_blocks_override": blocks} if blocks else {}
    llm = make_llm(MODELS[model][0](), dtype, enable_prefix_caching=prefix_caching,
                   block_size=BLOCK, max_model_len=1024, kv_transfer_config=config,
                   **extra)  # fmt: skip
    try:
        return work(llm)
    finally:
        del llm
        gc.collect()


def _requests(model: str, n: int, max_tokens: int, **kmesh: Any) -> list[Request]:
    doc, prompts = _family(model, n)
    return [(f"r{i}", {"prompt_token_ids": ids}, _params(start, len(doc), max_tokens, **kmesh))
            for i, (ids, start) in enumerate(prompts[1:], 1)]  # fmt: skip


def _read_first(llm: Any, model: str, **kmesh: Any) -> None:
    doc, prompts = _family(model, 0)
    ids, start = prompts[0]
    drive(llm, [("r0", {"prompt_token_ids": ids}, _params(start, len(doc), 1, **kmesh))])


def _tokens(driven: Driven) -> dict[str, list[int]]:
    return {rid: list(o.outputs[0].token_ids) for rid, o in driven.outputs.items()}


def _report(driven: Driven, req_id: str) -> dict[str, Any]:
    return dict((driven.outputs[req_id].kv_transfer_params or {})["kmesh"])


def _logprobs(o: Any) -> list[float]:
    steps = zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
    return [float(lp[t].logprob) for t, lp in steps]


def _block_bytes(model: str) -> int:
    """Bytes of one fp32 block over all layers (K and V)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(MODELS[model][0]())
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * 4 * BLOCK


def _expected_released(prompt_len: int, start: int, end: int) -> int:
    """Blocks wholly inside the document and the prompt."""
    return sum(
        1 for b in range(prompt_len // BLOCK) if start <= b * BLOCK and (b + 1) * BLOCK <= end
    )


def _served(model: str, share: bool, families: tuple[int, ...], max_tokens: int,
            prefix_caching: bool = False,
            dtype: str = "float32") -> list[tuple[Driven, list[Request]]]:  # fmt: skip
    """The first reader, then each family in one batch (the family of 4 beside an unannotated
    prompt, id "plain")."""

    def work(llm: Any) -> list[tuple[Driven, list[Request]]]:
        out = []
        _read_first(llm, model)
        doc, prompts = _family(model, sum(families), seed=3)
        start = 1
        for size in families:
            requests = [(f"f{size}-{i}", {"prompt_token_ids": prompts[i][0]},
                         _params(prompts[i][1], len(doc), max_tokens))
                        for i in range(start, start + size)]  # fmt: skip
            start += size
            if size == 4:
                plain = prompts[1][0][:-3]
                requests.append(
                    ("plain", {"prompt_token_ids": plain}, _params(None, 0, max_tokens))
                )
            out.append((drive(llm, requests), requests))
        return out

    return _engine(work, model, share, prefix_caching=prefix_caching, dtype=dtype)


@pytest.mark.parametrize(("model", "prefix_caching"),
                         [("tiny", False), ("tiny", True), ("smollm2", False)])  # fmt: skip
def test_readers_give_back_their_document_blocks_and_decode_the_same_tokens(
    model: str, prefix_caching: bool
) -> None:
    """Families of 1, 4 and 8: with sharing, each reader gives back exactly the blocks that hold
    only document rows, and every request (and an unannotated one beside them) decodes the same
    greedy tokens as with cascade decode alone, log-probabilities within 1e-4."""
    max_tokens = 40 if model == "tiny" else 12
    shared = _served(model, True, (1, 4, 8), max_tokens, prefix_caching)
    alone = _served(model, False, (1, 4, 8), max_tokens, prefix_caching)
    doc_len = MODELS[model][1]
    for (got, requests), (want, _) in zip(shared, alone, strict=True):
        assert _tokens(got) == _tokens(want)
        for req_id, prompt, params in requests:
            pairs = zip(_logprobs(got.outputs[req_id]), _logprobs(want.outputs[req_id]),
                        strict=True)  # fmt: skip
            worst = max(abs(a - b) for a, b in pairs)
            assert worst <= FP32_LOGPROB_BOUND, (req_id, worst)
            if req_id == "plain":
                assert got.outputs[req_id].kv_transfer_params is None
                continue
            report = _report(got, req_id)
            start = params.extra_args["kv_transfer_params"]["kmesh"]["segments"][0][0]
            first = report.get("prefix_cached_tokens", 0)
            expected = _expected_released(len(prompt["prompt_token_ids"]), max(start, first),
                                          start + doc_len)  # fmt: skip
            assert expected > 0
            assert report["released_blocks"] == expected, report
            # what it held at its end: its other blocks (prompt and generated rows) + its mirror
            tokens = len(prompt["prompt_token_ids"]) + max_tokens - 1
            kept = -(-tokens // BLOCK) - expected
            held = kept * _block_bytes(model) + report["mirror_bytes"]
            assert report["kv_held_bytes"] == held, report
            assert report["cascade_steps"] == max_tokens - 1 and "kv_share_off" not in report
            assert "released_blocks" not in _report(want, req_id)


def test_bf16_sharing_stays_within_the_cascade_decode_bound() -> None:
    """SmolLM2 in bf16, families of 4 and 8: with sharing vs without, log-probabilities within
    0.25 before the first different greedy token and at least 9 of 12 answers identical — the
    bound cascade decode states against vLLM's own bf16 noise (docs/contract.md)."""
    shared = _served("smollm2", True, (4, 8), 12, dtype="bfloat16")
    alone = _served("smollm2", False, (4, 8), 12, dtype="bfloat16")
    same, total = 0, 0
    for (got, requests), (want, _) in zip(shared, alone, strict=True):
        for req_id, _, _ in requests:
            if req_id == "plain":
                continue
            a, b = got.outputs[req_id], want.outputs[req_id]
            tokens, want_tokens = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
            first = next((i for i, (x, y) in enumerate(zip(tokens, want_tokens, strict=True))
                          if x != y), len(tokens))  # fmt: skip
            pairs = list(zip(_logprobs(a), _logprobs(b), strict=True))[: first + 1]
            assert max(abs(x - y) for x, y in pairs) <= 0.25, (req_id, pairs)
            same, total = same + (first == len(tokens)), total + 1
            assert _report(got, req_id)["released_blocks"] > 0
    assert total == 12 and same >= 9, (same, total)


def test_more_readers_fit_one_kv_budget() -> None:
    """8 readers of a 300-token document in a 60-block cache: with sharing all 8 decode at once
    and none is preempted; without it at most 5 run at once and vLLM preempts. Same tokens as
    an engine with room for all."""
    requests = _requests("tiny", 8, 40)

    def work(llm: Any) -> Driven:
        _read_first(llm, "tiny")
        return drive(llm, requests)

    shared = _engine(work, "tiny", True, blocks=60)
    alone = _engine(work, "tiny", False, blocks=60)
    roomy = _engine(work, "tiny", False)
    assert shared.most_running == 8 and shared.num_preempted == 0
    assert alone.most_running < 8 and alone.num_preempted > 0
    assert _tokens(shared) == _tokens(roomy)
    assert all(_report(shared, rid)["released_blocks"] > 0 for rid, _, _ in requests)


def _held(llm: Any) -> tuple[int, int, int]:
    """(masters held by cascade decode, released readers, blocks in use besides vLLM's null
    block) once all finished and one more step ran."""
    # the worker hears of finished requests with the next step
    drive(llm, [("tail", {"prompt_token_ids": [5, 6, 7]}, _params(None, 0, 1))])
    cascade = live_worker().cascade
    assert cascade is not None and cascade.sharing is not None
    from kmesh_blend.vllm.seam.engine import pool_state

    state = pool_state(llm)
    in_use = state.num_blocks - 1 - state.blocks_free
    return len(cascade.masters), len(cascade.sharing.pinned), in_use


def test_preempted_and_aborted_readers_stay_correct_and_nothing_stays_held() -> None:
    """8 readers generating 200 tokens each in a 40-block cache: even after giving back their
    document blocks they outgrow it, so vLLM preempts some (after they gave blocks back); two
    are aborted mid-decode. Every finished reader's tokens equal a roomy engine's (up to a near
    tie where vLLM recomputed a preempted reader's generated rows); at the end cascade decode
    holds no master and no reader, and vLLM's pool has every block back."""
    requests = _requests("tiny", 8, 200)

    def abort_two(step: int, driven: Driven) -> tuple[list[str], list[Request]]:
        return (["r3", "r6"] if step == 20 else []), []

    def work(llm: Any) -> tuple[Driven, tuple[int, int, int]]:
        _read_first(llm, "tiny")
        return drive(llm, requests, abort_two), _held(llm)

    def roomy_work(llm: Any) -> Driven:
        _read_first(llm, "tiny")
        return drive(llm, requests)

    tight, held = _engine(work, "tiny", True, blocks=40)
    assert held == (0, 0, 0)
    roomy = _engine(roomy_work, "tiny", False)
    assert set(tight.aborted) == {"r3", "r6"} and not {"r3", "r6"} & set(tight.outputs)
    preempted = [rid for rid, n in tight.preemptions.items() if n and rid in tight.outputs]
    assert preempted, "nothing was preempted"
    for rid, tokens in _tokens(tight).items():
        want = _tokens(roomy)[rid]
        same = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b), 200)
        if same < len(want):  # a near tie after vLLM recomputed its generated rows
            assert rid in preempted
            lp, want_lp = _logprobs(tight.outputs[rid]), _logprobs(roomy.outputs[rid])
            assert abs(lp[same] - want_lp[same]) < NEAR_TIE, (rid, same)
    for rid in preempted:
        report = _report(tight, rid)
        assert report["preemptions"] >= 1 and report["released_blocks"] > 0, report


def test_readers_outlive_their_family_and_its_master_in_the_store() -> None:
    """A family of 6 readers: one closes the family after 4 tokens; then a request of round 5
    retires round 0's segments, so the document's master leaves the store while 5 readers still
    decode (a later reader of it finds nothing to reuse). They decode on from the master cascade
    decode holds, to the tokens of an engine without sharing."""
    fam = {"family": "f", "round": 0}
    doc, prompts = _family("tiny", 7)
    ids, start = prompts[0]

    def run(share: bool) -> Driven:
        requests = [(f"r{i}", {"prompt_token_ids": p},
                     _params(s, len(doc), 4 if i == 1 else 60, close=i == 1, **fam))
                    for i, (p, s) in enumerate(prompts[1:7], 1)]  # fmt: skip
        other = torch.arange(5, 5 + 70).tolist()
        later = [("round5", {"prompt_token_ids": [*other, 9]}, _params(0, 70, 1, round=5))]

        def step(n: int, driven: Driven) -> tuple[list[str], list[Request]]:
            return [], later if n == 8 else []

        def work(llm: Any) -> Driven:
            drive(llm, [("r0", {"prompt_token_ids": ids}, _params(start, len(doc), 1, **fam))])
            driven = drive(llm, requests, step)
            again = drive(llm, [("again", {"prompt_token_ids": prompts[7][0]},
                                 _params(prompts[7][1], len(doc), 1, round=5))])  # fmt: skip
            driven.outputs.update(again.outputs)
            if share:
                assert _held(llm) == (0, 0, 0)
            return driven

        return _engine(work, "tiny", share, round_lifetime=1)

    shared, alone = run(True), run(False)
    assert _report(shared, "again")["reused_tokens"] == 0  # the master had left the store
    assert _tokens(shared) == _tokens(alone)
    for i in range(2, 7):
        report = _report(shared, f"r{i}")
        assert report["released_blocks"] > 0 and report["cascade_steps"] == 59, report
