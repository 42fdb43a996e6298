"""The blend on the reference model: reuse is real, selection counts, read counts, failure paths."""

import pytest
import torch

from kmesh_blend.blend import (
    BlendOptions,
    BlendRequest,
    RequestBlend,
    SegmentUse,
    blend_group,
    blend_one,
    keep_count,
)
from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.testing import TINY_LLAMA, TINY_QWEN3, build_checkpoint
from tests.blend.prompts import family


@pytest.fixture(scope="module")
def llama() -> ReferenceModel:
    return ReferenceModel.load(build_checkpoint(TINY_LLAMA))


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3])
def test_recomputed_share_and_deviation(llama: ReferenceModel, ratio: float) -> None:
    requests, source = family(llama, "middle", 1, seg_len=200)
    req = requests[0]
    result = blend_one(llama, req, source, BlendOptions(recompute_ratio=ratio))
    assert result.num_reused == 200
    assert result.num_recomputed == keep_count(ratio, 200)
    assert not bool(result.recomputed[~req.reused_mask].any())
    full = prefill(llama, req.token_ids, last_only=True)
    deviation = float((result.logits - full.logits).abs().max())
    plain = blend_one(llama, req, source, BlendOptions(recompute_ratio=0.0))
    plain_dev = float((plain.logits - full.logits).abs().max())
    print(f"ratio {ratio}: max |logit − full| = {deviation:.4f} (plain reuse {plain_dev:.4f})")
    assert deviation > 0 and plain.num_recomputed == 0
    # Reuse is real: the private tokens' KV is fresh, the unselected reused rows are stored ones.
    unselected = (~result.recomputed & req.reused_mask).nonzero().squeeze(1)
    start = req.uses[0].start
    assert not torch.equal(result.keys[2][unselected], full.keys[2][unselected])
    assert result.keys[2].shape == full.keys[2].shape
    # Values are never moved: unselected rows are the stored ones exactly.
    assert torch.equal(
        result.values[2][unselected], source.segments["A"].values[2][unselected - start]
    )


def test_gradual_filtering_keeps_the_ratio_at_the_last_check(llama: ReferenceModel) -> None:
    requests, source = family(llama, "middle", 1, seg_len=100)
    opts = BlendOptions(recompute_ratio=0.2, check_layers=(1, 2, 3))
    result = blend_one(llama, requests[0], source, opts)
    assert result.num_recomputed == 20


def test_deviation_on_values_and_both(llama: ReferenceModel) -> None:
    requests, source = family(llama, "middle", 1, seg_len=100)
    picks = {
        kind: blend_one(llama, requests[0], source, BlendOptions(deviation=kind)).recomputed
        for kind in ("k", "v", "kv")
    }
    assert all(int(p.sum()) == 15 for p in picks.values())
    assert not torch.equal(picks["k"], picks["v"])


def test_layer_sync_reads_each_segment_layer_once(llama: ReferenceModel) -> None:
    requests, source = family(llama, "reordered", 4)
    blend_group(llama, requests, source, BlendOptions(schedule="layer_sync"))
    # Layer 0 computes every token (check layer 1), so layers 1..3 read A and B once each.
    assert dict(source.reads) == {(s, layer): 1 for s in "AB" for layer in (1, 2, 3)}
    source.reads.clear()
    blend_group(llama, requests, source, BlendOptions(schedule="sequential"))
    assert all(count == 4 for count in source.reads.values())


def test_collective_leader_recomputes_and_siblings_borrow() -> None:
    model = ReferenceModel.load(build_checkpoint(TINY_QWEN3))
    requests, source = family(model, "middle", 4, seg_len=100)
    results = blend_group(model, requests, source, BlendOptions(selection="collective"))
    assert [r.num_recomputed for r in results] == [15, 0, 0, 0]
    for req, res in zip(requests, results, strict=True):
        full = prefill(model, req.token_ids, last_only=True)
        assert res.logits.shape == full.logits.shape and torch.isfinite(res.logits).all()


def test_unannotated_request_is_a_full_prefill(llama: ReferenceModel) -> None:
    ids = torch.randint(3, 2048, (30,), generator=torch.Generator().manual_seed(3))
    _, source = family(llama, "middle", 1)
    result = blend_one(llama, BlendRequest(ids), source, BlendOptions())
    full = prefill(llama, ids, last_only=True)
    assert torch.equal(result.logits, full.logits) and result.num_reused == 0


def test_bad_inputs_raise_clear_errors(llama: ReferenceModel) -> None:
    requests, source = family(llama, "middle", 1)
    with pytest.raises(ValueError, match="check_layers"):
        blend_one(llama, requests[0], source, BlendOptions(check_layers=(9,)))
    with pytest.raises(ValueError, match="schedule"):
        blend_group(llama, requests, source, BlendOptions(schedule="async"))  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        source.segments.pop("A")
        blend_one(llama, requests[0], source, BlendOptions())


