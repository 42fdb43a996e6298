"""The wheel holds what users use: the served path and the documented public APIs, not the
repository's test fixtures (`kmesh_blend.testing`: checkpoints, the quality model, engine
helpers)."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
           "-w", str(out), str(ROOT)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    (built,) = out.glob("kmesh_blend-*.whl")
    return zipfile.ZipFile(built)


def test_no_test_fixtures_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert not [n for n in names if n.startswith("kmesh_blend/testing")]
    assert "kmesh_blend/py.typed" in names and "kmesh_blend/cpu/cascade_decode.cpp" in names
    for package in ("vllm/seam", "segments", "blend", "artifacts", "quality", "cpu", "mirror"):
        assert f"kmesh_blend/{package}/__init__.py" in names, package


def test_no_shipped_module_imports_the_fixtures_at_import_time(wheel: zipfile.ZipFile) -> None:
    """Only guarded, function-level imports of `kmesh_blend.testing` remain in shipped code."""
    bad = []
    for name in wheel.namelist():
        if name.endswith(".py"):
            tree = ast.parse(wheel.read(name))
            for node in tree.body:  # module level only
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "kmesh_blend.testing"
                ):
                    bad.append(name)
    assert not bad, bad
