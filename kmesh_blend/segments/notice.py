"""Application notice: prepare a family's segments before its follow-ups arrive.

An application that knows follow-ups are coming (an agent framework about to fan out, a chat
front-end that just received a document) calls `Notice.prepare` (the artifacts library's
`ArtifactStore.prepare`) and the family's masters are read into host RAM and pinned for the
family's lifetime. (In serving, any request with a ``family`` does this for its segments: one sent
ahead of the follow-ups is the notice.) The follow-ups then find them retained (no read, no wait) or
join the preparation's in-flight read (singleflight). Preparation time is accounted on its own
(`PrepareReport`, ``prepare_seconds`` metric), never in the follow-ups' waiting time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import SegmentId

__all__ = ["Notice", "PrepareReport"]


class PrepareReport(NamedTuple):
    family: str
    num_segments: int
    num_ready: int
    """Segments now in host RAM (retained before, or read now)."""
    reads: int
    """Reads from the backing tier the preparation performed."""
    seconds: float
    """Wall time of the preparation (reported apart from the follow-ups' waits)."""


class Notice:
    """Runs preparations for a `SegmentCache`, inline or on one background thread."""

    def __init__(self, cache: SegmentCache) -> None:
        self.cache = cache
        self._pool: ThreadPoolExecutor | None = None

    def prepare(self, family: str, segment_ids: Sequence[SegmentId]) -> PrepareReport:
        """Read and pin ``segment_ids`` for ``family`` now; returns when they are in host RAM."""
        if not isinstance(family, str) or not family:
            raise ValueError(f"family must be a non-empty string, got {family!r}")
        self.cache.index.open_family(family)
        start = time.perf_counter()
        results = self.cache.fetch_many(segment_ids, family=family)
        seconds = time.perf_counter() - start
        for sid in segment_ids:
            if sid in self.cache.index:
                self.cache.index.pin(sid, family)
        self.cache.metrics.prepare_time(seconds)
        ready = sum(r.master is not None for r in results)
        reads = sum(r.reads for r in results)
        return PrepareReport(family, len(segment_ids), ready, reads, seconds)

    def prepare_async(self, family: str, segment_ids: Sequence[SegmentId]) -> Future[PrepareReport]:
        """`prepare` on a background thread; follow-ups arriving meanwhile join its reads."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kmesh-notice")
        return self._pool.submit(self.prepare, family, list(segment_ids))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
