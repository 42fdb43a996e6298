"""README's real-model quality block is generated from the benchmark JSON (`bench/run_all.py`):
the reference points and the oracle table carry the measured values, and older results without
them still render."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture()
def run_all(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all

    return run_all


def _result() -> dict[str, Any]:
    row = {"rule": "deviation", "nominal": "deviation 0.15", "selection": "per_request",
           "ratio": 0.15, "sink_tokens": 0, "recomputed": 0.15, "agreement": 0.9518,
           "agreement_se": 0.0085, "kl": 0.0179, "identical_answers": 0.1875,
           "ttft_vs_stock": 0.526}  # fmt: skip
    config = {"follow_ups": 32, "positions": 1017, "check_layers": [1, 2, 3], "table": [row],
              "served_identical_answers": {"deviation 0.15": 0.1875}}  # fmt: skip
    return {"quick": False, "config": config}


def test_reference_points_and_oracles_come_from_the_json(run_all: Any) -> None:
    result = _result()
    old = run_all._real_quality_rows(result)
    assert len(old) == 5 and "0.952 ± 0.009" in old[-1]  # header, blank, 2 table lines, the row
    result["config"].update(
        bf16_full_prefill_vs_fp32={"agreement": 0.9803, "agreement_se": 0.0044, "kl": 0.00108,
                                   "identical_answers": 0.5625},
        near_ties={"0.1": 0.0452, "0.5": 0.2232},
        goal_reached_at_ratio=None,
    )  # fmt: skip
    ceiling = {"quick": True, "config": {"ratio": 0.15, "follow_ups": 8, "positions": 250,
               "table": [{"rule": "oracle V", "agreement": 0.9612, "agreement_se": 0.0087,
                          "kl": 0.0144, "identical_answers": 0.28}]}}  # fmt: skip
    rows = run_all._real_quality_rows(json.loads(json.dumps(result)), ceiling)
    text = "\n".join(rows)
    assert "0.980 ± 0.004" in text and "4.5% under 0.1 nats" in text and "22.3% under 0.5" in text
    assert "reaches 0.99 at none of the ratios measured" in text
    assert "| oracle V | 0.961 ± 0.009 | — | 1.44e-02 | 0.280 |" in rows
    ceiling["config"]["table"][0].update(vs_deviation=0.0123, vs_deviation_se=0.0044)
    ceiling["config"].update(best_oracle="oracle V", drift_auto_vs_best_oracle={
        "agreement": [0.0025, 0.0056], "kl": [-0.00371, 0.00131]})  # fmt: skip
    rows = run_all._real_quality_rows(json.loads(json.dumps(result)), ceiling)
    assert "| oracle V | 0.961 ± 0.009 | +1.2 ± 0.4 pts | 1.44e-02 | 0.280 |" in rows
    assert "(oracle V), paired: top-1 +0.2 ± 0.6 points, KL -3.71e-03 ± 1.31e-03." in rows[-1]
    assert "8 follow-ups, 250 positions, quick run" in text
    result["config"]["goal_reached_at_ratio"] = 0.7
    assert "reaches 0.99 from ratio 0.7" in "\n".join(run_all._real_quality_rows(result))
    assert "Goal (reuse error" not in "\n".join(run_all._real_quality_rows(result))
    result["config"].update(headline_rule="deviation+drift", goal={
        "agreement": 0.9636, "bf16_floor": 0.9803, "reached": False, "selection_ceiling": 0.9607,
        "past_selection_ceiling": True})  # fmt: skip
    text = "\n".join(run_all._real_quality_rows(result))
    assert "best method (deviation+drift) agrees on 0.964 against the bf16 floor 0.980: not met" \
        in text and "is 0.961, which it passes" in text  # fmt: skip
