"""Application notice for artifacts: the segment layer's `Notice`, run over an `ArtifactStore`.

`Notice` needs three things of the cache it prepares for: its ``index`` (to open the family and
pin), its ``metrics`` (preparation time) and ``fetch_many`` (results with ``master`` and
``reads``). `_NoticeAdapter` provides exactly these over an `ArtifactStore`, so preparation —
inline or on `Notice`'s background thread, with children joining its in-flight loads — is the
segment layer's code, not a copy of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple, cast

from kmesh_blend.artifacts.errors import ArtifactError
from kmesh_blend.artifacts.objects import SharedArtifact
from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.index import SegmentIndex
from kmesh_blend.segments.metrics import SegmentMetrics
from kmesh_blend.segments.notice import Notice

if TYPE_CHECKING:
    from kmesh_blend.artifacts.store import ArtifactStore, Fetched, Prepared
    from kmesh_blend.segments.cache import SegmentCache

__all__ = ["make_notice", "prepare"]

log = logging.getLogger(__name__)


def prepare(store: ArtifactStore, family: str, keys: list[str]) -> Prepared:
    """Load and pin ``keys`` for the open ``family`` now (the store checked both); per-key
    results come back too."""
    from kmesh_blend.artifacts.store import Prepared

    adapter = _NoticeAdapter(store)
    report = Notice(_as_cache(adapter)).prepare(family, [SegmentId(k) for k in keys])
    return Prepared(report, tuple(adapter.fetched))


def make_notice(store: ArtifactStore) -> Notice:
    """The `Notice` that runs ``store``'s background preparations (one per store)."""
    return Notice(_as_cache(_NoticeAdapter(store)))


class _NoticeFetch(NamedTuple):
    """What `Notice` reads of a fetch result."""

    master: SharedArtifact | None
    reads: int


class _NoticeAdapter:
    """The part of `SegmentCache` that `Notice` uses, over an `ArtifactStore`."""

    def __init__(self, store: ArtifactStore) -> None:
        self._store = store
        self.fetched: list[Fetched | None] = []

    @property
    def index(self) -> SegmentIndex:
        return self._store.index

    @property
    def metrics(self) -> SegmentMetrics:
        return self._store.metrics

    def fetch_many(self, keys: Iterable[str], *, family: str | None = None) -> list[_NoticeFetch]:
        """Like `SegmentCache.fetch_many`, a failed load does not stop the others."""
        out = []
        for key in keys:
            try:
                got: Fetched | None = self._store.get(key, family=family)
            except ArtifactError as exc:
                log.warning("kmesh: preparing %r for family %r failed: %s", key, family, str(exc))
                got = None
            self.fetched.append(got)
            out.append(
                _NoticeFetch(None, 0)
                if got is None
                else _NoticeFetch(got.artifact, got.reads + got.loads)
            )
        return out


def _as_cache(adapter: _NoticeAdapter) -> SegmentCache:
    # Notice is typed against SegmentCache but only uses index, metrics and fetch_many.
    return cast("SegmentCache", adapter)
