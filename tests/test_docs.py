"""The documentation stays true with the code: the settings table is the one generated from
`KMeshConfig`, every ``kmesh.*`` key and every report field is documented, the README stays a
front door (≤ 12 KB) and nothing cites a file outside the repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import get_type_hints

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _settings_table() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "settings_table", ROOT / "scripts/settings_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_table_is_generated_from_the_config() -> None:
    table = _settings_table()
    text = (DOCS / "settings.md").read_text()
    assert table.render(text) == text, "run: python scripts/settings_table.py"


def test_every_setting_and_report_field_is_documented() -> None:
    from kmesh_blend.config import KNOWN_KEYS
    from kmesh_blend.vllm.meta import Report

    settings = (DOCS / "settings.md").read_text()
    assert all(f"`{key}`" in settings for key in KNOWN_KEYS)
    contract = (DOCS / "contract.md").read_text()
    missing = [name for name in get_type_hints(Report) if f'"{name}"' not in contract]
    assert not missing, f"report fields missing from docs/contract.md: {missing}"


def test_a_missing_setting_is_caught() -> None:
    """The check can fail: a table without one row is not the generated one."""
    table = _settings_table()
    text = (DOCS / "settings.md").read_text()
    cut = "\n".join(line for line in text.splitlines() if "kmesh.store_timeout_s" not in line)
    assert table.render(cut) != cut


def test_readme_is_a_front_door_and_links_resolve() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_bytes()) <= 12 * 1024
    for page in [readme, *DOCS.glob("*.md")]:
        for link in re.findall(r"\]\(([^)#]+)", page.read_text()):
            if not link.startswith("http"):
                assert (page.parent / link).exists(), f"{page.name}: {link}"


def test_nothing_cites_a_file_outside_the_repository() -> None:
    outside = re.compile(r"\b(CONTRACT|FACTS|STYLE)\.md\b")
    roots = ["kmesh_blend", "tests", "bench", "docs", "examples", "scripts"]
    files = [ROOT / "README.md", *(p for r in roots for p in (ROOT / r).rglob("*") if p.suffix
                                    in {".py", ".md", ".sh", ".cpp"})]  # fmt: skip
    cited = [str(p.relative_to(ROOT)) for p in files if outside.search(p.read_text())]
    assert cited == [test for test in cited if test == "tests/test_docs.py"]
