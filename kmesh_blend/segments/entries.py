"""The index's entries: a segment's state, and the snapshot lookups return
(`kmesh_blend.segments.index`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from kmesh_blend.segments.identity import SegmentId

__all__ = ["ALLOWED_TRANSITIONS", "Entry", "SegmentInfo", "SegmentState"]


class SegmentState(enum.Enum):
    COLD = "cold"
    LOADING = "loading"
    READY = "ready"
    EVICTED = "evicted"


ALLOWED_TRANSITIONS: set[tuple[SegmentState, SegmentState]] = {
    (SegmentState.COLD, SegmentState.LOADING),
    (SegmentState.LOADING, SegmentState.READY),
    (SegmentState.LOADING, SegmentState.COLD),
    (SegmentState.READY, SegmentState.COLD),
    (SegmentState.COLD, SegmentState.READY),  # a master put straight into host RAM
}


class SegmentInfo(NamedTuple):
    """Immutable snapshot of an entry (what lookups return)."""

    segment_id: SegmentId
    state: SegmentState
    num_tokens: int
    position_offset: int
    """The KV was computed at positions ``position_offset .. position_offset + num_tokens - 1``."""
    round: int | None
    families: frozenset[str]
    refcount: int
    pins: frozenset[str]
    nbytes: int
    scope: str = ""
    """Whose round clock ``round`` counts on (see the module docstring)."""


@dataclass
class Entry:
    """The index's mutable record of one segment (guarded by the index's lock)."""

    segment_id: SegmentId
    num_tokens: int
    position_offset: int
    round: int | None
    nbytes: int
    state: SegmentState = SegmentState.COLD
    families: set[str] = field(default_factory=set)
    pins: set[str] = field(default_factory=set)
    refcount: int = 0
    scope: str = ""

    def info(self, state: SegmentState | None = None) -> SegmentInfo:
        return SegmentInfo(
            self.segment_id, state or self.state, self.num_tokens, self.position_offset,
            self.round, frozenset(self.families), self.refcount, frozenset(self.pins),
            self.nbytes, self.scope,
        )  # fmt: skip
