"""`bench/beyond_selection.py`'s variants: its ``drift auto`` is the shipped path bit for bit, the
oracle shift is the least-squares segment-wide shift, and the adaptive budget grows with its
mass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.blend import BlendOptions, blend_group
from kmesh_blend.blend.drift import DriftCorrection
from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.quality.chat_harness import masters
from kmesh_blend.testing.quality import quality_model_dir

from .test_chat import _random_task


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel.load(quality_model_dir(), torch.float32)


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import beyond_selection

    return beyond_selection


def test_variants(model: ReferenceModel, bench: Any) -> None:
    task = _random_task(model.shape.vocab_size, 0)
    source = masters(model, task)
    request = task.requests[0].blend_request()
    stale = blend_group(model, [request], source, BlendOptions(recompute_ratio=0.0))[0]
    options = BlendOptions(recompute_ratio=0.15, check_layers=(1,))

    def run(drift: Any = None, mass: float | None = None) -> Any:
        return bench.run_on_stale(bench._Variant(model, request, options, drift, mass), stale)

    on = BlendOptions(recompute_ratio=0.15, drift_correction="auto")
    shipped = blend_group(model, [request], source, on)[0]
    auto = run(DriftCorrection)
    assert all(torch.equal(a, b) for a, b in zip(auto.keys, shipped.keys, strict=True))
    assert torch.equal(auto.logits, shipped.logits)

    done = prefill(model, request.token_ids, last_only=True)
    full = list(zip(done.keys, done.values, strict=True))
    plain = run()
    oracle = run(lambda *a: bench._OracleShift(full, *a))
    assert torch.equal(oracle.recomputed, plain.recomputed)  # one check layer: the same choice
    before = bench._stale_error(plain, full, request.reused_mask)
    after = bench._stale_error(oracle, full, request.reused_mask)
    assert after[0] < before[0] and after[1] < before[1], (before, after)

    small, large = run(mass=0.5), run(mass=0.95)
    assert plain.num_recomputed <= small.num_recomputed <= large.num_recomputed
    assert large.num_recomputed > plain.num_recomputed
