"""The ``kmesh-blend`` command: ``kmesh-blend quality ...`` (the reuse-quality report on your own
model and prompts; `kmesh_blend.quality.__main__`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

COMMANDS = {"quality": "the reuse-quality report on your model and prompts"}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        listed = "\n".join(f"  {name:10} {what}" for name, what in COMMANDS.items())
        print(f"usage: kmesh-blend COMMAND [ARGS]\ncommands:\n{listed}", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    from kmesh_blend.quality.__main__ import main as quality

    return quality(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
