"""`paired_difference`: one setting's agreement minus another's on the same answer positions, with
a standard error clustered by task that sees only how the difference varies."""

from __future__ import annotations

import math

import torch

from kmesh_blend.quality.chat_harness import paired_difference
from kmesh_blend.quality.metrics import Comparison


def _parts(flags: list[list[int]], kl: float = 0.0) -> list[Comparison]:
    out = []
    for f in flags:
        agree = torch.tensor(f, dtype=torch.bool)
        zeros = torch.zeros(agree.numel())
        out.append(Comparison(agree, zeros + kl, zeros, agree))
    return out


def test_paired_difference() -> None:
    base = _parts([[1, 0, 0, 1], [0, 0], [1, 1, 1], [0, 1]])
    same_gain = _parts([[1, 1, 0, 1], [1, 0], [1, 1, 1], [1, 1]])  # +1 position per follow-up
    # tasks: follow-ups 0 and 1 in task 0, 2 and 3 in task 1 (6 positions, 5 positions)
    gain, se = paired_difference(same_gain, base, [0, 0, 1, 1])
    assert math.isclose(gain, 3 / 11, rel_tol=1e-6)
    # per-task mean differences: 2/6 and 1/5; their spread over √2
    t0, t1 = 2 / 6, 1 / 5
    expected = abs(t0 - t1) / math.sqrt(2) / math.sqrt(2)
    assert math.isclose(se, expected, rel_tol=1e-5)

    gain, se = paired_difference(base, base, [0, 0, 1, 1])
    assert gain == 0.0 and se == 0.0
    worse, _ = paired_difference(base, same_gain, [0, 0, 1, 1])
    assert math.isclose(worse, -3 / 11, rel_tol=1e-6)
    lower, se = paired_difference(_parts([[1], [0, 1]], kl=0.25), _parts([[1], [1, 1]], kl=1.0),
                                  [0, 1], of="kl")  # fmt: skip
    assert lower == -0.75 and se == 0.0
