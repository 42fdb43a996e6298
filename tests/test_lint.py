"""Code health as part of the test run: ruff (lint + format) and mypy on the package."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["kmesh_blend", "tests", "examples", "bench"]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed next to {sys.executable}; run `make test`")
    return found


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def test_ruff_check() -> None:
    _run(_tool("ruff"), "check", *PATHS)


def test_ruff_format() -> None:
    _run(_tool("ruff"), "format", "--check", *PATHS)


@pytest.mark.timeout(600)
def test_mypy_package() -> None:
    _run(_tool("mypy"))


def test_package_files_stay_small() -> None:
    """Each concept has one owner file of at most ~300 lines (the C++ kernel aside)."""
    sizes = {p: len(p.read_text().splitlines()) for p in (ROOT / "kmesh_blend").rglob("*.py")}
    big = {str(p.relative_to(ROOT)): n for p, n in sizes.items() if n > 300}
    assert not big, big
