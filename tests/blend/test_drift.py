"""Drift correction (`kmesh_blend.blend.drift`): the estimate on synthetic drifts, and the blend
with it on, on a tiny random model (fp32)."""

from __future__ import annotations

import pytest
import torch

from kmesh_blend.blend import BlendOptions, SegmentUse, blend_group
from kmesh_blend.blend.drift import DriftCorrection
from kmesh_blend.models import ReferenceModel
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from tests.blend.prompts import family

T, HKV, D = 24, 2, 8


def _rows(seed: int) -> torch.Tensor:
    return torch.randn(T, HKV, D, generator=torch.Generator().manual_seed(seed))


def _setup(drift_of_dropped: float) -> tuple[DriftCorrection, torch.Tensor, ...]:
    """Stored rows and fresh rows that moved by a common shift d (the kept rows by d, the
    dropped ones by ``drift_of_dropped`` · d), keys rotated at their positions."""
    rope = RotaryEmbedding(RopeConfig(head_dim=D))
    pos = torch.arange(T) + 5
    base_k, base_v, d_k, d_v = _rows(0), _rows(1), _rows(2)[:1], _rows(3)[:1]
    kept = torch.arange(T) < 8
    scale = torch.where(kept, 1.0, drift_of_dropped)[:, None, None]
    fresh_k = rope.apply(base_k + scale * d_k, pos)
    stored_k = rope.apply(base_k, pos)
    fresh_v, stored_v = base_v + scale * d_v, base_v.clone()
    own = torch.ones(T, dtype=torch.bool)
    drift = DriftCorrection(rope, pos, own, (SegmentUse(0, T, "doc"),))
    computed = torch.arange(T)
    drift.calibrate(computed, fresh_k, fresh_v, stored_k, stored_v, kept.nonzero().squeeze(1))
    return drift, kept, fresh_k, fresh_v, stored_k, stored_v


