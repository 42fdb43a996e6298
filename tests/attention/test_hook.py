"""Consumer (a): blend_group with cascade attention vs the model's own attention.

Measured difference (fp32 tiny Llamas, 4 layers): logits ≤ 1.3e-6 from the plain blend (stated
tolerance 1e-5; printed with -s), the same recomputed tokens. Per-request hooks: bit-identical
logits and KV between the ``sequential`` and ``layer_sync`` schedules. Group attention: one
cascade call per layer for the group, each master layer read once; across schedules within 1e-5
(the difference is printed: the shared level's GEMM shape depends on the group).
"""

from collections.abc import Sequence

import pytest
import torch

import kmesh_blend.attention.hook as hook_module
from kmesh_blend.attention.hook import CascadeGroupAttention, cascade_hooks
from kmesh_blend.blend import BlendOptions, blend_group
from kmesh_blend.blend.source import SegmentSource
from kmesh_blend.models import ReferenceModel
from kmesh_blend.testing import TINY_LLAMA, TINY_LLAMA_ROPE3, build_checkpoint
from tests.blend.prompts import family


@pytest.fixture(scope="module", params=[TINY_LLAMA, TINY_LLAMA_ROPE3], ids=lambda s: s.name)
def model(request: pytest.FixtureRequest) -> ReferenceModel:
    return ReferenceModel.load(build_checkpoint(request.param))


@pytest.mark.parametrize("layout", ["middle", "reordered", "repeated"])
def test_hooks_match_plain_blend_and_are_schedule_exact(model: ReferenceModel, layout: str) -> None:
    requests, source = family(model, layout, 3)
    plain = blend_group(model, requests, source, BlendOptions())
    runs = {}
    for schedule in ("layer_sync", "sequential"):
        opts = BlendOptions(schedule=schedule)
        hooks = cascade_hooks(model, requests, source, opts, backend="torch")
        runs[schedule] = blend_group(model, requests, source, opts, attention=hooks)
    for p, a, b in zip(plain, runs["layer_sync"], runs["sequential"], strict=True):
        assert torch.equal(a.logits, b.logits)
        assert all(torch.equal(x, y) for x, y in zip(a.keys, b.keys, strict=True))
        assert torch.equal(a.recomputed, p.recomputed)
        diff = float((a.logits - p.logits).abs().max())
        print(f"{layout}: max |logit(cascade) − logit(plain)| = {diff:.2e}")
        assert 0 < diff <= 1e-5  # not bit-exact (rotated queries), but within fp32 rounding


def test_hooks_refuse_collective(model: ReferenceModel) -> None:
    requests, source = family(model, "middle", 2)
    with pytest.raises(ValueError, match="per_request"):
        cascade_hooks(model, requests, source, BlendOptions(selection="collective"))
    with pytest.raises(ValueError, match="per_request"):
        CascadeGroupAttention(model, requests, source, BlendOptions(selection="collective"))


class _CountingSource:
    """A `SegmentSource` that counts (segment, layer) reads."""

    def __init__(self, inner: SegmentSource) -> None:
        self.inner, self.reads = inner, 0

    def positions(self, segment_id: str) -> torch.Tensor:
        return self.inner.positions(segment_id)

    def layer_kv(self, segment_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.inner.layer_kv(segment_id, layer)


def _group_run(
    model: ReferenceModel, requests: Sequence, source: SegmentSource, schedule: str
) -> list:
    opts = BlendOptions(schedule=schedule)
    attn = CascadeGroupAttention(model, requests, source, opts, backend="torch")
    return blend_group(model, requests, attn.source, opts, group_attention=attn)


@pytest.mark.parametrize(("layout", "n"), [("middle", 4), ("reordered", 3), ("repeated", 8)])
def test_group_attention_matches_plain_blend(model: ReferenceModel, layout: str, n: int) -> None:
    requests, source = family(model, layout, n)
    plain = blend_group(model, requests, source, BlendOptions())
    sync = _group_run(model, requests, source, "layer_sync")
    seq = _group_run(model, requests, source, "sequential")
    worst_plain = worst_sched = 0.0
    for p, a, b in zip(plain, sync, seq, strict=True):
        assert torch.equal(a.recomputed, p.recomputed)
        assert torch.equal(a.recomputed, b.recomputed)
        worst_plain = max(worst_plain, float((a.logits - p.logits).abs().max()))
        worst_sched = max(worst_sched, float((a.logits - b.logits).abs().max()))
    print(
        f"{layout} N={n}: |group − plain| {worst_plain:.2e}, |layer_sync − seq| {worst_sched:.2e}"
    )
    assert 0 < worst_plain <= 1e-5
    assert worst_sched <= 1e-5


def test_group_attention_reads_each_master_once_per_layer(
    model: ReferenceModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests, dense = family(model, "reordered", 4)  # two segments A, B; every sibling uses both
    calls: list[tuple[int, int]] = []
    real = hook_module.cascade_attention

    def spy(siblings, segments, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((len(siblings), len(segments)))
        return real(siblings, segments, *args, **kwargs)

    monkeypatch.setattr(hook_module, "cascade_attention", spy)
    layers = model.shape.num_layers
    source = _CountingSource(dense)
    _group_run(model, requests, source, "layer_sync")
    # Layer 0 (before the check layer 1) computes every token: no stored KV is read or attended.
    # From layer 1 on, frames and attention share one read per segment layer for the group.
    assert source.reads == 2 * (layers - 1)
    assert calls == [(4, 0)] + [(4, 2)] * (layers - 1)  # one call per layer for all 4 siblings
    calls.clear()
    hooks = cascade_hooks(model, requests, source, BlendOptions(), backend="torch")
    blend_group(model, requests, source, BlendOptions(), attention=hooks)
    assert sorted(calls) == sorted([(1, 0)] * 4 + [(1, 2)] * (4 * (layers - 1)))