def test_outside_spans_are_the_uncovered_tokens() -> None:
    from kmesh_blend.blend.group import _outside_spans

    uses = (SegmentUse(3, 7, "a"), SegmentUse(7, 9, "b"), SegmentUse(12, 15, "a"))
    req = BlendRequest(torch.arange(16), uses)
    assert _outside_spans(req) == [slice(0, 3), slice(9, 12), slice(15, 16)]
    assert _outside_spans(BlendRequest(torch.arange(4), (SegmentUse(0, 4, "a"),))) == []


@pytest.mark.parametrize("selection", ["per_request", "collective"])
def test_an_exact_prefix_is_read_never_recomputed(llama: ReferenceModel, selection: str) -> None:
    """Tokens [0, P) with exact KV (vLLM's prefix cache) are neither computed nor selected; the
    rest is blended over them. At ratio 1.0 the result is the full prefill's (the exact prefix
    stands in for the prefix's own computation)."""
    from kmesh_blend.blend import DenseSegmentSource, SegmentKV

    requests, source = family(llama, "middle", 2, seg_len=100)
    req = requests[0]
    p = req.uses[0].start  # the private head, cached exactly
    full = prefill(llama, req.token_ids)
    head = SegmentKV(
        torch.stack(full.keys)[:, :p], torch.stack(full.values)[:, :p], torch.arange(p)
    )
    both = DenseSegmentSource({**source.segments, "head": head})
    cached = BlendRequest(req.token_ids, (SegmentUse(0, p, "head"), *req.uses), exact_prefix=p)
    opts = BlendOptions(recompute_ratio=1.0, selection=selection)  # type: ignore[arg-type]
    result = blend_group(llama, [cached, requests[1]], both, opts)[0]
    assert result.num_reused == 100 and result.num_recomputed == 100
    assert not bool(result.recomputed[:p].any())
    for layer in range(llama.shape.num_layers):
        assert torch.equal(result.keys[layer][:p], full.keys[layer][:p])
        torch.testing.assert_close(result.keys[layer], full.keys[layer], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(result.logits, full.logits[-1:], rtol=1e-4, atol=1e-4)
    partial = blend_one(llama, cached, both, BlendOptions(recompute_ratio=0.15))
    assert not bool(partial.recomputed[:p].any()) and partial.num_recomputed == 15
    with pytest.raises(ValueError, match="exact_prefix"):
        BlendRequest(req.token_ids, req.uses, exact_prefix=p)


def test_start_of_segment_rule_recomputes_each_segments_first_tokens(
    llama: ReferenceModel,
) -> None:
    requests, source = family(llama, "reordered", 2, seg_len=40)  # A: 40 tokens, B: 23
    req = requests[1]  # B then A
    opts = BlendOptions(recompute_ratio=0.0, sink_tokens=5)
    state = RequestBlend(llama, req, opts)
    assert state.checks == {}  # no check layer runs for this rule
    result = blend_one(llama, req, source, opts)
    want = torch.zeros_like(result.recomputed)
    for use in req.uses:
        want[use.start : use.start + 5] = True
    assert torch.equal(result.recomputed, want)
    assert result.num_recomputed == 10
    # It acts: the sinks' KV is fresh, and the logits move toward the full prefill's.
    full = prefill(llama, req.token_ids, last_only=True)
    plain = blend_one(llama, req, source, BlendOptions(recompute_ratio=0.0))
    first = req.uses[0].start
    assert not torch.equal(result.keys[2][first], plain.keys[2][first])
    assert float((result.logits - full.logits).abs().max()) < float(
        (plain.logits - full.logits).abs().max()
    )
    # More sinks than a segment has tokens: the whole segment, no more.
    whole = blend_one(llama, req, source, BlendOptions(recompute_ratio=0.0, sink_tokens=1000))
    assert torch.equal(whole.recomputed, req.reused_mask)


def test_sinks_and_deviation_combine(llama: ReferenceModel) -> None:
    requests, source = family(llama, "middle", 1, seg_len=100)
    req = requests[0]
    start = req.uses[0].start
    result = blend_one(llama, req, source, BlendOptions(recompute_ratio=0.2, sink_tokens=5))
    assert bool(result.recomputed[start : start + 5].all())
    assert result.num_recomputed == 5 + keep_count(0.2, 95)
    dev = blend_one(llama, req, source, BlendOptions(recompute_ratio=0.2))
    assert not torch.equal(dev.recomputed, result.recomputed)


def test_collective_siblings_borrow_the_leaders_sinks(llama: ReferenceModel) -> None:
    requests, source = family(llama, "middle", 3, seg_len=60)
    opts = BlendOptions(recompute_ratio=0.0, sink_tokens=4, selection="collective")
    results = blend_group(llama, requests, source, opts)
    assert [r.num_recomputed for r in results] == [4, 0, 0]


def test_bad_sink_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="sink_tokens"):
        BlendOptions(sink_tokens=-1)
    with pytest.raises(ValueError, match="sink_tokens"):
        BlendOptions(sink_tokens=True)  # type: ignore[arg-type]
