"""Family lifecycle of an `ArtifactStore`: open and close families, children's copy-on-write
views (their copies charged to host RAM), and what is deleted when a family or a round ends.

`FamilyLifecycle` is the store's base class; it works on the store's index, tiers and pins.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kmesh_blend.artifacts.errors import (
    ArtifactInputError,
    BudgetError,
    DoubleReleaseError,
    UnknownFamilyError,
)
from kmesh_blend.artifacts.objects import ChildView, SharedArtifact
from kmesh_blend.segments.identity import SegmentId

if TYPE_CHECKING:
    from kmesh_blend.artifacts.disk import DiskTier
    from kmesh_blend.artifacts.pins import PinLedger
    from kmesh_blend.artifacts.store import Fetched, _Decl
    from kmesh_blend.segments.index import SegmentIndex
    from kmesh_blend.segments.retention import RetentionPool

__all__ = ["FamilyLifecycle", "Released"]


class Released(NamedTuple):
    family: str
    num_dropped: int
    """Artifacts deleted from both tiers because only this family used them."""
    num_views: int
    """Child views the close had to close."""
    freed_ram_bytes: int
    freed_disk_bytes: int


class _Copy(NamedTuple):
    """A child's private copy, as held in the host-RAM pool (accounting only)."""

    view: ChildView


class FamilyLifecycle:
    """Families, views and deletion; mixed into `ArtifactStore` (which sets the attributes)."""

    index: SegmentIndex
    ram: RetentionPool[str, SharedArtifact | _Copy]
    disk: DiskTier
    pins: PinLedger[str]
    _decls: dict[str, _Decl]
    _families: dict[str, bool]  # name -> open
    _views: dict[str, set[ChildView]]
    _lock: threading.RLock

    def get(self, key: str, *, family: str | None = None) -> Fetched:
        raise NotImplementedError

    def _sync_gauge(self) -> None:
        raise NotImplementedError

    def open_family(self, family: str) -> None:
        """Start a family (a name can be used once: a closed family cannot be reopened)."""
        if not isinstance(family, str) or not family:
            raise ArtifactInputError(f"family must be a non-empty str, got {family!r}")
        with self._lock:
            if family in self._families:
                state = "open" if self._families[family] else "released"
                raise ArtifactInputError(f"family {family!r} is already {state}")
            self._families[family] = True
            self._views[family] = set()
            self.index.open_family(family)

    def is_open(self, family: str) -> bool:
        return self._families.get(family, False)

    def close_family(self, family: str) -> Released:
        """The family ended: close its children's views (their copies' bytes are freed), drop
        its pins, and delete from both tiers what was declared for it and no open family uses."""
        with self._lock:
            self._check_open(family)
            self._families[family] = False
            views = list(self._views.pop(family, ()))
            ram0, disk0 = self.ram.retained_bytes, self.disk.used_bytes
        for view in views:
            if not view.closed:
                view.close()
        self.ram.release_owner(family)
        self.pins.unpin_family(family)
        retired = [info.segment_id for info in self.index.close_family(family)]
        dropped = self._drop(retired) + self._drop(self._released_keys())
        self._sync_gauge()
        return Released(
            family,
            dropped,
            len(views),
            max(0, ram0 - self.ram.retained_bytes),
            max(0, disk0 - self.disk.used_bytes),
        )

    def advance_round(self, to: int | None = None) -> int:
        """Next round: delete artifacts declared ``keep_rounds`` rounds ago (unless held);
        returns how many were deleted."""
        dropped = self._drop([info.segment_id for info in self.index.advance_round(to)])
        self._sync_gauge()
        return dropped

    def view(self, key: str, *, family: str, child: str) -> ChildView:
        """A copy-on-write view of ``key`` for ``child`` of ``family`` (pins the artifact)."""
        if not isinstance(child, str) or not child:
            raise ArtifactInputError(f"child must be a non-empty str, got {child!r}")
        if not isinstance(family, str):
            raise ArtifactInputError(f"family must be a str, got {family!r}")
        fetched = self.get(key, family=family)
        with self._lock:
            self._check_open(family)
            self.index.acquire(SegmentId(key))
            view = ChildView(
                fetched.artifact,
                family,
                child,
                charge=self._charge,
                discharge=self._discharge,
                source=fetched.source,
            )
            self._views[family].add(view)
        return view

    # -- helpers -------------------------------------------------------------------------------

    def _check_open(self, family: str) -> None:
        state = self._families.get(family)
        if state is None:
            raise UnknownFamilyError(f"family {family!r} was never opened")
        if not state:
            raise DoubleReleaseError(f"family {family!r} was already released")

    def _charge(self, view: ChildView, nbytes: int) -> None:
        """Charge a child's copy to host RAM; family pins give way (oldest first) if needed:
        a child's own state comes before what a family keeps for later."""
        free = self.ram.budget_bytes - self.ram.retained_bytes
        while not self.ram.put(view.copy_key, _Copy(view), nbytes, owner=view.family):
            if not self.pins.unpin_oldest():
                break
        if view.copy_key not in self.ram:
            raise BudgetError(
                f"child {view.child!r}'s copy of {view.key!r} needs {nbytes} bytes: host RAM "
                f"budget {self.ram.budget_bytes} had {free} bytes free, "
                "and no unheld object or family pin to give way"
            )
        self._sync_gauge()

    def _discharge(self, view: ChildView) -> None:
        if view.is_copied:
            self.ram.remove(view.copy_key)
        with self._lock:
            self._views.get(view.family, set()).discard(view)
        retired = [info.segment_id for info in self.index.release(SegmentId(view.key))]
        self._drop(retired + self._released_keys())
        self._sync_gauge()

    def _released_keys(self) -> list[str]:
        """Keys declared for a closed family that no open family uses and nobody holds."""
        with self._lock:
            out = []
            for key, decl in self._decls.items():
                if decl.scope is None or self._families.get(decl.scope, False):
                    continue
                info = self.index.get(SegmentId(key))
                if info is None or not any(self._families.get(f) for f in info.families):
                    out.append(key)
            return out

    def _drop(self, keys: Sequence[str]) -> int:
        dropped = 0
        for key in keys:
            sid = SegmentId(key)
            if sid in self.index and self.index.evict(sid) is None:
                continue  # in use by a child view, or pinned by an open family
            with self._lock:
                self._decls.pop(key, None)
            self.ram.remove(key)
            self.disk.remove(key)
            self.pins.forget(key)
            dropped += 1
        return dropped
