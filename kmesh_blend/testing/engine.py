"""Start a real vLLM engine on a test checkpoint, the way our tests, examples and benchmarks do.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ≈10 s to start instead of ≈30 s
on 2 cores, and both sides of a KV connector then live in this process. Callers that need the
multiprocess engine set the variable themselves before calling.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["make_llm", "prompt_logprobs"]

_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default reserves far more than tests need
}


def make_llm(checkpoint: str | Path, dtype: str = "float32", **engine_args: Any) -> Any:
    """Return a ``vllm.LLM`` on ``checkpoint`` (eager mode, seed 0, 2k context by default)."""
    for name, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    args: dict[str, Any] = {
        "model": str(checkpoint),
        "dtype": dtype,
        "max_model_len": 2048,
        "seed": 0,
        "enforce_eager": True,  # torch.compile costs minutes on 2 cores and changes nothing here
    }
    args.update(engine_args)
    return LLM(**args)


def prompt_logprobs(output: Any) -> list[float]:
    """Log-probabilities vLLM gave each prompt token after the first (``prompt_logprobs`` ≥ 0).

    ``output``: a ``RequestOutput`` of a request sampled with ``prompt_logprobs=0``.
    """
    ids = output.prompt_token_ids
    pairs = zip(ids[1:], output.prompt_logprobs[1:], strict=True)
    return [float(entry[tok].logprob) for tok, entry in pairs]
