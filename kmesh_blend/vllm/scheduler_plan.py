"""Scheduler side, one request's plan: what it loads, what it saves, what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from kmesh_blend.vllm.meta import LoadRequest, Report, SegmentRef, new_report

__all__ = ["Plan"]


@dataclass
class Plan:
    """One annotated request as the scheduler sees it: its prompt, its segments' placements,
    which to load and which to save, its lifetime fields, options and report."""

    token_ids: list[int]
    segments: list[SegmentRef]
    loads: list[SegmentRef] = field(default_factory=list)
    saves: list[SegmentRef] = field(default_factory=list)
    first: int = 0
    end: int | None = None  # the blend stops at this prompt token (None: the whole prompt)
    turn: tuple[str, int] | None = None  # (turn record, its prompt length) to restore
    keep: str | None = None  # turn record to store after the forward
    pending_load: bool = False
    asked: int = -1  # num_computed_tokens of the ask that made this plan, and its answer
    matched: int = 0
    saved: bool = False
    blocks: list[int] = field(default_factory=list)
    family: str | None = None  # the annotation's lifetime fields (docs/contract.md)
    round: int | None = None
    scope: str = ""  # whose round clock `round` counts on (`rounds.scope_of`)
    close: bool = False
    # the request's own ratio, sink tokens and drift correction (None: the engine's)
    options: tuple[float | None, int | None, str | None] = (None, None, None)
    report: Report = field(default_factory=new_report)
    before: Report | None = None  # its report when it was preempted (`reports.resumed`)
    request: object = None  # vLLM's request object (blocks given back need it)
    released: int = 0  # its blocks given back to vLLM's pool, while it lives

    def load_request(self, req_id: str) -> LoadRequest:
        """What the worker blends and writes for this plan (before the step's forward)."""
        turn, turn_len = self.turn or (None, 0)
        return LoadRequest(
            req_id, self.token_ids, self.blocks, self.loads, self.first, turn=turn,
            turn_len=turn_len, keep=self.keep, family=self.family,
            recompute_ratio=self.options[0], sink_tokens=self.options[1],
            drift_correction=self.options[2], end=self.end,
            max_tokens=getattr(self.request, "max_tokens", None),
        )  # fmt: skip
