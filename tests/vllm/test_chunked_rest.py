"""A blend that stops at its segment's end, with the prompt's rest prefilled in chunks (real vLLM).

Under load vLLM prefills what the blend left (the question after the document) over several
steps, and the load step's blocks end before the prompt does. The blend then writes only what
those blocks hold, and a cascade plan takes the rest's blocks at its first decode step
(`DecodePlan.complete`). Before that, the load indexed past its blocks and the engine died (the
serving benchmark's cascade server at 0.9 requests/s). Tiny Llama, fp32, block size 32, a
32-token step budget: a 100-token question (longer than what the blend computes before it, so
the blend leaves it to vLLM: `scheduler_reuse.blend_end`) is split over four steps and crosses
block boundaries.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import kv_transfer_config, make_llm
from kmesh_blend.vllm.meta import LoadRequest

pytestmark = pytest.mark.vllm

DOC, QUESTION, FOLLOW_UPS, TOKENS, BLOCK = 416, 100, 3, 6, 32


def _prompts() -> list[tuple[list[int], list[list[int]]]]:
    gen = torch.Generator().manual_seed(7)
    doc = torch.randint(3, 2048, (DOC,), generator=gen).tolist()
    out = []
    for i in range(FOLLOW_UPS + 1):
        private = torch.randint(3, 2048, (20 + 5 * i,), generator=gen).tolist()
        question = torch.randint(3, 2048, (QUESTION + i,), generator=gen).tolist()
        out.append((private + doc + question, [[len(private), len(private) + DOC]]))
    return out


def _run(budget: int, **kmesh: Any) -> list[tuple[list[int], dict[str, Any]]]:
    from vllm import SamplingParams

    def params(spans: list[list[int]]) -> Any:
        extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}}
        return SamplingParams(temperature=0.0, max_tokens=TOKENS, extra_args=extra)

    llm = make_llm(build_checkpoint(TINY_LLAMA), block_size=BLOCK, max_num_batched_tokens=budget,
                   max_num_seqs=8, enable_prefix_caching=False,
                   kv_transfer_config=kv_transfer_config(recompute_ratio=0.15,
                                                         drift_correction="off",
                                                         speed_guard="off", **kmesh))  # fmt: skip
    try:
        family = _prompts()
        llm.generate([{"prompt_token_ids": family[0][0]}], params(family[0][1]), use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in family[1:]],
                            [params(spans) for _, spans in family[1:]], use_tqdm=False)  # fmt: skip
        return [(list(o.outputs[0].token_ids), o.kv_transfer_params["kmesh"]) for o in outs]
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("cascade", [False, True])
def test_a_rest_prefilled_in_chunks_after_the_blend(
    cascade: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots, held = LoadRequest.slots, []

    def spy(self: LoadRequest, block_size: int) -> torch.Tensor:
        out = slots(self, block_size)
        held.append((int(out.numel()), len(self.token_ids), self.blend_len))
        return out

    monkeypatch.setattr(LoadRequest, "slots", spy)
    chunked = _run(32, cascade_decode=cascade)
    # the load step's blocks ended before the prompt did, and still held what the blend wrote
    assert any(n < total for n, total, _ in held), held
    assert all(n >= blend for n, _, blend in held), held
    monkeypatch.undo()
    whole = _run(2048, cascade_decode=cascade)
    assert [t for t, _ in chunked] == [t for t, _ in whole]
    for (_, report), (_, other) in zip(chunked, whole, strict=True):
        assert report.get("fallback") is None and report["reused_tokens"] >= DOC, report
        assert report["recomputed_tokens"] == other["recomputed_tokens"]
        if cascade:  # every decode step after the first token, in cascade
            assert report.get("cascade_steps") == TOKENS - 1, report
