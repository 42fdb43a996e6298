"""Real English text that ships with Python, for the chat quality tasks, the demo, examples and
benchmarks (nothing downloaded): sections of the Python Language Reference in
``pydoc_data.topics``."""

from __future__ import annotations

__all__ = ["DEMO_TOPICS", "reference_text"]

DEMO_TOPICS = ("exceptions", "raise", "assert")
_VERSION_NOTES = ("Changed in version", "New in version", "Added in version")


def reference_text(topics: tuple[str, ...] = DEMO_TOPICS) -> str:
    """The Reference sections named by ``topics`` as shipped with this Python, joined by blank
    lines, without their footnotes and version notes ("Changed in version …")."""
    from pydoc_data.topics import topics as shipped

    sections = []
    for name in topics:
        paragraphs = shipped[name].split("-[ Footnotes ]-")[0].strip().split("\n\n")
        sections.append("\n\n".join(p for p in paragraphs if not p.startswith(_VERSION_NOTES)))
    return "\n\n".join(sections)
