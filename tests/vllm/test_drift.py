"""Drift correction in the served path, on the real SmolLM2 (fp32): it moves the rows a blend
leaves stale toward the full prefill's, ratio 1.0 stays bit-exact with it on, and the report
says how many stale rows it shifted.

One engine serves every run; each follow-up carries its own ``drift_correction`` (and ratio), so
both settings see the same stored masters. Prompt KV is read back from vLLM's paged cache after
each forward (`WorkerHooks.capture`); the full prefill's is the ratio-1.0 run's (bit-exact with
stock vLLM, tests/vllm/test_own_model.py).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from kmesh_blend.testing import smollm2_checkpoint
from kmesh_blend.testing.engine import kv_transfer_config, live_worker, make_llm

pytestmark = pytest.mark.vllm
Served = tuple[list[int], list[float], torch.Tensor | None]


def _error(kv: torch.Tensor, full: torch.Tensor, rows: torch.Tensor) -> tuple[float, float]:
    """Mean over layers of Σ‖kv − full‖² / Σ‖full‖² over ``rows``, keys and values apart
    (``kv``, ``full``: [L, 2, T, Hkv, D])."""
    diff = (kv[:, :, rows] - full[:, :, rows]).float().pow(2).sum((2, 3, 4))
    norm = full[:, :, rows].float().pow(2).sum((2, 3, 4))
    k, v = (diff / norm).mean(0).tolist()
    return k, v


def test_drift_correction_moves_stale_rows_toward_the_full_prefill() -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from kmesh_blend.quality.chat import chat_tasks

    path = smollm2_checkpoint()
    (task,) = chat_tasks(AutoTokenizer.from_pretrained(path), 1, doc_tokens=96)
    llm = make_llm(path, dtype="float32", enable_prefix_caching=False, max_model_len=1024,
                   kv_transfer_config=kv_transfer_config(
                       store="cpu", recompute_ratio=0.15, check_layers="1,2,3"))  # fmt: skip
    captured: list[torch.Tensor] = []
    reports: list[dict[str, Any]] = []
    live_worker().hooks.capture = lambda _req, kv: captured.append(kv.clone())

    def serve(llm: Any, prompt: Any, **setting: Any) -> Served:
        """Generate one prompt alone: its tokens, their log-probabilities and, when it loaded
        stored KV, its prompt KV read back after the forward."""
        kmesh = {"segments": [list(s[:2]) for s in prompt.spans], **setting}
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0,
                                extra_args={"kv_transfer_params": {"kmesh": kmesh}})  # fmt: skip
        (out,) = llm.generate([{"prompt_token_ids": list(prompt.token_ids)}], params,
                              use_tqdm=False)  # fmt: skip
        comp = out.outputs[0]
        report = out.kv_transfer_params["kmesh"]
        assert report.get("fallback") is None, report
        reports.append(report)
        logprobs = [float(lp[t].logprob) for t, lp in zip(comp.token_ids, comp.logprobs,
                                                          strict=True)]  # fmt: skip
        return list(comp.token_ids), logprobs, captured.pop() if captured else None

    try:
        for reader in task.readers:  # stores each document's master
            serve(llm, reader)
        errors: dict[str, list[tuple[float, float]]] = {"off": [], "auto": []}
        for prompt in task.requests:
            full_tokens, full_lp, full = serve(llm, prompt, recompute_ratio=1.0)
            exact = serve(llm, prompt, recompute_ratio=1.0, drift_correction="auto")
            assert exact[0] == full_tokens and exact[1] == full_lp  # ratio 1.0: every bit
            assert full is not None and exact[2] is not None and torch.equal(exact[2], full)
            assert "drift_shifted_rows" not in reports[-1]  # no check layer ran: nothing to do
            rows = torch.cat([torch.arange(s, e) for s, e, _ in prompt.spans])
            for setting in errors:
                *_, kv = serve(llm, prompt, drift_correction=setting)
                assert kv is not None
                errors[setting].append(_error(kv, full, rows))
                report = reports[-1]
                stale = report["reused_tokens"] - report["recomputed_tokens"]
                if setting == "off":
                    assert "drift_shifted_rows" not in report, report
                else:  # every stale row of a segment with a measured share, at most all of them
                    assert 0 < report["drift_shifted_rows"] <= stale, report
    finally:
        del llm
        gc.collect()
    print("reused rows' relative error (K, V) per follow-up, off → auto:",
          [(f"{a[0]:.2e}→{b[0]:.2e}", f"{a[1]:.2e}→{b[1]:.2e}")
           for a, b in zip(errors["off"], errors["auto"], strict=True)])  # fmt: skip
    total = {s: torch.tensor(e).sum(0) for s, e in errors.items()}
    assert bool((total["auto"] < total["off"]).all()), total  # keys and values both closer
    better = sum(b[0] < a[0] for a, b in zip(errors["off"], errors["auto"], strict=True))
    assert better >= len(task.requests) - 1, errors
