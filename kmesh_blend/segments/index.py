"""The round-aware segment index: what is shared, in what state, for how long.

Plain Python, no device, thread-safe (one lock). Entries are keyed by `SegmentId` and record the
segment's state, the first position its KV was computed at, the round it was published in, the
families that use it, an in-use reference count and pins.

Lifetime. Rounds are counted per *scope* (a tenant: the engine's connector passes the request's
``cache_salt``; ``""`` by default), so one tenant's rounds never retire another's segments. A
segment published in round ``r`` of scope ``s`` lives while ``round_of(s) < r + keep_rounds``
(multi-agent All-Gather: each agent's output of round ``r`` is read by every agent in round
``r + 1``; with ``keep_rounds=2`` it is retired when round ``r + 2`` starts). A segment published
in a round its scope has already outlived is expired at once: `retire_expired` (called after
publishing) returns it. Past ``max_entries`` scopes, the clocks of scopes without entries are
dropped (a caller that knows a scope's round passes it again with `advance_round`). An expired
entry is *retired* (removed, returned with state ``EVICTED`` so the caller can free its storage)
unless it is pinned by an open family or in use (refcount > 0); such an entry is retired as soon
as the last pin or reference goes. Entries published without a round are not round-scoped: they
live until `evict`, or until the index holds ``max_entries`` and they are the oldest not held (the
index forgets them; their masters stay in the store until the store's own budget evicts them).

States: ``COLD`` (master only in the backing tier) → ``LOADING`` (a read in flight) → ``READY``
(in host RAM); ``LOADING → COLD`` on a failed read, ``READY → COLD`` when host RAM drops it.
``EVICTED`` is only ever seen on returned snapshots of removed entries.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kmesh_blend.segments.entries import ALLOWED_TRANSITIONS, Entry, SegmentInfo, SegmentState
from kmesh_blend.segments.identity import SegmentId

__all__ = ["SegmentIndex", "SegmentInfo", "SegmentState"]


class SegmentIndex:
    """Round-aware index of shared segments (see the module docstring for the lifetime rules)."""

    def __init__(self, keep_rounds: int = 2, max_entries: int = 1 << 16) -> None:
        if isinstance(keep_rounds, bool) or not isinstance(keep_rounds, int) or keep_rounds < 1:
            raise ValueError(f"keep_rounds must be an int >= 1, got {keep_rounds!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        self.keep_rounds = keep_rounds
        self.max_entries = max_entries
        self._rounds: dict[str, int] = {}  # scope → its current round (0 when absent)
        self._entries: dict[SegmentId, Entry] = {}
        self._open_families: set[str] = set()
        self._lock = threading.RLock()

    # -- queries ------------------------------------------------------------------------------

    @property
    def current_round(self) -> int:
        """The default scope's round (`round_of`)."""
        return self.round_of("")

    def round_of(self, scope: str) -> int:
        """The current round of ``scope`` (0 until one is announced)."""
        return self._rounds.get(scope, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._entries

    def get(self, segment_id: SegmentId) -> SegmentInfo | None:
        with self._lock:
            entry = self._entries.get(segment_id)
            return entry.info() if entry else None

    def lookup(self, segment_ids: Iterable[SegmentId]) -> list[SegmentInfo | None]:
        """Snapshots of all segments of a prompt, in order; ``None`` for unknown ones.

        Every segment is looked up on its own: a miss does not stop the lookup.
        """
        with self._lock:
            return [self.get(sid) for sid in segment_ids]

    def entries(self) -> list[SegmentInfo]:
        with self._lock:
            return [e.info() for e in self._entries.values()]

    @property
    def total_bytes(self) -> int:
        """Sum of ``nbytes`` of every live entry."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    @property
    def open_families(self) -> frozenset[str]:
        return frozenset(self._open_families)

    # -- publishing and state ------------------------------------------------------------------

    def publish(
        self,
        segment_id: SegmentId,
        num_tokens: int,
        *,
        position_offset: int = 0,
        round: int | None = None,
        family: str | None = None,
        nbytes: int = 0,
        state: SegmentState = SegmentState.COLD,
        scope: str = "",
    ) -> SegmentInfo:
        """Register a segment (idempotent). Re-publishing adds the family and extends the
        lifetime to the later round; the first publication's positions, size and scope are kept.
        ``round`` counts on ``scope``'s clock. Nothing is retired here, even a segment past its
        rounds (its caller may still hold it): call `retire_expired` after."""
        if num_tokens < 1 or nbytes < 0 or position_offset < 0:
            raise ValueError(
                f"bad entry: num_tokens={num_tokens}, nbytes={nbytes}, offset={position_offset}"
            )
        if round is not None and round < 0:
            raise ValueError(f"round must be >= 0, got {round}")
        if state not in (SegmentState.COLD, SegmentState.READY):
            raise ValueError(f"a segment is published COLD or READY, not {state}")
        with self._lock:
            entry = self._entries.get(segment_id)
            if entry is None:
                entry = Entry(
                    segment_id, num_tokens, position_offset, round, nbytes, state, scope=scope
                )
                self._entries[segment_id] = entry
                self._forget_oldest()
            elif entry.round is not None:
                entry.round = None if round is None else max(entry.round, round)
            if family is not None:
                entry.families.add(family)
            return entry.info()

    def publish_round(
        self,
        round: int,
        segments: Iterable[tuple[SegmentId, int, int, int]],
        *,
        family: str | None = None,
    ) -> list[SegmentInfo]:
        """Publish one round's outputs: ``(segment_id, num_tokens, position_offset, nbytes)``."""
        with self._lock:
            return [
                self.publish(sid, n, position_offset=off, round=round, family=family, nbytes=nbytes)
                for sid, n, off, nbytes in segments
            ]

    def set_state(self, segment_id: SegmentId, state: SegmentState) -> SegmentInfo:
        """Move an entry to ``state``; raises `ValueError` for a transition that is not allowed."""
        with self._lock:
            entry = self._require(segment_id)
            if entry.state != state and (entry.state, state) not in ALLOWED_TRANSITIONS:
                raise ValueError(
                    f"{segment_id[:12]}: {entry.state.name} → {state.name} not allowed"
                )
            entry.state = state
            return entry.info()

    # -- references and pins -------------------------------------------------------------------

    def acquire(self, segment_id: SegmentId) -> SegmentInfo:
        """Mark the segment in use (it cannot be retired or evicted until `release`)."""
        with self._lock:
            entry = self._require(segment_id)
            entry.refcount += 1
            return entry.info()

    def release(self, segment_id: SegmentId) -> list[SegmentInfo]:
        """Drop one reference; returns entries retired because this was the last thing holding
        them. Raises `ValueError` on a release without an acquire."""
        with self._lock:
            entry = self._require(segment_id)
            if entry.refcount <= 0:
                raise ValueError(f"{segment_id[:12]}: release without acquire")
            entry.refcount -= 1
            return self._retire_expired()

    def open_family(self, family: str) -> None:
        with self._lock:
            self._open_families.add(family)

    def close_family(self, family: str) -> list[SegmentInfo]:
        """Close a family: drop all its pins; returns the entries this retired."""
        with self._lock:
            self._open_families.discard(family)
            for entry in self._entries.values():
                entry.pins.discard(family)
            return self._retire_expired()

    def pin(self, segment_id: SegmentId, family: str) -> SegmentInfo:
        """Keep the segment past its rounds while ``family`` is open (opens the family)."""
        with self._lock:
            entry = self._require(segment_id)
            self._open_families.add(family)
            entry.pins.add(family)
            entry.families.add(family)
            return entry.info()

    def unpin(self, segment_id: SegmentId, family: str) -> list[SegmentInfo]:
        with self._lock:
            self._require(segment_id).pins.discard(family)
            return self._retire_expired()

    # -- rounds and eviction -------------------------------------------------------------------

    def advance_round(self, to: int | None = None, scope: str = "") -> list[SegmentInfo]:
        """Start ``scope``'s next round (or round ``to``); returns the entries retired by it."""
        with self._lock:
            now = self.round_of(scope)
            new = now + 1 if to is None else to
            if new < now:
                raise ValueError(f"rounds only move forward: {now} → {new}")
            self._rounds[scope] = new
            retired = self._retire_expired()
            if len(self._rounds) > self.max_entries:  # scopes without entries need no clock
                live = {e.scope for e in self._entries.values()} | {scope}
                self._rounds = {s: r for s, r in self._rounds.items() if s in live}
            return retired

    def retire_expired(self) -> list[SegmentInfo]:
        """Remove and return every entry past its rounds that nothing holds (for entries
        published in a round their scope had already outlived)."""
        with self._lock:
            return self._retire_expired()

    def evict(self, segment_id: SegmentId) -> SegmentInfo | None:
        """Remove an entry now if it is neither pinned by an open family nor in use."""
        with self._lock:
            entry = self._entries.get(segment_id)
            if entry is None or self._held(entry):
                return None
            del self._entries[segment_id]
            return entry.info(SegmentState.EVICTED)

    def is_expired(self, info: SegmentInfo) -> bool:
        return info.round is not None and self.round_of(info.scope) >= info.round + self.keep_rounds

    # -- helpers -------------------------------------------------------------------------------

    def _require(self, segment_id: SegmentId) -> Entry:
        entry = self._entries.get(segment_id)
        if entry is None:
            raise KeyError(f"unknown segment {segment_id!r}")
        return entry

    def _forget_oldest(self) -> None:
        """Over ``max_entries``: drop the oldest entries that nothing holds."""
        excess = len(self._entries) - self.max_entries
        if excess <= 0:
            return
        gone = [sid for sid, e in self._entries.items() if not self._held(e)][:excess]
        for sid in gone:
            del self._entries[sid]

    def _held(self, entry: Entry) -> bool:
        return entry.refcount > 0 or bool(entry.pins & self._open_families)

    def _retire_expired(self) -> list[SegmentInfo]:
        keep = self.keep_rounds
        gone = [
            sid
            for sid, e in self._entries.items()
            if e.round is not None
            and self._rounds.get(e.scope, 0) >= e.round + keep
            and not self._held(e)
        ]
        return [self._entries.pop(sid).info(SegmentState.EVICTED) for sid in gone]
