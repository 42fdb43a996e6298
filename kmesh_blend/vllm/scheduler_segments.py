"""Scheduler side, segments: what the scheduler believes the store holds, and why not.

A segment is *published* once the worker stored it (or a shared store says another engine did);
it is *being saved* between the step that schedules its save and the worker's answer; the store
may have *refused* it (why, for its next readers) or the worker *retired* it by its lifetime (the
round it was published in). The worker's outcomes (`KMeshWorkerMetadata`) move these sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.vllm.meta import KMeshWorkerMetadata, SegmentRef
from kmesh_blend.vllm.registry import LruDict, LruSet
from kmesh_blend.vllm.reports import short

__all__ = ["SegmentRegistry"]


class SegmentRegistry:
    """``contains`` asks a shared store (``lm://``, ``redis://``) whether another engine
    published a segment; None for stores private to this engine. Sets are LRU-bounded by
    ``max_entries``."""

    def __init__(self, contains: Callable[[SegmentId], bool] | None, max_entries: int) -> None:
        self.contains = contains
        self.published: LruSet[str] = LruSet(max_entries)
        self.saving: set[str] = set()  # segments a save is already scheduled for
        self.unstored: LruDict[str, str] = LruDict(max_entries)  # refused by the store → why
        self.retired: LruDict[str, int] = LruDict(max_entries)  # retired → round published in

    def loadable(self, segment_id: str, problems: list[str]) -> bool:
        """Whether ``segment_id`` can be loaded; a store that cannot answer means no (the
        reason is appended to ``problems``; the store logs its outage itself)."""
        if segment_id in self.published:
            return True
        if self.contains is not None:
            try:
                if self.contains(SegmentId(segment_id)):
                    self.published.add(segment_id)
                    return True
            except Exception as exc:
                problems.append(str(exc))
        return False

    def why_not_stored(self, refs: Iterable[SegmentRef], lifetime: int) -> str | None:
        """Why none of ``refs`` can be loaded when the registry knows: retired by its rounds
        (this request stores it again), or refused by the store; else None."""
        refs = list(refs)
        gone = next((r for r in refs if r.segment_id in self.retired), None)
        if gone is not None:
            return (
                f"master retired: segment {gone.segment_id[:16]} published in round "
                f"{self.retired.get(gone.segment_id)}, lifetime {lifetime}"
            )
        for ref in refs:
            why = self.unstored.get(ref.segment_id)
            if why:  # stored before? the store could not take it
                return short(f"not stored: segment {ref.segment_id[:16]}: {why}")
        return None

    def claim_saves(self, refs: Iterable[SegmentRef]) -> list[SegmentRef]:
        """Of ``refs``, the segments no save is scheduled for and the store does not hold, once
        each; they count as being saved from now on."""
        unique: dict[str, SegmentRef] = {}
        for ref in refs:
            if ref.segment_id not in self.saving and ref.segment_id not in self.published:
                unique.setdefault(ref.segment_id, ref)
        self.saving.update(unique)
        return list(unique.values())

    def apply(self, out: KMeshWorkerMetadata) -> None:
        """The worker's outcomes: stored, lost, refused, retired."""
        self.published.update(out.published)
        self.saving.difference_update(out.published)
        # What the store could not give back or did not take is not published: the next
        # request that computes it stores it again.
        self.published.difference_update(out.lost)
        self.saving.difference_update(out.unpublished)
        for segment_id, why in out.store_errors.items():
            self.unstored[segment_id] = why
        for segment_id in out.published:
            self.unstored.pop(segment_id)
            self.retired.pop(segment_id)
        self.published.difference_update(out.retired)  # deleted from the store
        for segment_id, round_ in out.retired.items():
            self.retired[segment_id] = round_
