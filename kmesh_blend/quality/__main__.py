"""``kmesh-blend quality`` / ``python -m kmesh_blend.quality``: the reuse-quality report on your
own model and prompts (`kmesh_blend.quality.report`).

Prints progress on stderr, writes ``quality.json`` and ``quality.png`` (the frontier) into
``--out``, and prints the result as its last line of output: one JSON object with ``name``,
``metric``, ``value`` (top-1 agreement at the recommended setting) and ``config`` (the whole
frontier, the yardstick, ``recommended``: the ``kmesh.*`` settings to serve with).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        "kmesh-blend quality", description=__doc__, formatter_class=raw
    )
    parser.add_argument("--model", help="a local checkpoint vLLM loads (default: SmolLM2-135M-"
                        "Instruct, from the repository's fixtures)")  # fmt: skip
    parser.add_argument(
        "--prompts",
        help="documents + follow-ups, JSONL (one task a line: "
        '{"documents": [...], "follow_ups": [...]}; default: built-in chat tasks)',
    )
    parser.add_argument("--quick", action="store_true", help="fewer tasks and settings")
    parser.add_argument("--tasks", type=int, help="built-in tasks to run (default 8; quick 2)")
    parser.add_argument("--check-layers", default="1,2,3", help="comma-separated (default 1,2,3)")
    parser.add_argument(
        "--target",
        type=float,
        help="agreement to reach (default: the model's "
        "own bf16-vs-fp32 full-prefill agreement, measured in the same run)",
    )
    parser.add_argument(
        "--max-ttft",
        type=float,
        default=1.0,
        help="largest follow-up TTFT / stock you accept (default 1.0: any setting faster than "
        "stock on these prompts; the TTFT a setting saves grows with the documents' length)",
    )
    parser.add_argument("--out", default="kmesh-quality", help="folder for the JSON and PNG")
    args = parser.parse_args(argv)
    model = args.model or _default_model(parser)
    tokenizer = _tokenizer(model)
    if args.prompts:
        from kmesh_blend.quality.prompts import load_tasks

        try:
            tasks = load_tasks(tokenizer, args.prompts)
        except (OSError, ValueError) as exc:
            parser.error(f"--prompts: {exc}")
    else:
        from kmesh_blend.quality.chat import chat_tasks

        tasks = chat_tasks(tokenizer, args.tasks or (2 if args.quick else 8), doc_tokens=192)
    if args.quick:
        tasks = tasks[:2]
    from tqdm import tqdm

    from kmesh_blend.quality.report import run

    bar = tqdm(desc="quality report", unit="step", file=sys.stderr, dynamic_ncols=True)

    def log(message: str) -> None:
        bar.set_postfix_str(message[:70])
        bar.update()

    checks = tuple(int(x) for x in args.check_layers.split(","))
    result = run(model, tasks, check_layers=checks, quick=args.quick, log=log,
                 target=args.target, max_ttft=args.max_ttft)  # fmt: skip
    bar.close()
    recommended = result["config"]["recommended"]
    result = {"name": "quality_report", "value": recommended["agreement"], **result}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    from kmesh_blend.quality.frontier import plot

    cfg = result["config"]
    plot(result, out / "quality.png", f"{Path(model).name}: {cfg['follow_ups']} follow-ups, "
         f"{cfg['positions']} answer positions")  # fmt: skip
    print(f"recommended: {json.dumps(recommended['settings'])} ({recommended['why']})",
          file=sys.stderr)  # fmt: skip
    print(f"wrote {out / 'quality.json'} and {out / 'quality.png'}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


def _default_model(parser: argparse.ArgumentParser) -> str:
    try:
        from kmesh_blend.testing import smollm2_checkpoint
    except ImportError:
        parser.error("--model is required: the default SmolLM2 fixture is not installed "
                     "(it ships with the repository, not the wheel)")  # fmt: skip
    return str(smollm2_checkpoint())


def _tokenizer(model: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


if __name__ == "__main__":
    raise SystemExit(main())
