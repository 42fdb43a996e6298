"""``kmesh-blend quality`` on a model the repository does not ship: a tiny random Qwen2
checkpoint (QKV biases, grouped-query attention, its own seed) and a user's JSONL of 2 documents
and 4 follow-ups, through a vLLM engine with the KMesh connector (``--quick``)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kmesh_blend.quality.text import reference_text
from kmesh_blend.testing import TINY_QWEN2, build_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROW_FIELDS = {
    "rule", "nominal", "selection", "ratio", "sink_tokens", "drift_correction", "recomputed",
    "agreement",
    "agreement_se", "kl", "kl_se", "identical_answers", "answer_prefix", "blend_s_per_family",
    "agreement_by_question", "ttft_vs_stock",
}  # fmt: skip


def _prompts(path: Path) -> Path:
    docs = [
        {"title": "exceptions", "text": reference_text(("exceptions",))[:1500]},
        reference_text(("raise",))[:1200],
    ]
    follow_ups = [
        "What does the first document say about handlers?", "Summarize document 2.",
        "Which document mentions tracebacks?", "Quote the first sentence of each.",
    ]  # fmt: skip
    path.write_text(json.dumps({"documents": docs, "follow_ups": follow_ups}) + "\n")
    return path


def test_the_report_runs_on_a_model_the_repository_does_not_ship(tmp_path: Path) -> None:
    spec = dataclasses.replace(TINY_QWEN2, name="user-qwen2", seed=7)
    model = build_checkpoint(spec)
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_key_value_heads"] < config[
        "num_attention_heads"]  # fmt: skip
    exe = shutil.which("kmesh-blend") or str(Path(sys.executable).parent / "kmesh-blend")
    out = tmp_path / "report"
    cmd = [exe, "quality", "--model", str(model), "--prompts", str(_prompts(tmp_path / "p.jsonl")),
           "--quick", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line: the result
    assert result == json.loads((out / "quality.json").read_text())
    assert result["name"] == "quality_report" and result["quick"] is True
    assert result["metric"].startswith("top-1 agreement") and result["unit"] == "fraction"
    cfg = result["config"]
    assert cfg["tasks"] == 1 and cfg["follow_ups"] == 4 and cfg["positions"] > 0
    assert cfg["documents_per_follow_up"] == {"2": 4}
    assert all(set(row) == ROW_FIELDS for row in cfg["table"])
    exact = next(r for r in cfg["table"] if r["rule"] == "all")
    assert exact["agreement"] == 1.0 and exact["kl"] == 0.0  # ratio 1.0: the full prefill
    assert all(0.0 <= r["agreement"] <= 1.0 for r in cfg["table"])
    floor = cfg["bf16_full_prefill_vs_fp32"]
    assert set(floor) == {"agreement", "agreement_se", "kl", "identical_answers"}
    assert set(cfg["ttft_vs_stock"]) >= {"stock", "deviation 0.15", "deviation+drift 0.15", "none"}
    drift = next(r for r in cfg["table"] if r["nominal"] == "deviation+drift 0.15")
    plain = next(r for r in cfg["table"] if r["nominal"] == "deviation 0.15")
    assert drift["drift_correction"] == "auto" and drift["recomputed"] == plain["recomputed"]
    recommended = cfg["recommended"]
    assert recommended["target"] == floor["agreement"]  # the model's own bf16 error by default
    assert result["value"] == recommended["agreement"] and recommended["why"]
    assert set(recommended["settings"]) >= {"kmesh.recompute_ratio"}
    if recommended["meets_target"]:
        assert recommended["agreement"] >= recommended["target"]
        assert recommended["ttft_vs_stock"] <= cfg["max_ttft"]
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "recommended:" in proc.stderr and "quality report" in proc.stderr  # the progress bar


def test_bad_prompts_are_refused_naming_the_line_and_field(tmp_path: Path) -> None:
    from kmesh_blend.quality.prompts import load_tasks

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"documents": ["a text"], "follow_ups": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'follow_ups' must be a non-empty list"):
        load_tasks(None, bad)
