"""Worker side, lifetimes: round clocks per scope, family closes, and what they retire.

A segment's master goes from the store when the index retires it (its round outlived by its
tenant, or its family closed); the worker remembers why, so the next reader's fallback names it,
and tells the scheduler (`KMeshWorkerMetadata.retired`), which forgets the segment.
"""

from __future__ import annotations

import logging

from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.index import SegmentInfo
from kmesh_blend.vllm.meta import KMeshMetadata, KMeshWorkerMetadata, SaveRequest
from kmesh_blend.vllm.registry import LruDict

__all__ = ["Lifetimes"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


class Lifetimes:
    def __init__(self, cache: SegmentCache) -> None:
        self.cache = cache
        self._retired: LruDict[str, int | None] = LruDict(1 << 16)  # id → round, for reasons
        self._closed_upto = 0  # the highest family-close number applied (meta.py)

    def apply(self, meta: KMeshMetadata, out: KMeshWorkerMetadata) -> None:
        """Move the round-aware index to the announced rounds and close finished families."""
        retired = self._advance(meta.rounds)
        out.rounds.update({scope: self.cache.index.round_of(scope) for scope in meta.rounds})
        for number, family in meta.closes:
            if number > self._closed_upto:
                retired += self.cache.close_family(family)
                self._closed_upto = out.closed_upto = number
        self._report(retired, out)

    def after_saves(self, saves: list[SaveRequest], out: KMeshWorkerMetadata) -> None:
        """A round announced late may be one its tenant has outlived: its segments go now (the
        tenant's clock as the scheduler knows it, should the index have forgotten it)."""
        if not any(save.round is not None for save in saves):
            return
        known = {s.scope: s.scope_round for s in saves if s.scope_round is not None}
        self._report(self._advance(known) + self.cache.retire_expired(), out)

    def published(self, segment_id: str) -> None:
        self._retired.pop(segment_id)

    def reason(self, segment_id: str) -> str | None:
        """Why a reader cannot have ``segment_id`` when its lifetime retired it; else None."""
        if segment_id not in self._retired:
            return None
        round_ = self._retired.get(segment_id)
        return f"master retired: segment {segment_id[:16]} published in round {round_}"

    def _advance(self, rounds: dict[str, int]) -> list[SegmentInfo]:
        retired = []
        for scope, round_ in rounds.items():
            if round_ > self.cache.index.round_of(scope):
                retired += self.cache.advance_round(round_, scope)
        return retired

    def _report(self, retired: list[SegmentInfo], out: KMeshWorkerMetadata) -> None:
        for info in retired:
            self._retired[info.segment_id] = info.round
            out.retired[info.segment_id] = -1 if info.round is None else info.round
        if retired:
            log.info("kmesh: %d segments retired by their rounds or families", len(retired))
