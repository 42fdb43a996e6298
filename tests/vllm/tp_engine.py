"""One tensor-parallel engine (TP=2 on the CPU, one core per rank) for tests/vllm/test_tp.py: run
the family one request at a time and print tokens, log-probabilities and reports as JSON.

Usage: python -m tests.vllm.tp_engine (stock|RATIO) [STORE]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams

    from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
    from tests.vllm.family import kv_transfer_config, prompts

    mode = sys.argv[1]
    store = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    args: dict = dict(
        model=str(build_checkpoint(TINY_LLAMA)), dtype="bfloat16", max_model_len=2048, seed=0,
        enforce_eager=True, tensor_parallel_size=2, enable_prefix_caching=False,
    )  # fmt: skip
    if mode != "stock":
        args["kv_transfer_config"] = kv_transfer_config(store=store, recompute_ratio=float(mode))
    llm = LLM(**args)
    rows = []
    for ids, spans in prompts():
        extra = None if mode == "stock" else {"kv_transfer_params": {"kmesh": {"segments": spans}}}
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, extra_args=extra)
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        tokens = list(out.outputs[0].token_ids)
        logprobs = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs, strict=True)]
        rows.append([tokens, logprobs, (out.kv_transfer_params or {}).get("kmesh")])
    print("RESULT " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
