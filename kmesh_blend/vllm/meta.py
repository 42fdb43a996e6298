"""What the scheduler side tells the worker side each step, and what comes back.

Plain dataclasses (picklable: in multiprocess mode they cross a process boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.vllm.paged import slot_mapping

__all__ = [
    "VLLM_TAIL",
    "KMeshMetadata",
    "KMeshWorkerMetadata",
    "LoadRequest",
    "Report",
    "SaveRequest",
    "SegmentRef",
    "new_report",
]


VLLM_TAIL = 2
"""Prompt tokens at the end that vLLM computes itself in its forward, over the blended KV.

vLLM's connector contract leaves at least the last one to vLLM. We leave two: vLLM's CPU
attention takes a decode path for a single query token, whose bits differ more from the same row
inside a prefill (measured on the tiny fp32 Llama: log-probabilities identical to stock with 2,
not with 1). The blend's own results for these tokens (their KV, the last one's final hidden
state) replace vLLM's: `kmesh_blend/vllm/tails.py`."""


class Report(TypedDict, total=False):
    """A request's reuse report (``RequestOutput.kv_transfer_params["kmesh"]``; the fields are
    documented in docs/contract.md). The scheduler side owns it; the worker side's outcomes are
    merged into it."""

    reused_tokens: int
    recomputed_tokens: int
    drift_shifted_rows: int
    storage_reads: int
    fallback: str | None
    prefix_cached_tokens: int
    load_ms: float
    kept_bytes: int
    restored_tokens: int
    cascade_steps: int
    cascade_shared_rows: int
    cascade_kernel: str
    cascade_off: str | None
    released_blocks: int
    mirror_bytes: int
    kv_share_off: str
    kv_held_bytes: int
    preemptions: int
    family: str
    engine: str


def new_report() -> Report:
    """The fields every annotated request's report has."""
    return {"reused_tokens": 0, "recomputed_tokens": 0, "storage_reads": 0, "fallback": None}


@dataclass(frozen=True)
class SegmentRef:
    """A stored segment placed at prompt tokens [start, end)."""

    start: int
    end: int
    segment_id: SegmentId


@dataclass
class LoadRequest:
    """Blend this request and write its KV for prompt tokens [first, end): ``end`` None is the
    whole prompt, its last `VLLM_TAIL` tokens through `tails.Tails`; an ``end`` before that is
    the end of its last reused segment, and vLLM's own forward computes the tokens after it
    (`scheduler_reuse.blend_end`)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    segments: list[SegmentRef]
    first: int  # tokens before this are already in the paged cache (vLLM's own)
    turn: str | None = None  # restore this turn record (its prompt = token_ids[:turn_len]) instead
    turn_len: int = 0
    keep: str | None = None  # after the forward, store this request's prompt as this turn record
    family: str | None = None  # the masters it reads are held for this family until it closes
    recompute_ratio: float | None = None  # the request's own setting (None: the engine's)
    sink_tokens: int | None = None  # the request's own setting (None: the engine's)
    drift_correction: str | None = None  # the request's own setting (None: the engine's)
    end: int | None = None  # the blend stops here; vLLM computes the rest (None: whole prompt)
    max_tokens: int | None = None  # the most tokens it generates (its sampling parameters)
    _slots: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def blend_len(self) -> int:
        """Prompt tokens the blend computes: [0, blend_len)."""
        return len(self.token_ids) if self.end is None else self.end

    @property
    def tail(self) -> int:
        """Of those, the last ones whose KV is written after vLLM's forward (`tails.Tails`)."""
        return VLLM_TAIL if self.end is None else 0

    def slots(self, block_size: int) -> torch.Tensor:
        """[T'] int64: the paged-cache slots of the first T' prompt tokens, those its blocks
        hold this step (computed once, then carried to every write, read and plan of this
        request). T' < T when vLLM prefills the prompt in chunks: a blend that stops early
        gets blocks up to its end and this step's chunk; the rest's come in later steps."""
        if self._slots is None:
            held = min(len(self.token_ids), len(self.block_ids) * block_size)
            self._slots = slot_mapping(self.block_ids, block_size, 0, held)
        return self._slots

    def unheld(self, block_size: int) -> str | None:
        """Why this step's blocks cannot take what the load writes (None: they can): the blend
        writes prompt tokens up to `blend_len`, a turn restore up to ``turn_len``."""
        need = self.turn_len if self.turn is not None else self.blend_len
        held = int(self.slots(block_size).numel())
        if held < need:
            return f"its blocks hold {held} of the {need} prompt tokens the load writes"
        return None


@dataclass
class SaveRequest:
    """After this step's forward, store these segments' KV (read from the paged cache)."""

    req_id: str
    block_ids: list[int]
    segments: list[SegmentRef]
    family: str | None = None  # held for this family until it closes
    round: int | None = None  # published in this round (retired `round_lifetime` rounds later)
    scope: str = ""  # whose round clock ``round`` counts on (the tenant)
    scope_round: int | None = None  # that clock as the scheduler knows it (the index may not)

    def slots(self, block_size: int, ref: SegmentRef) -> torch.Tensor:
        """[end − start] int64: the paged-cache slots of segment ``ref``'s tokens."""
        return slot_mapping(self.block_ids, block_size, ref.start, ref.end)


@dataclass
class KMeshMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    # Rounds announced per tenant scope (scope → latest round) that the worker has not
    # confirmed yet: its round-aware index moves each scope's clock to them.
    rounds: dict[str, int] = field(default_factory=dict)
    # Families closed by finished requests, numbered: sent every step until the worker says it
    # applied them (a step without a forward may never reach the worker).
    closes: list[tuple[int, str]] = field(default_factory=list)
    # A request waited for KV blocks this step (cascade decode's speed guard: memory is short).
    memory_short: bool = False
    # Tokens this step computes (the speed guard's step-time fit: what memory can buy).
    scheduled_tokens: int = 0


@dataclass
class KMeshWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-request outcomes of the worker side: req_id → report fields; segment ids published."""

    reports: dict[str, Report] = field(default_factory=dict)
    published: list[str] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # turn records stored this step
    disabled: str | None = None  # why reuse cannot run in this engine (unsupported model)
    lost: list[str] = field(default_factory=list)  # believed stored, but could not be read
    unpublished: list[str] = field(default_factory=list)  # scheduled saves that did not store
    store_errors: dict[str, str] = field(default_factory=dict)  # segment id → why not stored
    retired: dict[str, int] = field(default_factory=dict)  # deleted by their lifetime → round
    closed_upto: int = 0  # the highest family-close number applied
    rounds: dict[str, int] = field(default_factory=dict)  # scope → round now applied
    # readers whose segment blocks may go back to vLLM's pool: req_id → [(index, block id)]
    releases: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KMeshWorkerMetadata):
            for req_id, report in other.reports.items():
                self.reports.setdefault(req_id, {}).update(report)
            self.published.extend(other.published)
            self.turns.extend(other.turns)
            self.disabled = self.disabled or other.disabled
            self.lost.extend(other.lost)
            self.unpublished.extend(other.unpublished)
            self.store_errors.update(other.store_errors)
            self.retired.update(other.retired)
            self.closed_upto = max(self.closed_upto, other.closed_upto)
            self.releases.update(other.releases)
            for scope, round_ in other.rounds.items():
                self.rounds[scope] = max(round_, self.rounds.get(scope, round_))
        return self
