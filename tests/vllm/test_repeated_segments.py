"""A prompt that reads one stored document twice, through real vLLM (tiny Llama, fp32, block 32).

Document A (150 tokens) is stored by a first reader; follow-ups hold it twice, apart or
adjacent, by annotated spans and by separator mode (a file repeated between separators). With
``kmesh.cascade_decode`` on, every follow-up decodes to the greedy tokens of cascade off
(log-probabilities within 1e-4: the sums run in another order), every decode step after the
first in cascade; at recompute ratio 1.0 both equal stock vLLM's tokens.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import kv_transfer_config, make_llm

pytestmark = pytest.mark.vllm

DOC, SEP, MAX_TOKENS, BLOCK = 150, 1, 12, 32
# [private, A, gap, A, question]: token counts (the layouts); gap 0 = adjacent copies
LAYOUTS = [(5, 9, 4), (12, 3, 6), (2, 0, 3), (20, 40, 2)]
Result = tuple[list[int], list[float], dict[str, Any] | None]


def _prompts() -> tuple[list[int], list[tuple[list[int], list[list[int]] | None]]]:
    """The first reader, then the follow-ups: (ids, spans) per layout, then two separator-mode
    prompts (spans None) that repeat the document as a file between separators."""
    gen = torch.Generator().manual_seed(3)

    def toks(n: int) -> list[int]:
        return torch.randint(3, TINY_LLAMA.vocab_size, (n,), generator=gen).tolist()

    doc = toks(DOC)
    reader = toks(7) + doc + toks(5)
    out: list[tuple[list[int], list[list[int]] | None]] = []
    for head, gap, tail in LAYOUTS:
        first, second = head, head + DOC + gap
        ids = toks(head) + doc + toks(gap) + doc + toks(tail)
        out.append((ids, [[first, first + DOC], [second, second + DOC]]))
    for head, gap in ((6, 8), (3, 0)):  # "P <sep> A <sep> M <sep> A <sep> Q"; M empty: no piece
        middle = [SEP, *toks(gap)] if gap else []
        out.append(([*toks(head), SEP, *doc, *middle, SEP, *doc, SEP, *toks(5)], None))
    return reader, out


def _serve(**kmesh: Any) -> list[Result]:
    from vllm import SamplingParams

    def params(spans: list[list[int]] | None, annotated: bool) -> Any:
        extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if spans else None
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0,
                              ignore_eos=True, extra_args=extra if annotated else None)  # fmt: skip

    annotated = bool(kmesh)
    config = kv_transfer_config(separator=[SEP], **kmesh) if annotated else None
    llm = make_llm(build_checkpoint(TINY_LLAMA), enable_prefix_caching=False, block_size=BLOCK,
                   kv_transfer_config=config)  # fmt: skip
    reader, follow_ups = _prompts()
    try:
        llm.generate([{"prompt_token_ids": reader}], params([[7, 7 + DOC]], annotated),
                     use_tqdm=False)  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in follow_ups],
            [params(spans, annotated) for _, spans in follow_ups],
            use_tqdm=False,
        )
        results = []
        for o in outs:
            tokens = list(o.outputs[0].token_ids)
            steps = zip(tokens, o.outputs[0].logprobs, strict=True)
            report = (o.kv_transfer_params or {}).get("kmesh")
            results.append((tokens, [float(lp[t].logprob) for t, lp in steps], report))
        return results
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("ratio", [1.0, 0.15])
def test_a_document_read_twice_decodes_in_cascade_to_the_same_tokens(ratio: float) -> None:
    # Without drift correction on both sides: the engine turns it off under cascade decode.
    off = _serve(recompute_ratio=ratio, cascade_decode=False, drift_correction="off")
    on = _serve(recompute_ratio=ratio, cascade_decode=True, drift_correction="off",
                speed_guard="off")  # fmt: skip
    stock = _serve() if ratio == 1.0 else None
    for i, ((t_off, lp_off, r_off), (t_on, lp_on, r_on)) in enumerate(zip(off, on, strict=True)):
        assert r_off is not None and r_on is not None
        assert r_off["fallback"] is None and r_on["fallback"] is None, r_on
        assert r_on["reused_tokens"] >= 2 * DOC, r_on  # both copies from the master
        assert t_on == t_off, f"follow-up {i}: cascade on {t_on} vs off {t_off}"
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off, strict=True)) <= 1e-4, i
        assert r_on["cascade_steps"] == MAX_TOKENS - 1, r_on
        assert r_on.get("cascade_off") is None, r_on
        if stock is not None:
            assert t_off == stock[i][0], f"follow-up {i}: ratio 1.0 {t_off} vs stock {stock[i][0]}"
