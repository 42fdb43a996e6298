"""The quality harness on the trained model: exactness at ratio 1.0, metrics that can fail."""

import pytest
import torch

from kmesh_blend.blend import SegmentKV
from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.quality import (
    QualityTask,
    Setting,
    compare,
    continuation_logits,
    evaluate,
    format_table,
    make_tasks,
    standard_tasks,
)
from kmesh_blend.testing.quality import quality_model_dir


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel.load(quality_model_dir(), torch.float32)


@pytest.fixture(scope="module")
def tasks() -> list[QualityTask]:
    """Two small tasks (segment 128, group of 2, 8 continuation tokens) on held-out files."""
    return standard_tasks(2, segment_tokens=128, group_size=2, continuation_tokens=8)


def test_task_layout(tasks: list[QualityTask]) -> None:
    """Prompt = prefix + segment + cue; the truth follows the cue inside the segment."""
    for task in tasks:
        seg = task.segment.tolist()
        for i, req in enumerate(task.requests):
            request = task.blend_request(i)
            (use,) = request.uses
            assert torch.equal(request.token_ids[use.start : use.end], task.segment)
            assert use.start == req.prefix.numel() and 64 <= use.start <= 128
            quoted = req.cue.tolist() + req.continuation.tolist()
            assert any(seg[s : s + len(quoted)] == quoted for s in range(len(seg)))


def test_make_tasks_rejects_short_segments() -> None:
    with pytest.raises(ValueError, match="needs"):
        make_tasks([torch.arange(20)], [torch.arange(200)])


def test_extension_matches_full_prefill(model: ReferenceModel, tasks: list[QualityTask]) -> None:
    """Teacher-forced scores over the prompt's KV = a full prefill of prompt + continuation
    (fp32; tolerance for row-count dependent GEMM rounding)."""
    task, req = tasks[0], tasks[0].requests[0]
    ref = prefill(model, task.prompt(0), last_only=True)
    ours = continuation_logits(model, ref.keys, ref.values, ref.logits, req.continuation)
    k = req.continuation.numel()
    full = prefill(model, torch.cat([task.prompt(0), req.continuation[:-1]])).logits[-k:]
    torch.testing.assert_close(ours, full, rtol=0, atol=1e-4)


def test_ratio_one_is_bit_identical(model: ReferenceModel, tasks: list[QualityTask]) -> None:
    report = evaluate(model, tasks, [Setting(1.0, "per_request"), Setting(0.0, "per_request")])
    exact, plain = report.result(1.0), report.result(0.0)
    assert exact.identical == 1.0 and exact.agreement == 1.0 and exact.kl == 0.0
    assert exact.perplexity == report.full_perplexity and exact.recomputed == 1.0
    assert plain.identical == 0.0 and plain.kl > 0.0 and plain.recomputed == 0.0
    assert "per_request" in format_table(report)


def test_compare_detects_one_ulp() -> None:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 50, generator=gen)
    targets = torch.tensor([1, 2, 3])
    same = compare(full, full.clone(), targets)
    assert bool(same.identical.all()) and bool((same.kl == 0).all()) and bool(same.agree.all())
    nudged = full.clone()
    nudged[1, 7] = torch.nextafter(nudged[1, 7], torch.tensor(float("inf")))
    assert compare(full, nudged, targets).identical.tolist() == [True, False, True]


def test_a_wrong_master_is_visible(model: ReferenceModel, tasks: list[QualityTask]) -> None:
    """Reused KV that pairs each key with its neighbour's value scores far worse than the true
    master at ratio 0: on this model the metrics tell good reuse from bad. (Moving keys and values
    together by one token would barely show: the model finds what to copy by content.)"""

    def shifted(master: SegmentKV) -> SegmentKV:
        return SegmentKV(master.keys, master.values.roll(1, dims=1), master.positions)

    settings = [Setting(0.0, "per_request")]
    true = evaluate(model, tasks, settings).result(0.0)
    wrong = evaluate(model, tasks, settings, master_hook=shifted).result(0.0)
    print(f"ratio 0: true master KL {true.kl:.2e}, wrong master KL {wrong.kl:.2e}")
    assert wrong.kl > 5 * true.kl, (true, wrong)
    assert wrong.agreement < true.agreement, (true, wrong)
