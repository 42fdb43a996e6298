"""`bench/drift_predictability.py`: its ridge map recovers a known affine map, a map that holds
across tasks is found from the other tasks, and the rows it collects are what it says (the
deviations of the toy model's full prefill from the re-positioned masters)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.blend import BlendOptions, blend_group
from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.quality.chat_harness import masters
from kmesh_blend.testing.quality import quality_model_dir

from .test_chat import _random_task


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    monkeypatch.delitem(sys.modules, "drift_predictability", raising=False)
    import drift_predictability

    return drift_predictability


def test_ridge_recovers_an_affine_map(bench: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 6, generator=gen)
    w = torch.randn(7, 3, generator=gen)
    y = bench.apply_map(w, x)
    assert torch.allclose(bench.ridge(bench.moments(x, y), 1e-9), w, atol=1e-3)
    # a strong penalty shrinks the map towards zero
    assert bench.ridge(bench.moments(x, y), 1e3).abs().max() < 0.1 * w.abs().max()


def _synthetic(gen: torch.Generator, m: torch.Tensor, tasks: int) -> list[list[dict[str, Any]]]:
    """Tasks whose later-layer deviation is one affine map of the check-layer one (heads 2)."""
    data = []
    for _ in range(tasks):
        rows = []
        for _ in range(2):
            ck, cv = torch.randn(2, 50, 2, 4, generator=gen)
            feat = torch.cat([ck, cv], -1)
            y = torch.einsum("nhf,fo->nho", feat, m) + 0.5
            order = torch.randperm(50, generator=gen)
            rows.append({"feat": feat, "check": (ck, cv), "kept": order[:8], "stale": order[8:],
                         "dev": {2: (y, -y)}})  # fmt: skip
        data.append(rows)
    return data


def test_a_map_shared_by_tasks_is_learnt_from_the_others(bench: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    shares = bench.removed_shares(_synthetic(gen, torch.randn(8, 4, generator=gen), 3))
    for lam in bench.LAMBDAS[:1]:
        for kv in (0, 1):
            assert shares[f"per-token map, other tasks λ={lam}"][kv] > 0.99
            assert shares[f"per-token map, in-sample λ={lam}"][kv] > 0.99
    # a shared shift only removes the mean: here a small part of the error
    assert 0.0 < shares["oracle segment mean"][0] < 0.5
    assert shares["drift share"][0] <= shares["oracle segment mean"][0] + 1e-6
    # every task shares the offset 0.5: the other tasks' mean finds it
    assert 0.0 < shares["other tasks' mean shift"][0] <= shares["oracle segment mean"][0] + 1e-6


def test_collected_rows_are_the_deviations_from_the_masters(bench: Any) -> None:
    model = ReferenceModel.load(quality_model_dir(), torch.float32)
    task = _random_task(model.shape.vocab_size, 0)
    (rows,) = bench.collect(model, [task], check=1)
    prompt, got = task.requests[0], rows[0]
    request = prompt.blend_request()
    idx = request.reused_mask.nonzero().squeeze(1)
    n, layers = idx.numel(), model.shape.num_layers
    assert sorted(torch.cat([got["kept"], got["stale"]]).tolist()) == list(range(n))
    assert got["kept"].numel() == round(bench.RATIO * n)
    assert sorted(got["dev"]) == list(range(2, layers))
    full = prefill(model, request.token_ids, last_only=True)
    plain = BlendOptions(recompute_ratio=0.0, check_layers=(1,))
    stale = blend_group(model, [request], masters(model, task), plain)[0]
    last = layers - 1
    dv = got["dev"][last][1]
    assert torch.equal(dv, (full.values[last][idx] - stale.values[last][idx]).float())
    assert dv.abs().max() > 0  # the masters were computed after other text: rows moved
    # keys in the unrotated frame: rotating back to each row's position gives the difference
    dk = model.rope.apply(got["dev"][last][0], idx)
    want = (full.keys[last][idx] - stale.keys[last][idx]).float()
    assert torch.allclose(dk, want, atol=1e-5)
    # the kept rows deviate most at the check layer
    score = got["feat"].pow(2).sum((1, 2))
    assert score[got["kept"]].min() >= score[got["stale"]].max()
