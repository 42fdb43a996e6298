"""`bench/beyond_selection.py`'s variants: its ``drift auto`` is the shipped path bit for bit, the
oracle shifts (per segment, per run of positions) lower the stale rows' error, the adaptive
budget grows with its mass, a per-layer budget computes fewer rows late than early, the
query-aware ranking changes the choice, a key scale scales the stale keys, a chained master
holds the previous blend's rows and a refreshed master the recomputed ones, at its own positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.blend import BlendOptions, blend_group
from kmesh_blend.blend.drift import DriftCorrection
from kmesh_blend.blend.plan import keep_count
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

    def run(drift: Any = None, mass: float | None = None, **kw: Any) -> Any:
        return bench.run_on_stale(bench.Variant(model, request, options, drift, mass, **kw), stale)

    on = BlendOptions(recompute_ratio=0.15, drift_correction="auto")
    shipped = blend_group(model, [request], source, on)[0]
    auto = run(DriftCorrection)
    assert all(torch.equal(a, b) for a, b in zip(auto.keys, shipped.keys, strict=True))
    assert torch.equal(auto.logits, shipped.logits)

    done = prefill(model, request.token_ids, last_only=True)
    full = list(zip(done.keys, done.values, strict=True))
    plain = run()
    before = bench._stale_error(plain, full, request.reused_mask)
    for bins in (None, 8):
        oracle = run(lambda *a, b=bins: bench.OracleShift(full, b, *a))
        assert torch.equal(oracle.recomputed, plain.recomputed)  # one check layer: same choice
        after = bench._stale_error(oracle, full, request.reused_mask)
        assert after[0] < before[0] and after[1] < before[1], (bins, before, after)
    assert bench._stale_error(run_all(model, request, source), full, request.reused_mask) is None

    small, large = run(mass=0.5), run(mass=0.95)
    assert plain.num_recomputed <= small.num_recomputed <= large.num_recomputed
    assert large.num_recomputed > plain.num_recomputed


def run_all(model: ReferenceModel, request: Any, source: Any) -> Any:
    return blend_group(model, [request], source, BlendOptions(recompute_ratio=1.0))[0]


def test_budgets_rankings_and_chains(model: ReferenceModel, bench: Any) -> None:
    task = _random_task(model.shape.vocab_size, 1)
    source = masters(model, task)
    request = task.requests[0].blend_request()
    stale = blend_group(model, [request], source, BlendOptions(recompute_ratio=0.0))[0]
    last = model.shape.num_layers - 1
    options = BlendOptions(recompute_ratio=0.15, check_layers=(1,))

    def run(**kw: Any) -> Any:
        blend = bench.Variant(model, request, options, **kw)
        return blend, bench.run_on_stale(blend, stale)

    flat, flat_res = run()
    front, front_res = run(later={last: 0.05})
    reused = int(request.reused_mask.sum())
    assert flat_res.num_recomputed == keep_count(0.15, reused)
    assert front_res.num_recomputed == keep_count(0.05, reused)
    assert front.token_layers < flat.token_layers

    _, query_res = run(query=True)
    assert not torch.equal(query_res.recomputed, flat_res.recomputed)
    assert query_res.num_recomputed == flat_res.num_recomputed

    _, scaled = run(key_scale=0.5)
    stale_rows = request.reused_mask & ~scaled.recomputed
    assert bool(stale_rows.any())
    assert torch.allclose(scaled.keys[last][stale_rows], 0.5 * stale.keys[last][stale_rows])
    assert torch.allclose(scaled.values[last][stale_rows], stale.values[last][stale_rows])

    chained = bench._chained(flat_res, request)
    for use in request.uses:
        keys, values, positions = chained.segments[use.segment_id]
        assert torch.equal(positions, torch.arange(use.start, use.end))
        assert torch.equal(keys[last], flat_res.keys[last][use.start : use.end])
        assert torch.equal(values[0], flat_res.values[0][use.start : use.end])

    refreshed = bench._refreshed(source, flat_res, request, model.rope)
    for use in request.uses:
        was, now = source.segments[use.segment_id], refreshed.segments[use.segment_id]
        fresh = flat_res.recomputed[use.start : use.end]
        assert bool(fresh.any()) and bool((~fresh).any())
        assert torch.equal(now.keys[:, ~fresh], was.keys[:, ~fresh])  # stale rows: the master's
        assert torch.equal(now.values[:, ~fresh], was.values[:, ~fresh])
        at = torch.arange(use.start, use.end)[fresh]
        assert torch.equal(now.values[last][fresh], flat_res.values[last][at])
        plain_new = model.rope.apply(now.keys[last][fresh].float(), -was.positions[fresh])
        plain_res = model.rope.apply(flat_res.keys[last][at].float(), -at)
        assert torch.allclose(plain_new, plain_res, atol=1e-4)  # same key, at the master's place


def test_calibrated_maps_shift_the_stale_rows(model: ReferenceModel, bench: Any) -> None:
    import drift_predictability as dp

    tasks = [_random_task(model.shape.vocab_size, seed) for seed in (2, 3)]
    per_task = dp.task_moments(dp.collect(model, tasks, check=1))
    request = tasks[0].requests[0].blend_request()
    source = masters(model, tasks[0])
    stale = blend_group(model, [request], source, BlendOptions(recompute_ratio=0.0))[0]
    options = BlendOptions(recompute_ratio=0.15, check_layers=(1,))

    def run(maps: Any) -> Any:
        drift = None if maps is None else (lambda *a: bench.CalibratedMap(maps, *a))
        return bench.run_on_stale(bench.Variant(model, request, options, drift), stale)

    plain = run(None)
    means = dp.calibrated_maps(per_task, skip=1, mean_only=True)  # task 0's own mean deviation
    shifted = run(means)
    assert torch.equal(shifted.recomputed, plain.recomputed)  # selected before any shift
    rows = (request.reused_mask & ~plain.recomputed).nonzero().squeeze(1)
    assert sorted(means) == list(range(2, model.shape.num_layers))
    for layer in range(model.shape.num_layers):
        dv = shifted.values[layer][rows] - plain.values[layer][rows]
        dk = model.rope.apply(shifted.keys[layer][rows] - plain.keys[layer][rows], -rows)
        if layer not in means:  # up to the check layer: no shift
            assert torch.equal(dv, torch.zeros_like(dv)) and torch.equal(dk, torch.zeros_like(dk))
            continue
        wk, wv = means[layer]
        assert torch.allclose(dv, wv[:, -1].expand_as(dv), atol=1e-5)
        assert torch.allclose(dk, wk[:, -1].expand_as(dk), atol=1e-4)
    # the per-token map fit on this very task's rows (in-sample) lowers its stale rows' error
    done = prefill(model, request.token_ids, last_only=True)
    full = list(zip(done.keys, done.values, strict=True))
    before = bench._stale_error(plain, full, request.reused_mask)
    after = bench._stale_error(run(dp.calibrated_maps(per_task, skip=1)), full, request.reused_mask)
    assert after[0] < before[0] and after[1] < before[1], (before, after)
