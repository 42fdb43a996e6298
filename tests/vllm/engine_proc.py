"""One engine process of the two-engine test: run follow-ups (optionally the first reader) of the
family against a shared store and print their tokens and reports as one JSON line.

Usage: python -m tests.vllm.engine_proc STORE_URL (publish|reuse)
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    store, mode = sys.argv[1], sys.argv[2]
    from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
    from kmesh_blend.testing.engine import make_llm
    from tests.vllm.family import kv_transfer_config, params, prompts

    llm = make_llm(
        build_checkpoint(TINY_LLAMA),
        kv_transfer_config=kv_transfer_config(store=store, recompute_ratio=0.15),
        enable_prefix_caching=False,
    )
    family = prompts()
    if mode == "publish":
        llm.generate([{"prompt_token_ids": family[0][0]}], params(family[0][1]), use_tqdm=False)
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids, _ in family[1:]],
        [params(spans) for _, spans in family[1:]],
        use_tqdm=False,
    )
    rows = [[list(o.outputs[0].token_ids), o.kv_transfer_params["kmesh"]] for o in outs]
    print("RESULT " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
