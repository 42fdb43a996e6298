"""The prompt's tail: the last tokens vLLM computes itself after a blend, made the blend's own.

vLLM must compute at least one token of every prompt, so the connector loads all but the last
`VLLM_TAIL` tokens and vLLM runs its forward over those as a continuation of the blended KV. On
CPU that continuation rounds apart from the same rows inside a full prefill (fp32: last bits;
the attention and the GEMMs see 2 query rows instead of T). The blend computed those rows too,
in the prompt's own batch, exactly as a full prefill does. `Tails` hands vLLM the blend's
results for them:

- their KV, written back into the paged cache after the forward (`write_back`), so every decode
  step reads the full prefill's prompt KV;
- the final hidden states [E] (after the model's final norm) of the last prompt token and of
  the tokens before it that the blend computed, put into the forward's output before vLLM's
  sampler reads it (a forward hook on the loaded model), so the first generated token and its
  log-probability are the full prefill's too.

Where a step's forward holds nothing but such tail tokens, each with its final hidden state, the
forward itself is not run (``skip_forward``): its output is those states, and its only other
effect, the tail's KV in the paged cache, is what `write_back` writes anyway. That forward of two
tokens reads every weight of the model once — on a 2-core CPU a fixed 25–35 ms of a follow-up's
time to first token for SmolLM2-135M — and its results were thrown away. The skip needs every
token of the step accounted for and no failed request among them; otherwise the forward runs and
the states are placed into its output as before. Under tensor parallelism it is off (every rank
must run the same collective operations).

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

    ``failed``: whether a request's load failed (its rows are then left to vLLM);
    ``skip_forward``: a step of tail tokens only, all with their final states, skips vLLM's
    forward."""

    def __init__(self, model: torch.nn.Module | None, failed: Callable[[str], bool],
                 skip_forward: bool = False) -> None:  # fmt: skip
        self.failed = failed
        # req_id → (slots [n] int64, per layer (k, v) [n, Hkv, D])
        self.rows: dict[str, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        # req_id → (slots [m] int64 of the prompt's last m tokens, their final states [m, E])
        self.finals: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.placed = 0  # final hidden states placed into a forward's output (for tests/metrics)
        self.skipped = 0  # forwards not run: their output was the blend's (for tests/metrics)
        self.written: set[str] = set()  # requests whose rows the blend wrote into the cache
        self._warned = False
        known = self._known if skip_forward else None
        self._remove = hook_model_output(model, self._place, known) if model is not None else None

    def keep(
        self, req_id: str, slots: torch.Tensor, first: int, keys: list[torch.Tensor],
        values: list[torch.Tensor], finals: torch.Tensor | None, written: bool = False,
    ) -> None:  # fmt: skip
        """Keep rows ``first..T-1`` of the blend's per-layer ``keys`` / ``values`` ([T, Hkv, D],
        not changed after the blend: views are kept until this step's `write_back`), at ``slots``
        [T − first] int64, and ``finals`` ([m, E], 1 ≤ m ≤ T − first: the final hidden states of
        the prompt's last m tokens, or None). ``written``: the blend already wrote these rows
        into the paged cache (then only a forward that ran needs them written back)."""
        layers = [(k[first:], v[first:]) for k, v in zip(keys, values, strict=True)]
        self.rows[req_id] = (slots, layers)
        if written:
            self.written.add(req_id)
        if finals is not None:
            m = finals.shape[0]
            if not 1 <= m <= slots.numel():
                raise ValueError(f"{m} final states for a tail of {slots.numel()} tokens")
            self.finals[req_id] = (slots[-m:].clone(), finals.detach().clone())

    def write_back(self, paged: PagedLayout, kv_caches: list[torch.Tensor]) -> None:
        """After the forward: the kept KV rows into the paged cache (over vLLM's own)."""
        rows, self.rows = self.rows, {}
        self.finals.clear()  # a forward that did not place them has passed
        self.written.clear()
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
        for req_id, (kept, states) in finals.items():
            if self.failed(req_id):
                continue
            rows = _rows_of(slots, kept)
            if rows is None or states.shape[-1] != output.shape[-1]:
                self._warn(f"the prompt tail of {req_id} is not in this forward")
                continue
            output[rows] = states.to(output.device, output.dtype)
            self.placed += 1

    def _known(self, num_tokens: int) -> torch.Tensor | None:
        """Before the model's forward of ``num_tokens`` tokens: its whole output [T, E] when
        every token is a kept tail row with its final state (the forward is then not run)."""
        if not self.finals or any(self.failed(r) for r in self.finals):
            return None
        slots = step_slots()
        if slots is None or slots.numel() < num_tokens:
            return None
        kept = torch.cat([s for s, _ in self.finals.values()]).to(slots.device)
        if kept.numel() != num_tokens:
            return None
        order = _rows_of(kept, slots[:num_tokens])  # where each step token's state is kept
        if order is None:
            return None
        states = torch.cat([f for _, f in self.finals.values()])
        for req_id in self.finals:  # no forward wrote over what the blend wrote
            if req_id in self.written:
                del self.rows[req_id]
        self.finals = {}
        self.skipped += 1
        return states[order.to(states.device)]

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kmesh: first token from vLLM's own tail forward: %s", why)


def _rows_of(slots: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor | None:
    """[m] int64 rows of ``slots`` [n] holding each of ``wanted`` [m] in turn, or None when one
    of them is not there exactly once."""
    hits = slots[None, :] == wanted.to(slots.device)[:, None]  # [m, n]
    if not bool((hits.sum(dim=1) == 1).all()):
        return None
    return hits.to(torch.int8).argmax(dim=1)
