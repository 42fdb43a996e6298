"""Scheduler side of turns: which turn records the worker stored, found by a continuing prompt.

A request annotated ``"keep": true`` asks the worker to store its prompt's KV as a turn record
(`kmesh_blend.vllm.turns`) under ``turn_id(namespace, prompt)``; the record counts once the worker
says it stored it. A later prompt that starts with a stored prompt, its segments at the same
places, restores that record instead of blending. Plain Python; bounded (`LruDict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kmesh_blend.segments.identity import Namespace
from kmesh_blend.vllm.meta import SegmentRef
from kmesh_blend.vllm.registry import LruDict
from kmesh_blend.vllm.turns import turn_id

__all__ = ["HEAD", "TurnRegistry"]

HEAD = 16  # records are found by their prompt's first tokens (shorter prompts: not kept)


class _Record(NamedTuple):
    length: int  # prompt tokens
    segments: list[SegmentRef]
    head: tuple[int, ...]  # the prompt's first `HEAD` tokens


class TurnRegistry:
    """Stored turn records (at most ``capacity``), and the ones asked for but not yet stored."""

    def __init__(self, capacity: int) -> None:
        self.records: LruDict[str, _Record] = LruDict(capacity, on_evict=self._forget)
        self._lengths: dict[tuple[int, ...], dict[int, int]] = {}  # head → {length: records}
        self._keeping: dict[str, _Record] = {}  # asked to be stored, not confirmed yet
        self._finished: list[str] = []  # of `_keeping`: their requests finished this step

    @property
    def num_pending(self) -> int:
        return len(self._keeping)

    def keep(self, namespace: Namespace, tokens: Sequence[int], segments: list[SegmentRef]) -> str:
        """The record id a request's prompt ``tokens`` will be stored under (pending until
        `stored`)."""
        record = turn_id(namespace, tokens)
        self._keeping[record] = _Record(len(tokens), segments, tuple(tokens[:HEAD]))
        return record

    def stored(self, records: Sequence[str]) -> None:
        """The worker stored these records."""
        for record in records:
            kept = self._keeping.pop(record, None)
            if kept is not None and record not in self.records:
                self.records[record] = kept
                counts = self._lengths.setdefault(kept.head, {})
                counts[kept.length] = counts.get(kept.length, 0) + 1

    def finished(self, record: str) -> None:
        """The request that asked for ``record`` finished: its record is stored by the next
        step, or never will be."""
        self._finished.append(record)

    def new_step(self) -> None:
        for record in self._finished:
            self._keeping.pop(record, None)
        self._finished.clear()

    def find(
        self, namespace: Namespace, tokens: Sequence[int], segments: list[SegmentRef]
    ) -> tuple[str, int] | None:
        """The longest stored record whose prompt is a proper prefix of ``tokens`` with the same
        segments at the same places: (record id, its length), or None."""
        for length in sorted(self._lengths.get(tuple(tokens[:HEAD]), ()), reverse=True):
            if length >= len(tokens):  # vLLM must compute at least one token
                continue
            record = turn_id(namespace, tokens[:length])
            stored = self.records.get(record)
            if stored is not None and stored.segments == [r for r in segments if r.end <= length]:
                return record, length
        return None

    def _forget(self, record: str, entry: _Record) -> None:
        """A record fell out of `records`: its prompt length no longer needs looking up."""
        counts = self._lengths.get(entry.head, {})
        counts[entry.length] = counts.get(entry.length, 1) - 1
        if counts[entry.length] <= 0:
            del counts[entry.length]
        if not counts:
            self._lengths.pop(entry.head, None)
