"""The `lm://` restart scenario of tests/vllm/test_store_registry.py, in a process of its own.

An engine publishes a document and reuses it; its LMCache server is killed and a new, empty one
started on the same port; three more requests follow. Prints their tokens and reports as one
``RESULT`` JSON line. Run in a fresh process so that no state an earlier test left in the pytest
process can take part (in full-suite runs the in-process form of this test once reused a master
after the restart; alone it never did: see the session notes).

Usage: python -m tests.vllm.lm_restart_proc
"""

from __future__ import annotations

import gc
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
    from kmesh_blend.testing.engine import make_llm
    from tests.segments.conftest import _free_port, _stop
    from tests.vllm.family import kv_transfer_config, prompts
    from tests.vllm.test_store_registry import _generate, _lm_server

    family = prompts(seed=5)
    port = _free_port()
    server = _lm_server(port)
    config = kv_transfer_config(store=f"lm://127.0.0.1:{port}", retention_bytes=0)
    llm = make_llm(build_checkpoint(TINY_LLAMA), enable_prefix_caching=False,
                   kv_transfer_config=config)  # fmt: skip
    try:
        out = [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2)]
        _stop(server)  # every master is gone with it; the same port comes back empty
        server = _lm_server(port)
        out += [_generate(llm, family[i][0], {"segments": family[i][1]}) for i in range(2, 5)]
    finally:
        _stop(server)
        del llm
        gc.collect()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
