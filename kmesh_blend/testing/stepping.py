"""Driving an in-process vLLM engine step by step: outputs, aborts, and what its KV pool held.

Tests and benchmarks of ``kmesh.share_kv_memory`` need more than ``LLM.generate``: how many
requests ran at once, how many blocks were free, who was preempted, and an abort in the middle
of decode. `drive` adds the requests, steps the engine until all finish, and records the
scheduler's view after every step (`kmesh_blend.vllm.seam.engine.pool_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kmesh_blend.vllm.seam.engine import PoolState, pool_state

__all__ = ["Driven", "Request", "drive"]


@dataclass
class Driven:
    """What `drive` saw: each finished request's output by id, the pool after every step, each
    request's preemptions (by the caller's id), and the ids aborted."""

    outputs: dict[str, Any] = field(default_factory=dict)
    trace: list[PoolState] = field(default_factory=list)
    preemptions: dict[str, int] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    # per step: (requests that got a token, of them their first)
    emitted: list[tuple[int, int]] = field(default_factory=list)

    def decode_only(self, step: int) -> bool:
        """Whether step ``step`` only decoded: every running request got a token, none its
        first (no prefill in it)."""
        got, first = self.emitted[step]
        return first == 0 and got == self.trace[step].running > 0

    @property
    def most_running(self) -> int:
        return max((s.running for s in self.trace), default=0)

    @property
    def fewest_free(self) -> int:
        return min((s.blocks_free for s in self.trace), default=0)

    @property
    def num_preempted(self) -> int:
        return sum(1 for n in self.preemptions.values() if n)


Request = tuple[str, dict[str, Any], Any]  # id, prompt, sampling params


def drive(llm: Any, requests: list[Request],
          each_step: Callable[[int, Driven], tuple[list[str], list[Request]]] | None = None,
          max_steps: int = 100_000) -> Driven:  # fmt: skip
    """Run ``requests`` on ``llm`` (engine core in this process) until every request is done.
    ``each_step(step, driven)`` → (ids to abort, requests to add) after that step."""
    engine = llm.llm_engine
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    out = Driven()
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            return out
        got = first = 0
        for o in engine.step():
            got += 1
            first += len(o.outputs[0].token_ids) == 1 if o.outputs else 0
            if o.finished:
                out.outputs[o.request_id] = o
        out.emitted.append((got, first))
        state = pool_state(llm)
        out.trace.append(state)
        for req_id, n in state.preemptions.items():
            req_id = req_id.rsplit("-", 1)[0]  # vLLM's own id: the caller's + "-" + 8 chars
            out.preemptions[req_id] = max(n, out.preemptions.get(req_id, 0))
        if each_step is not None:
            gone, more = each_step(step, out)
            if gone:
                engine.abort_request(gone)
                out.aborted += gone
            for req_id, prompt, params in more:
                engine.add_request(req_id, prompt, params)
    raise RuntimeError(f"requests still unfinished after {max_steps} steps")