def _apply(drift: DriftCorrection, kept: torch.Tensor, fresh_k: torch.Tensor,
           fresh_v: torch.Tensor, stored_k: torch.Tensor,
           stored_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A layer as the executor builds it: the stored rows shifted, then the computed rows."""
    layer_k, layer_v = stored_k.clone(), stored_v.clone()
    rows = kept.nonzero().squeeze(1)
    drift.apply(rows, fresh_k[rows], fresh_v[rows], stored_k[rows], stored_v[rows],
                layer_k, layer_v)  # fmt: skip
    layer_k[rows], layer_v[rows] = fresh_k[rows], fresh_v[rows]
    return layer_k, layer_v


def test_a_common_shift_is_restored_on_the_stale_rows() -> None:
    drift, kept, fresh_k, fresh_v, stored_k, stored_v = _setup(1.0)
    alpha_k, alpha_v = drift.alphas[0]
    torch.testing.assert_close(alpha_k, torch.ones(HKV, 1))
    torch.testing.assert_close(alpha_v, torch.ones(HKV, 1))
    layer_k, layer_v = _apply(drift, kept, fresh_k, fresh_v, stored_k, stored_v)
    assert drift.shifted_rows == int((~kept).sum())
    torch.testing.assert_close(layer_k, fresh_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer_v, fresh_v, atol=1e-5, rtol=1e-5)


def test_the_shift_is_scaled_by_the_share_the_dropped_rows_had() -> None:
    drift, kept, fresh_k, fresh_v, stored_k, stored_v = _setup(0.25)
    torch.testing.assert_close(drift.alphas[0][0], torch.full((HKV, 1), 0.25))
    layer_k, layer_v = _apply(drift, kept, fresh_k, fresh_v, stored_k, stored_v)
    torch.testing.assert_close(layer_k, fresh_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer_v, fresh_v, atol=1e-5, rtol=1e-5)


def test_rows_that_did_not_move_stay_as_stored() -> None:
    drift, kept, fresh_k, fresh_v, stored_k, stored_v = _setup(0.0)
    layer_k, layer_v = _apply(drift, kept, fresh_k, fresh_v, stored_k, stored_v)
    assert torch.equal(layer_k[~kept], stored_k[~kept])
    assert torch.equal(layer_v[~kept], stored_v[~kept])


def test_borrowed_rows_are_never_shifted() -> None:
    rope = RotaryEmbedding(RopeConfig(head_dim=D))
    pos = torch.arange(T)
    own = torch.arange(T) >= 12  # the first half is an exact prefix: borrowed
    drift = DriftCorrection(rope, pos, own, (SegmentUse(0, T, "doc"),))
    fresh_k, fresh_v = _rows(0) + 1.0, _rows(1) + 1.0
    stored_k, stored_v = _rows(0), _rows(1)
    drift.calibrate(torch.arange(T), fresh_k, fresh_v, stored_k, stored_v, torch.arange(16))
    layer_k, layer_v = stored_k.clone(), stored_v.clone()
    rows = torch.arange(16)
    drift.apply(rows, fresh_k[rows], fresh_v[rows], stored_k[rows], stored_v[rows],
                layer_k, layer_v)  # fmt: skip
    assert torch.equal(layer_k[:12], stored_k[:12])  # borrowed rows: as given
    assert torch.equal(layer_v[:12], stored_v[:12])
    assert not torch.equal(layer_k[16:], stored_k[16:])  # own stale rows moved
    assert drift.shifted_rows == T - 16


def test_own_rows_must_form_one_range() -> None:
    rope = RotaryEmbedding(RopeConfig(head_dim=D))
    own = torch.ones(T, dtype=torch.bool)
    own[5] = False
    drift = DriftCorrection(rope, torch.arange(T), own, (SegmentUse(0, T, "doc"),))
    with pytest.raises(ValueError, match="not one range"):
        drift.calibrate(torch.arange(T), _rows(0), _rows(1), _rows(2), _rows(3), torch.arange(4))


@pytest.fixture(scope="module")
def llama() -> ReferenceModel:
    return ReferenceModel.load(build_checkpoint(TINY_LLAMA))


@pytest.mark.parametrize("layout", ["reordered", "repeated"])
def test_blend_with_drift_on(llama: ReferenceModel, layout: str) -> None:
    """Ratio 1.0 stays bit-identical and ratio 0 (no check layer) untouched; in between, the same
    tokens are recomputed and the rows left stale move."""
    requests, source = family(llama, layout, 3, seg_len=64)
    for ratio in (1.0, 0.0, 0.3):
        off = blend_group(
            llama, requests, source, BlendOptions(recompute_ratio=ratio, check_layers=(1,))
        )
        on = blend_group(llama, requests, source, BlendOptions(
            recompute_ratio=ratio, check_layers=(1,), drift_correction="auto"))  # fmt: skip
        for req, a, b in zip(requests, off, on, strict=True):
            assert torch.equal(a.recomputed, b.recomputed)
            same = [torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values,
                                                       strict=True)]  # fmt: skip
            if ratio in (0.0, 1.0):
                assert all(same) and torch.equal(a.logits, b.logits)
                continue
            # Layer 0 runs before any check layer: nothing is stale there yet.
            assert torch.equal(a.keys[0], b.keys[0]) and torch.equal(a.values[0], b.values[0])
            stale = req.reused_mask & ~a.recomputed
            assert not torch.equal(a.values[-1][stale], b.values[-1][stale])


def test_the_engine_default_is_on_except_under_cascade_decode() -> None:
    from kmesh_blend.config import KMeshConfig

    assert BlendOptions().drift_correction == "off"  # the library primitive: plain CacheBlend
    assert BlendOptions.from_config(KMeshConfig()).drift_correction == "auto"
    cascade = KMeshConfig(cascade_decode=True)
    assert BlendOptions.from_config(cascade).drift_correction == "off"
    # A request that asks for it still gets it.
    assert BlendOptions.from_config(cascade).for_request(None, None, "auto").drift_correction == (
        "auto"
    )
