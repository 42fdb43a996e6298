"""The settings table of docs/settings.md, generated from `KMeshConfig` (its one source).

Each field of `kmesh_blend.config.KMeshConfig` with its type as annotated (choices spelled out),
its default and its docstring becomes one row. ``python scripts/settings_table.py`` rewrites the
table between the markers of docs/settings.md; ``tests/test_docs.py`` fails when the committed
table differs from what this script generates.
"""

from __future__ import annotations

import ast
import json
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "kmesh_blend" / "config.py"
DOC = ROOT / "docs" / "settings.md"
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def rows() -> list[str]:
    """The markdown table: one row per `KMeshConfig` field, in declaration order."""
    import kmesh_blend.config as config

    tree = ast.parse(CONFIG.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KMeshConfig")
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    body = cls.body
    for node, after in zip(body, [*body[1:], None], strict=True):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        if name.startswith("_"):
            continue
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            raise ValueError(f"KMeshConfig.{name} has no docstring")
        kind = ast.unparse(node.annotation)
        alias = getattr(config, kind, None)
        if typing.get_origin(alias) is typing.Literal:
            kind = " \\| ".join(f"`{choice}`" for choice in typing.get_args(alias))
        default = getattr(config.KMeshConfig(), name)
        shown = json.dumps(list(default) if isinstance(default, tuple) else default)
        doc = " ".join(str(after.value.value).split()).replace("``", "`").replace("|", "\\|")
        out.append(f"| `kmesh.{name}` | {kind} | `{shown}` | {doc} |")
    return out


def render(text: str) -> str:
    """``text`` (docs/settings.md) with the table between its markers regenerated."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"{DOC.name} lacks the markers {BEGIN} … {END}")
    return head + BEGIN + "\n" + "\n".join(rows()) + "\n" + END + tail


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
    print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
