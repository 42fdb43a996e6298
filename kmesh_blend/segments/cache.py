"""`SegmentCache`: the segment layer as the blend sees it — index, store, singleflight, retention
and metrics behind ``publish`` / ``fetch``.

A fetch is served, in order, from: host-RAM retention (no read), an in-flight read of the same
segment (singleflight: join it, no read), or one read from the backing store (which is then
retained for the family's or round's lifetime). Failures never raise: a fetch that cannot be
served returns ``master=None`` with ``source="miss"`` (not stored) or ``"fallback"`` (load error
or timeout) and the request recomputes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, NamedTuple

from kmesh_blend.segments.health import StoreUnavailable
from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.index import SegmentIndex, SegmentInfo, SegmentState
from kmesh_blend.segments.metrics import SegmentMetrics
from kmesh_blend.segments.retention import RetentionPool
from kmesh_blend.segments.singleflight import SingleFlight, SingleFlightError, SingleFlightTimeout

if TYPE_CHECKING:
    import torch

    from kmesh_blend.segments.master import Master, MasterStore

__all__ = ["FetchResult", "SegmentCache"]

log = logging.getLogger(__name__)

Source = Literal["retained", "read", "joined", "miss", "fallback"]


class FetchResult(NamedTuple):
    master: Master | None
    """Shared, read-only ``Master`` (kv ``[L, 2, T, Hkv, D]``, positions ``[T]``), or None."""
    source: Source
    reads: int
    """Reads from the backing tier this call performed itself (0 or 1)."""
    reason: str = ""
    """Why a ``fallback`` happened (the load's error), else empty."""


class SegmentCache:
    """Thread-safe front of one `MasterStore`."""

    def __init__(
        self,
        store: MasterStore,
        *,
        index: SegmentIndex | None = None,
        retention_bytes: int = 1 << 30,
        singleflight: bool = True,
        retain: bool = True,
        timeout_s: float = 10.0,
        metrics: SegmentMetrics | None = None,
    ) -> None:
        self.store = store
        self.index = index if index is not None else SegmentIndex()
        self.metrics = metrics if metrics is not None else SegmentMetrics()
        self.retain = retain
        self.retention: RetentionPool[SegmentId, Master] = RetentionPool(
            retention_bytes, on_evict=self._on_evict
        )
        self._flight: SingleFlight[SegmentId, Master | None] | None = (
            SingleFlight(timeout_s=timeout_s) if singleflight else None
        )

    # -- writing ------------------------------------------------------------------------------

    def publish(
        self,
        segment_id: SegmentId,
        kv: torch.Tensor,
        positions: torch.Tensor,
        *,
        round: int | None = None,
        family: str | None = None,
        scope: str = "",
    ) -> bool:
        """Store a master and register it (kv ``[L, 2, T, Hkv, D]``, positions ``[T]`` int64),
        ``round`` counted on ``scope``'s clock (`SegmentIndex`).

        The publisher's copy is retained (pinned by ``family``), so its siblings read nothing.
        A master published in a round its scope has outlived is retired by the next
        `retire_expired` (the caller holds it for its family first, if it has one).
        """
        from kmesh_blend.segments.master import Master

        if not self.store.put(segment_id, kv, positions):
            return False
        master = Master(kv, positions)
        retained = self.retain and self.retention.put(
            segment_id, master, master.nbytes, owner=family
        )
        self.index.publish(
            segment_id,
            master.num_tokens,
            position_offset=int(positions[0]),
            round=round,
            family=family,
            nbytes=master.nbytes,
            state=SegmentState.READY if retained else SegmentState.COLD,
            scope=scope,
        )
        self._sync_gauge()
        return True

    # -- reading ------------------------------------------------------------------------------

    def fetch(self, segment_id: SegmentId, *, family: str | None = None) -> FetchResult:
        """The master of ``segment_id`` (see the module docstring for the order). Never raises."""
        master = self.retention.get(segment_id) if self.retain else None
        if master is not None:
            if family is not None:
                self.retention.pin(segment_id, family)
            self.metrics.hit()
            return FetchResult(master, "retained", 0)
        try:
            if self._flight is None:
                master, leader = self._load(segment_id, family), True
            else:
                out = self._flight.do(segment_id, lambda: self._load(segment_id, family))
                master, leader = out.value, out.leader
                if not leader:
                    self.metrics.join()
                    if master is not None and family is not None:
                        self.retention.pin(segment_id, family)
        except SingleFlightTimeout:
            self.metrics.fallback("load_timeout")
            return FetchResult(None, "fallback", 0, "another request's read did not finish in time")
        except Exception as exc:  # SingleFlightError, or the loader's own error
            cause = exc.__cause__ if isinstance(exc, SingleFlightError) and exc.__cause__ else exc
            if not isinstance(cause, StoreUnavailable):  # an outage is logged once, by the store
                log.warning("kmesh: fetch of %s… failed: %s", segment_id[:12], str(exc))
            self.metrics.fallback("load_error")
            reads = 1 if self._flight is None else 0
            return FetchResult(None, "fallback", reads, str(cause))
        if master is None:
            return FetchResult(None, "miss", 1 if leader else 0)
        return FetchResult(master, "read" if leader else "joined", 1 if leader else 0)

    def fetch_many(
        self, segment_ids: Iterable[SegmentId], *, family: str | None = None
    ) -> list[FetchResult]:
        """`fetch` for every segment of a prompt; a miss does not stop the others."""
        return [self.fetch(sid, family=family) for sid in segment_ids]

    # -- lifetimes ----------------------------------------------------------------------------

    def hold(self, segment_id: SegmentId, family: str) -> None:
        """Keep the segment for ``family`` until it closes: its retained copy is not evicted
        and its index entry outlives its rounds."""
        self.retention.pin(segment_id, family)
        if segment_id in self.index:
            with contextlib.suppress(KeyError):  # retired meanwhile
                self.index.pin(segment_id, family)

    def close_family(self, family: str) -> list[SegmentInfo]:
        """The family is done: drop its pins; retire (and delete) what only it kept alive."""
        self.retention.release_owner(family)
        return self._drop(self.index.close_family(family))

    def advance_round(self, to: int | None = None, scope: str = "") -> list[SegmentInfo]:
        """``scope``'s next round: retire its segments older than ``index.keep_rounds`` and
        delete their masters."""
        return self._drop(self.index.advance_round(to, scope))

    def retire_expired(self) -> list[SegmentInfo]:
        """Retire (and delete) every segment past its rounds that nothing holds."""
        return self._drop(self.index.retire_expired())

    def stats(self) -> dict[str, object]:
        """`SegmentMetrics.as_dict` plus singleflight and retention counters."""
        out: dict[str, object] = dict(self.metrics.as_dict())
        out["retention"] = self.retention.stats()
        out["singleflight"] = self._flight.stats() if self._flight is not None else {}
        return out

    # -- helpers -------------------------------------------------------------------------------

    def _load(self, segment_id: SegmentId, family: str | None) -> Master | None:
        self._set_state(segment_id, SegmentState.LOADING)
        try:
            master = self.store.get(segment_id)
        except BaseException:
            self._set_state(segment_id, SegmentState.COLD)
            raise
        finally:
            self.metrics.read(self.store.tier)
        if master is None:
            self.metrics.miss()
            self._set_state(segment_id, SegmentState.COLD)
            return None
        retained = self.retain and self.retention.put(
            segment_id, master, master.nbytes, owner=family
        )
        self._set_state(segment_id, SegmentState.READY if retained else SegmentState.COLD)
        self._sync_gauge()
        return master

    def _drop(self, retired: list[SegmentInfo]) -> list[SegmentInfo]:
        for info in retired:
            self.retention.remove(info.segment_id)
            self.store.delete(info.segment_id)
        self._sync_gauge()
        return retired

    def _on_evict(self, segment_id: SegmentId, nbytes: int) -> None:
        self.metrics.eviction()
        self._set_state(segment_id, SegmentState.COLD)

    def _set_state(self, segment_id: SegmentId, state: SegmentState) -> None:
        if segment_id in self.index:
            # retired meanwhile, or a concurrent transition: the index is advisory here
            with contextlib.suppress(KeyError, ValueError):
                self.index.set_state(segment_id, state)

    def _sync_gauge(self) -> None:
        self.metrics.set_retained_bytes(self.retention.retained_bytes)
