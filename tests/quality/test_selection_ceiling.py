"""`bench/selection_ceiling.py`'s oracle blends: they recompute exactly the top-scored reused
tokens, and given the default rule's choice they give the group executor's bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.blend import BlendOptions, blend_group, keep_count
from kmesh_blend.models import ReferenceModel
from kmesh_blend.quality.chat_harness import masters
from kmesh_blend.testing.quality import quality_model_dir

from .test_chat import _random_task


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel.load(quality_model_dir(), torch.float32)


@pytest.fixture()
def ceiling(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import selection_ceiling

    return selection_ceiling


def test_oracle_blend_recomputes_the_top_scored_tokens(model: ReferenceModel, ceiling: Any) -> None:
    task = _random_task(model.shape.vocab_size, 0)
    source = masters(model, task)
    request = task.requests[0].blend_request()
    plain = BlendOptions(recompute_ratio=0.0, check_layers=(1,))
    stale = blend_group(model, [request], source, plain)[0]
    score = torch.rand(request.token_ids.numel(), generator=torch.Generator().manual_seed(3))
    out = ceiling.run_on_stale(ceiling._Ranked(model, request, score), stale)
    reused = request.reused_mask
    rows = reused.nonzero().squeeze(1)
    count = keep_count(ceiling.RATIO, rows.numel())  # ranked across the request's documents
    want = torch.zeros_like(reused)
    want[rows[score[rows].topk(count).indices]] = True
    assert count > 0 and torch.equal(out.recomputed, want)
    # The same selection through the group executor gives the same bits: `run_on_stale` feeds
    # the plain blend's stored rows, which are the re-positioned masters.
    default = BlendOptions(recompute_ratio=ceiling.RATIO, check_layers=(1,))
    grouped = blend_group(model, [request], source, default)[0]
    rerun = ceiling.run_on_stale(ceiling._Ranked(model, request, _deviation_order(grouped)), stale)
    assert torch.equal(rerun.recomputed, grouped.recomputed)
    assert all(torch.equal(a, b) for a, b in zip(rerun.keys, grouped.keys, strict=True))
    assert torch.equal(rerun.logits, grouped.logits)


def _deviation_order(result: Any) -> torch.Tensor:
    """A score that ranks the tokens the default rule kept above all others."""
    return result.recomputed.float()
