"""Cascade decode's reports through real vLLM (tiny Llama, fp32): every member of a family that
decoded without cascade says why in ``cascade_off`` (after a preemption), readers past one CPU
kernel call's row limit still decode in cascade, and a preempted request's report keeps what it
reused before and after.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from kmesh_blend.cpu import cpu_kernel_expected
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import kv_transfer_config, make_llm
from tests.vllm.family import DOC_LEN, prompts

pytestmark = pytest.mark.vllm

Result = tuple[list[int], list[float], dict[str, Any]]
NEAR_TIE = 1e-3  # fp32: vLLM recomputes a preempted request's generated rows in a prefill


def _serve(follow_ups: list[tuple[list[int], list[list[int]]]], reader: Any, max_tokens: int,
           prefix_caching: bool = False, cascade: bool = True,
           **engine: Any) -> list[Result]:  # fmt: skip
    from vllm import SamplingParams

    def params(spans: list[list[int]], n: int) -> Any:
        extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}}
        return SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0, extra_args=extra
        )

    config = kv_transfer_config(cascade_decode=cascade, drift_correction="off",
                                speed_guard="off")  # the raw path  # fmt: skip
    llm = make_llm(build_checkpoint(TINY_LLAMA), enable_prefix_caching=prefix_caching,
                   block_size=32, max_model_len=1024, kv_transfer_config=config,
                   **engine)  # fmt: skip
    try:
        llm.generate([{"prompt_token_ids": reader[0]}], params(reader[1], 1), use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in follow_ups],
                            [params(spans, max_tokens) for _, spans in follow_ups],
                            use_tqdm=False)  # fmt: skip
        results = []
        for o in outs:
            tokens = list(o.outputs[0].token_ids)
            steps = zip(tokens, o.outputs[0].logprobs, strict=True)
            logprobs = [float(lp[t].logprob) for t, lp in steps]
            results.append((tokens, logprobs, (o.kv_transfer_params or {})["kmesh"]))
        return results
    finally:
        del llm
        gc.collect()


@pytest.mark.skipif(not cpu_kernel_expected(), reason="the row limit is the CPU kernel's")
def test_readers_past_one_kernel_calls_limit_all_decode_in_cascade() -> None:
    """66 readers decode at once; one kernel call takes 64 · Hkv / H of them (64 here), so the
    path calls it again for the rest: every reader decodes every step in cascade, to the tokens
    of the same engine without cascade."""
    gen = torch.Generator().manual_seed(51)
    doc = torch.randint(3, 2048, (96,), generator=gen).tolist()
    follow_ups = []
    for i in range(66):
        head = torch.randint(3, 2048, (5 + i % 7,), generator=gen).tolist()
        follow_ups.append((head + doc + [7 + i, 9], [[len(head), len(head) + 96]]))
    reader = ([5, 6, *doc, 8], [[2, 98]])
    got = _serve(follow_ups, reader, max_tokens=4)
    assert all(r["fallback"] is None and r["reused_tokens"] == 96 for _, _, r in got)
    assert all(r.get("cascade_steps") == 3 and "cascade_off" not in r for _, _, r in got)
    want = _serve(follow_ups, reader, max_tokens=4, cascade=False)
    assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in want]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_preempted_request_keeps_its_reuse_figures(prefix_caching: bool) -> None:
    """Four follow-ups of 200 tokens each in a 40-block KV cache: vLLM preempts some. Each ends
    with the document reused, the preemption counted and (if it then decoded on vLLM's kernel)
    the reason. Its tokens equal those of an engine with room for all; where vLLM recomputed
    the generated rows in a prefill (prefix caching off), up to a near tie (fp32 rounding)."""
    family = prompts(seed=41)
    roomy = _serve(family[1:], family[0], 200, prefix_caching)
    tight = _serve(family[1:], family[0], 200, prefix_caching, num_gpu_blocks_override=40)
    assert any(r.get("preemptions") for _, _, r in tight), "nothing was preempted"
    for (tokens, logprobs, report), (want, want_lp, plain) in zip(tight, roomy, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b), 200)
        if same < len(want):  # two tokens of (almost) the same log-probability
            assert report.get("preemptions") and not prefix_caching, report
            assert abs(logprobs[same] - want_lp[same]) <= NEAR_TIE, (same, report)
        assert report["fallback"] is None and report["reused_tokens"] >= DOC_LEN, report
        assert plain.get("cascade_steps") == 199 and "preemptions" not in plain, plain
        if report.get("preemptions"):
            assert report["reused_tokens"] >= plain["reused_tokens"], report
            steps = report.get("cascade_steps", 0)
            assert steps > 0, report  # it decoded in cascade before (or after) the preemption
            # every step decoded in cascade but the prefill that resumed it (blended again),
            # or the report says why not
            if steps < 199 - report["preemptions"]:
                assert str(report.get("cascade_off")).startswith("preempted: "), report
