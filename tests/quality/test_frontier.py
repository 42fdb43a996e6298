"""`frontier.recommend`: the fastest setting that reaches the target among those that pay; else
the most faithful that pays, saying so; else full recomputation."""

from __future__ import annotations

from typing import Any

from kmesh_blend.quality.frontier import recommend


def _row(rule: str, ratio: float, agreement: float, ttft: float | None,
         selection: str = "per_request") -> dict[str, Any]:  # fmt: skip
    return {"rule": rule, "nominal": f"{rule} {ratio:g}", "selection": selection, "ratio": ratio,
            "sink_tokens": 0, "agreement": agreement, "agreement_se": 0.01,
            "ttft_vs_stock": ttft}  # fmt: skip


ROWS = [
    _row("none", 0.0, 0.90, 0.10), _row("deviation", 0.15, 0.95, 0.20),
    _row("deviation", 0.3, 0.985, 0.28), _row("deviation", 0.5, 0.995, 0.45),
    _row("all", 1.0, 1.0, 1.05), _row("deviation", 0.05, 0.999, None, "collective"),
]  # fmt: skip


def test_the_fastest_setting_that_reaches_the_target_among_those_that_pay() -> None:
    got = recommend(ROWS, target=0.98, max_ttft=0.30)
    assert got["settings"]["kmesh.recompute_ratio"] == 0.3 and got["meets_target"]
    assert got["agreement"] == 0.985 and "reaches the target" in got["why"]
    assert recommend(ROWS, target=0.94, max_ttft=0.30)["settings"]["kmesh.recompute_ratio"] == 0.15


def test_when_none_reaches_the_target_the_most_faithful_that_pays_says_so() -> None:
    got = recommend(ROWS, target=0.99, max_ttft=0.30)
    assert got["settings"]["kmesh.recompute_ratio"] == 0.3 and not got["meets_target"]
    assert "no setting at TTFT <= 0.3x stock reaches the target" in got["why"]


def test_when_no_reuse_pays_it_recommends_full_recomputation() -> None:
    got = recommend(ROWS, target=0.9, max_ttft=0.05)
    assert got["settings"] == {"kmesh.recompute_ratio": 1.0} and not got["meets_target"]
