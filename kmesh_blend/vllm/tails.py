"""The prompt's tail: the last tokens vLLM computes itself after a blend, made the blend's own.

vLLM must compute at least one token of every prompt, so the connector loads all but the last
`VLLM_TAIL` tokens and vLLM runs its forward over those as a continuation of the blended KV. On
CPU that continuation rounds apart from the same rows inside a full prefill (fp32: last bits;
the attention and the GEMMs see 2 query rows instead of T). The blend computed those rows too,
in the prompt's own batch, exactly as a full prefill does. `Tails` hands vLLM the blend's
results for them:

- their KV, written back into the paged cache after the forward (`write_back`), so every decode
  step reads the full prefill's prompt KV;
- the last prompt token's final hidden state [E] (after the model's final norm), put into the
  forward's output before vLLM's sampler reads it (a forward hook on the loaded model), so the
  first generated token and its log-probability are the full prefill's too.

At recompute ratio 1.0 both make the request bit-equal to stock vLLM's full prefill; below it
they keep the first token consistent with the KV that decoding reads. Where the hook cannot place
a row (no slot mapping in the forward context, a captured CUDA graph that skips Python hooks),
vLLM's own output stands: a rounding-level difference, never doubtful KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kmesh_blend.vllm.paged import PagedLayout
from kmesh_blend.vllm.seam.engine import hook_model_output, step_slots

__all__ = ["Tails"]

log = logging.getLogger("vllm.kmesh_blend")


class Tails:
    """Per-step tail rows of blended requests, keyed by request id.

    ``failed``: whether a request's load failed (its rows are then left to vLLM)."""

    def __init__(self, model: torch.nn.Module | None, failed: Callable[[str], bool]) -> None:
        self.failed = failed
        # req_id → (slots [n] int64, per layer (k, v) [n, Hkv, D])
        self.rows: dict[str, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        # req_id → (slot of the last prompt token, its final hidden state [E])
        self.finals: dict[str, tuple[int, torch.Tensor]] = {}
        self.placed = 0  # final hidden states placed into a forward's output (for tests/metrics)
        self._warned = False
        self._remove = hook_model_output(model, self._place) if model is not None else None

    def keep(
        self, req_id: str, slots: torch.Tensor, first: int, keys: list[torch.Tensor],
        values: list[torch.Tensor], final: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Keep rows ``first..T-1`` of the blend's per-layer ``keys`` / ``values`` ([T, Hkv, D]),
        at ``slots`` [T − first] int64, and ``final`` ([E], the last token's final hidden state,
        or None)."""
        layers = [(k[first:].clone(), v[first:].clone()) for k, v in zip(keys, values, strict=True)]
        self.rows[req_id] = (slots, layers)
        if final is not None:
            self.finals[req_id] = (int(slots[-1]), final.detach().clone())

    def write_back(self, paged: PagedLayout, kv_caches: list[torch.Tensor]) -> None:
        """After the forward: the kept KV rows into the paged cache (over vLLM's own)."""
        rows, self.rows = self.rows, {}
        self.finals.clear()  # a forward that did not place them has passed
        for req_id, (slots, layers) in rows.items():
            if self.failed(req_id):
                continue
            for cache, (k, v) in zip(kv_caches, layers, strict=True):
                paged.write(cache, k, v, slots.to(cache.device))

    def close(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def _place(self, output: torch.Tensor) -> None:
        """After the model's forward: the kept final hidden states into its output [T, E]."""
        if not self.finals:
            return
        finals, self.finals = self.finals, {}
        slots = step_slots()
        if slots is None:
            self._warn("no slot mapping in the forward context")
            return
        slots = slots[: output.shape[0]]
        for req_id, (slot, final) in finals.items():
            if self.failed(req_id):
                continue
            where = (slots == slot).nonzero()
            if where.numel() != 1 or final.shape[-1] != output.shape[-1]:
                self._warn(f"the last prompt token of {req_id} is not in this forward")
                continue
            output[int(where[0, 0])] = final.to(output.device, output.dtype)
            self.placed += 1

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kmesh: first token from vLLM's own tail forward: %s", why)
