"""Selection planning: plain Python, no model."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kmesh_blend import KMeshConfig
from kmesh_blend.blend import (
    BlendOptions,
    BlendRequest,
    SegmentUse,
    check_ratios,
    keep_count,
    select_top,
)


def test_keep_count_rounds_half_up_and_clamps() -> None:
    assert keep_count(0.15, 200) == 30
    assert keep_count(0.15, 10) == 2  # 1.5 → 2
    assert keep_count(0.0, 10) == 0 and keep_count(1.0, 7) == 7


def test_check_ratios_shrink_to_the_ratio() -> None:
    assert check_ratios(0.15, 1) == [0.15]
    r = check_ratios(0.15, 3)
    assert r == sorted(r, reverse=True) and r[-1] == pytest.approx(0.15) and r[0] < 1.0


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=50), st.data())
def test_select_top_picks_the_largest(scores: list[float], data: st.DataObject) -> None:
    count = data.draw(st.integers(0, len(scores)))
    s = torch.tensor(scores, dtype=torch.float32)
    chosen = select_top(s, count)
    assert chosen.tolist() == sorted(set(chosen.tolist())) and len(chosen) == count
    rest = torch.ones(len(scores), dtype=torch.bool)
    rest[chosen] = False
    if count and bool(rest.any()):
        assert float(s[chosen].min()) >= float(s[rest].max())


def test_select_top_breaks_ties_by_lower_index() -> None:
    assert select_top(torch.tensor([1.0, 2.0, 2.0, 2.0]), 2).tolist() == [1, 2]


@pytest.mark.parametrize(
    "uses",
    [
        ((5, 5, "a"),),  # empty
        ((0, 4, "a"), (3, 6, "b")),  # overlap
        ((4, 6, "a"), (0, 2, "b")),  # unsorted
        ((8, 11, "a"),),  # beyond the prompt
    ],
)
def test_bad_spans_are_rejected(uses: tuple) -> None:
    with pytest.raises(ValueError, match="segment span"):
        BlendRequest(torch.arange(10), tuple(SegmentUse(*u) for u in uses))


def test_options_from_config_and_validation() -> None:
    opts = BlendOptions.from_config(
        KMeshConfig(recompute_ratio=0.3, check_layers=(1, 2), schedule="sequential")
    )
    assert (opts.recompute_ratio, opts.check_layers, opts.schedule) == (0.3, (1, 2), "sequential")
    with pytest.raises(ValueError, match="beyond"):
        opts.validate_for(2)
    with pytest.raises(ValueError, match="deviation"):
        BlendOptions(deviation="q")  # type: ignore[arg-type]
