"""Start a real vLLM engine on a test checkpoint, the way our tests, examples and benchmarks do.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ≈10 s to start instead of ≈30 s
on 2 cores, and both sides of a KV connector then live in this process. Callers that need the
multiprocess engine set the variable themselves before calling.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from kmesh_blend.vllm.worker_side import WorkerSide

__all__ = [
    "kv_transfer_config", "leaked_connector", "live_worker", "make_llm", "prompt_logprobs",
]  # fmt: skip

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


def kv_transfer_config(**settings: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for our connector; ``settings`` are ``kmesh.*`` keys without
    the prefix (``store="cpu"`` → ``"kmesh.store": "cpu"``). The engine is named ``kmesh-test``
    (reports carry it), so reports of two engines compare equal."""
    return {
        "kv_connector": "KMeshConnector",
        "engine_id": "kmesh-test",
        "kv_connector_module_path": "kmesh_blend.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {f"kmesh.{k}": v for k, v in settings.items()},
    }


def prompt_logprobs(output: Any) -> list[float]:
    """Log-probabilities vLLM gave each prompt token after the first (``prompt_logprobs`` ≥ 0).

    ``output``: a ``RequestOutput`` of a request sampled with ``prompt_logprobs=0``.
    """
    ids = output.prompt_token_ids
    pairs = zip(ids[1:], output.prompt_logprobs[1:], strict=True)
    return [float(entry[tok].logprob) for tok, entry in pairs]


def leaked_connector() -> bool:
    """Whether an in-process engine left vLLM's process-wide KV connector behind, and drop it.

    vLLM sets that connector when a worker starts and clears it when the engine shuts down. An
    engine whose start failed after its worker began (our connector refusing a setting, say)
    never shuts down, and every later in-process engine, stock ones too, then finds a connector
    it never asked for and fails on its first step. Returns ``False`` when vLLM was never
    imported.
    """
    from kmesh_blend.vllm.seam.engine import drop_leaked_connector

    return drop_leaked_connector()


def live_worker() -> WorkerSide:
    """The worker side of the in-process engine running in this process (its ``hooks``, its
    cascade decode path); raises RuntimeError when there is none."""
    from kmesh_blend.vllm.seam.engine import worker_connector

    worker = getattr(worker_connector(), "worker", None)
    if worker is None:
        raise RuntimeError("no in-process engine with a KMeshConnector worker in this process")
    return cast("WorkerSide", worker)
