"""Several segments per prompt through vLLM: reordered, repeated, first seen together, collective.

Two documents A and B; the first reader stores both; follow-ups use them as B-then-A, A twice,
and A with B, in one batch. At recompute ratio 1.0 every follow-up must generate stock vLLM's
tokens; at 0.15 with collective selection the reports must show reuse of every span.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from kmesh_blend.testing import TINY_QWEN2, build_checkpoint
from kmesh_blend.testing.engine import make_llm
from tests.vllm.family import kv_transfer_config, params

pytestmark = pytest.mark.vllm


def _prompts() -> list[tuple[list[int], list[list[int]]]]:
    gen = torch.Generator().manual_seed(5)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 2048, (n,), generator=gen).tolist()

    a, b = toks(150), toks(90)
    out = []
    for parts in (["p", a, "m", b], ["p", b, "m", a], ["p", a, "m", a], [a, "m", b, "q"]):
        ids: list[int] = []
        spans = []
        for part in parts:
            if isinstance(part, str):
                ids += toks(11 + len(ids) % 7)
            else:
                spans.append([len(ids), len(ids) + len(part)])
                ids += part
        ids += toks(9)
        out.append((ids, spans))
    return out


def _run(llm: Any) -> list[tuple[list[int], dict[str, Any] | None]]:
    prompts = _prompts()
    llm.generate([{"prompt_token_ids": prompts[0][0]}], params(prompts[0][1]), use_tqdm=False)
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids, _ in prompts[1:]],
        [params(spans) for _, spans in prompts[1:]],
        use_tqdm=False,
    )
    return [(list(o.outputs[0].token_ids), (o.kv_transfer_params or {}).get("kmesh")) for o in outs]


def _engine(**extra: Any) -> Any:
    return make_llm(
        build_checkpoint(TINY_QWEN2),
        kv_transfer_config=kv_transfer_config(**extra),
        enable_prefix_caching=False,
    )


def test_multi_segment_layouts_through_vllm() -> None:
    stock = make_llm(build_checkpoint(TINY_QWEN2))
    want = [
        list(o.outputs[0].token_ids)
        for o in stock.generate(
            [{"prompt_token_ids": ids} for ids, _ in _prompts()[1:]], params(None), use_tqdm=False
        )
    ]
    del stock
    gc.collect()
    for extra, exact in (
        ({"recompute_ratio": 1.0}, True),
        ({"recompute_ratio": 0.15, "selection": "collective"}, False),
    ):
        llm = _engine(**extra)
        try:
            got = _run(llm)
        finally:
            del llm
            gc.collect()
        for (_, report), (_, spans) in zip(got, _prompts()[1:], strict=True):
            assert report is not None and report["fallback"] is None, report
            assert report["reused_tokens"] == sum(e - s for s, e in spans)
        if exact:
            assert [t for t, _ in got] == want
