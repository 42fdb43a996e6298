"""A ``--quick`` benchmark run never replaces a full run's results: `bench/run_all.py` and the
scripts' shared helpers (`bench/_common.py`) write quick results to ``bench/results/quick/`` and
leave the generated tables alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture()
def run_all(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """bench/run_all.py over a scratch bench folder holding one tiny benchmark."""
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "tiny.py").write_text(
        "import json, sys\n"
        "quick = '--quick' in sys.argv\n"
        "print(json.dumps({'name': 'tiny', 'metric': 'm', 'value': 2.0 if quick else 1.0,"
        " 'quick': quick}))\n"
    )
    table_doc = tmp_path / "results.md"
    table_doc.write_text(f"x\n{run_all.BEGIN}\nold table\n{run_all.END}\n")
    monkeypatch.setattr(run_all, "BENCH", bench)
    monkeypatch.setattr(run_all, "RESULTS", bench / "results")
    monkeypatch.setattr(run_all, "TABLE_DOC", table_doc)
    monkeypatch.setattr(run_all, "QUALITY_DOC", tmp_path / "absent.md")
    monkeypatch.setattr(run_all, "VARIANTS", {})
    return run_all


def test_a_quick_run_leaves_full_results_and_tables(run_all: Any, monkeypatch: Any) -> None:
    results, table_doc = run_all.RESULTS, run_all.TABLE_DOC
    monkeypatch.setattr(sys, "argv", ["run_all.py"])
    assert run_all.main() == 0
    full = json.loads((results / "tiny.json").read_text())
    table = table_doc.read_text()
    assert full["value"] == 1.0 and "| tiny | m | 1 " in table
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--quick"])
    assert run_all.main() == 0
    assert json.loads((results / "tiny.json").read_text()) == full  # untouched
    assert json.loads((results / "quick" / "tiny.json").read_text())["value"] == 2.0
    assert table_doc.read_text() == table


def test_the_scripts_write_quick_results_apart() -> None:
    code = "import _common, sys; print(_common.RESULTS)"
    out = []
    for flag in ([], ["--quick"]):
        run = subprocess.run([sys.executable, "-c", code, *flag], cwd=BENCH, check=True,
                             capture_output=True, text=True)  # fmt: skip
        out.append(run.stdout.strip())
    assert out == [str(BENCH / "results"), str(BENCH / "results" / "quick")]
