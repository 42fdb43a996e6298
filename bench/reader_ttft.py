"""A reader's time to first token on the KMesh engine: what reuse costs a request that reuses
little.

In the serving workload (`bench/serving.py`) every family's first agent — its reader — meets its
document for the first time; all it can reuse is its system prompt and lead-in, stored by an
earlier family's reader (a few dozen tokens before the first ``<file_sep>``). That hit is too
short for vLLM's prefix cache (a block holds 128 tokens on CPU), so the connector takes it, and
what it costs decides the readers' TTFT under load (a fifth of the requests, and the p99).

Measured on one in-process KMesh engine (SmolLM2-135M-Instruct, bf16, separator mode, prefix
caching on), interleaved request by request, each reader a document it has not seen:

- ``stop``: the blend stops at the end of the last reused segment, vLLM's forward computes the
  rest (the connector's behaviour, `scheduler_reuse.blend_end`);
- ``whole``: the blend computes the whole prompt (what the connector did before; patched in
  here for the comparison);
- ``plain``: the same prompt with its separators replaced by newlines — no segment, the stock path
  on the same engine (KMesh's overhead on unannotated prompts is measured by
  `bench/follow_up_ttft.py`: under 1 %).

value = median TTFT(stop) / median TTFT(plain) (goal ≤ 1.05); config.whole_vs_plain beside it.

Run: python bench/reader_ttft.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, use_allocator
from _serving import BLOCK_SIZE, SEPARATOR, agent_families, attn_isa, separator_id

GOAL = 1.05


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--allocator", default="tcmalloc", choices=["tcmalloc", "system"])
    args = parser.parse_args()
    allocator = use_allocator(args.allocator)
    rounds = 3 if args.quick else 4  # 2·rounds + 1 documents: 10 sections hold 1.4k tokens
    doc_tokens = (600, 700) if args.quick else (1200, 1400)

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    import kmesh_blend.vllm.scheduler_reuse as reuse
    from kmesh_blend.testing.engine import kv_transfer_config, make_llm
    from kmesh_blend.testing.smollm2 import smollm2_checkpoint

    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    # Family k's reader (agent 0) reads document k; every reader has the same system prompt.
    work = agent_families(tok, 2 * rounds + 1, 1, doc_tokens, 1)
    prompts = [row["prompt"] for row in work.rows]
    config = kv_transfer_config(store="cpu", separator=[separator_id(tok)])
    llm = make_llm(path, "bfloat16", max_model_len=4096, enable_prefix_caching=True,
                   kv_transfer_config=config)  # fmt: skip
    greedy = SamplingParams(max_tokens=1, temperature=0)
    stop_at = reuse.blend_end
    whole = False

    def patched(*a: Any) -> int | None:
        return None if whole else stop_at(*a)

    reuse.blend_end = patched  # type: ignore[assignment]

    def ttft(prompt: str) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        return time.perf_counter() - t0, (out.kv_transfer_params or {}).get("kmesh", {})

    ttft(prompts[0])  # warm-up; stores the readers' shared system prompt
    times: dict[str, list[float]] = {"stop": [], "whole": [], "plain": []}
    reused: list[int] = []
    for r in range(rounds):
        # each reader a new document; the order rotates so neither kind is always first
        jobs = [("stop", prompts[1 + 2 * r]), ("whole", prompts[2 + 2 * r]),
                ("plain", prompts[1 + 2 * r].replace(SEPARATOR, "\n"))]  # fmt: skip
        for kind, prompt in jobs[r % 3 :] + jobs[: r % 3]:
            whole = kind == "whole"
            seconds, report = ttft(prompt)
            times[kind].append(seconds)
            if kind != "plain":
                if not report.get("reused_tokens"):
                    raise RuntimeError(f"a {kind} reader reused nothing: {report}")
                reused.append(int(report["reused_tokens"]))
        print(
            f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()),
            file=sys.stderr,
        )
    reuse.blend_end = stop_at  # type: ignore[assignment]
    med = {k: round(statistics.median(v), 4) for k, v in times.items()}
    emit({
        "name": "reader_ttft",
        "metric": "reader TTFT (short reuse) / the same prompt on the stock path",
        "value": round(med["stop"] / med["plain"], 4),
        "unit": "x",
        "goal": GOAL,
        "baseline": "same prompt, no separators, same engine",
        "quick": args.quick,
        "config": {
            "model": "SmolLM2-135M-Instruct (bf16)",
            "allocator": allocator,
            "attn_isa": attn_isa("bfloat16", BLOCK_SIZE),
            "rounds": rounds,
            "document_tokens": list(work.document_tokens[1:]),
            "reused_tokens": sorted(set(reused)),
            "seconds_median": med,
            "whole_vs_plain": round(med["whole"] / med["plain"], 4),
            "stop_vs_whole": round(med["stop"] / med["whole"], 4),
        },
    })  # fmt: skip


if __name__ == "__main__":
    main()
