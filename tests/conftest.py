"""Shared test set-up.

TRITON_INTERPRET must be set before anything imports triton (kernels then run on the CPU in the
interpreter); VLLM_* defaults keep engines in-process and small.
"""

import gc
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


@pytest.fixture(autouse=True)
def _no_leaked_connector() -> Iterator[None]:
    """Fails the test that leaves vLLM's process-wide KV connector set (see ``leaked_connector``):
    otherwise a later, unrelated test fails instead, and only in full-suite runs."""
    yield
    import sys

    state = sys.modules.get("vllm.distributed.kv_transfer.kv_transfer_state")
    if state is not None and state.has_kv_transfer_group():
        gc.collect()  # an engine in a reference cycle shuts down when collected
        from kmesh_blend.testing.engine import leaked_connector

        assert not leaked_connector(), "this test left an in-process engine's KV connector set"
