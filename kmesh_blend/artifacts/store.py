"""`ArtifactStore`: family-aware coordination of non-KV artifacts (embeddings, retrieval results,
tool responses) with the segment layer's own parts.

* **Index** — `SegmentIndex` (round-aware, families, pins, in-use counts), one entry per
  declared artifact key.
* **Singleflight** — `SingleFlight`: concurrent gets of a key that is not in host RAM share one
  disk read or one loader call; followers receive the very same immutable object.
* **Host RAM** — `RetentionPool`: byte budget, LRU among objects that are neither pinned nor in
  use. A get made for a family pins the object for the family's lifetime, as long as pinned
  objects stay within ``pin_share`` of the budget (beyond that the object is kept unpinned, so
  family retention can never starve children's copies or unrelated requests of all RAM).
* **Disk** — `DiskTier` (a second `RetentionPool` over files): every loaded payload is written
  through, so an object dropped from host RAM is read back from disk instead of recomputed.
* **Notice** — `Notice` prepares a family's artifacts before its children arrive (`prepare`).
* **Metrics** — `SegmentMetrics` (reads by tier: ``disk`` and ``origin`` = loader calls).

A get is served from host RAM, else by joining an in-flight load, else from disk, else by calling
the artifact's loader. Children change artifacts only through copy-on-write `ChildView`\\ s. When a
family closes, its children's copies are freed and the artifacts declared for it (and used by no
open family) are deleted from both tiers. Without family information the store is a plain
two-tier LRU cache; that is the baseline `kmesh_blend.artifacts.replay` compares against.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from kmesh_blend.artifacts.disk import DiskTier
from kmesh_blend.artifacts.errors import (
    ArtifactInputError,
    ArtifactLoadError,
    BudgetError,
    DoubleReleaseError,
    UnknownArtifactError,
    UnknownFamilyError,
)
from kmesh_blend.artifacts.objects import KINDS, ArtifactKind, ChildView, SharedArtifact
from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.index import SegmentIndex, SegmentState
from kmesh_blend.segments.metrics import SegmentMetrics
from kmesh_blend.segments.notice import PrepareReport
from kmesh_blend.segments.retention import RetentionPool
from kmesh_blend.segments.singleflight import SingleFlight

if TYPE_CHECKING:
    from kmesh_blend.segments.notice import Notice

__all__ = ["ArtifactStore", "Fetched", "Loader", "Prepared", "Released", "Source"]

Loader = Callable[[], object]
"""Returns the artifact's payload: bytes, a numpy array or a tuple of arrays."""
Source = Literal["ram", "joined", "disk", "loaded"]


class Fetched(NamedTuple):
    artifact: SharedArtifact
    source: Source
    """``ram`` (retained), ``joined`` (another caller's in-flight load), ``disk``, ``loaded``."""
    reads: int
    """Disk-tier reads this call performed itself (0 or 1)."""
    loads: int
    """Loader calls (origin loads) this call performed itself (0 or 1)."""


class Released(NamedTuple):
    family: str
    num_dropped: int
    """Artifacts deleted from both tiers because only this family used them."""
    num_views: int
    """Child views the close had to close."""
    freed_ram_bytes: int
    freed_disk_bytes: int


class Prepared(NamedTuple):
    report: PrepareReport
    fetched: tuple[Fetched | None, ...]
    """Per key, how the preparation got it (None: the load failed)."""


@dataclass
class _Decl:
    loader: Loader
    kind: ArtifactKind
    scope: str | None
    """The family the artifact is released with (None: lives until evicted)."""


class _Copy(NamedTuple):
    """A child's private copy, as held in the host-RAM pool (accounting only)."""

    view: ChildView


class ArtifactStore:
    """Host-RAM + disk artifact store with a byte budget per tier. Thread-safe."""

    def __init__(
        self,
        ram_bytes: int,
        disk_bytes: int = 0,
        *,
        disk_dir: str | Path | None = None,
        keep_rounds: int = 2,
        pin_share: float = 0.75,
        timeout_s: float = 30.0,
        metrics: SegmentMetrics | None = None,
    ) -> None:
        if isinstance(ram_bytes, bool) or not isinstance(ram_bytes, int) or ram_bytes < 0:
            raise ArtifactInputError(f"ram_bytes must be an int >= 0, got {ram_bytes!r}")
        if not 0.0 <= pin_share <= 1.0:
            raise ArtifactInputError(f"pin_share must be in [0, 1], got {pin_share!r}")
        self.pin_limit = int(ram_bytes * pin_share)
        """Most bytes family pins may hold in host RAM."""
        self._pins: dict[str, tuple[set[str], int]] = {}  # key -> (families, nbytes)
        self._pinned_bytes = 0
        self.index = SegmentIndex(keep_rounds)
        self.metrics = metrics if metrics is not None else SegmentMetrics()
        self.ram: RetentionPool[str, SharedArtifact | _Copy] = RetentionPool(
            ram_bytes, on_evict=self._on_evict
        )
        self.disk = DiskTier(disk_bytes, disk_dir)
        self._flight: SingleFlight[str, tuple[SharedArtifact, Source]] = SingleFlight(
            timeout_s=timeout_s, max_attempts=1
        )
        self._decls: dict[str, _Decl] = {}
        self._families: dict[str, bool] = {}  # name -> open
        self._views: dict[str, set[ChildView]] = {}
        self._lock = threading.RLock()
        self._notice: Notice | None = None  # made by the first prepare_async

    # -- declaring ----------------------------------------------------------------------------

    def declare(
        self,
        key: str,
        loader: Loader,
        *,
        kind: ArtifactKind = "blob",
        family: str | None = None,
        round: int | None = None,
    ) -> None:
        """Say how to load ``key``. With ``family``, the artifact is released with that family;
        with ``round``, it retires ``keep_rounds`` rounds later. Declaring a key again keeps the
        first loader and scope and adds the family."""
        if not isinstance(key, str) or not key or "#copy:" in key:
            raise ArtifactInputError(f"key must be a non-empty str without '#copy:', got {key!r}")
        if not callable(loader):
            raise ArtifactInputError(f"loader of {key!r} must be callable, got {loader!r}")
        if kind not in KINDS:
            raise ArtifactInputError(f"kind of {key!r} must be one of {KINDS}, got {kind!r}")
        if round is not None and (isinstance(round, bool) or not isinstance(round, int)):
            raise ArtifactInputError(f"round of {key!r} must be an int >= 0, got {round!r}")
        with self._lock:
            if family is not None:
                self._check_open(family)
            self._decls.setdefault(key, _Decl(loader, kind, family))
            try:
                self.index.publish(SegmentId(key), 1, round=round, family=family)
            except ValueError as exc:
                raise ArtifactInputError(f"round of {key!r}: {exc}") from None

    def is_declared(self, key: str) -> bool:
        return key in self._decls

    # -- families -----------------------------------------------------------------------------

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
        self._unpin_family(family)
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

    # -- reading ------------------------------------------------------------------------------

    def get(self, key: str, *, family: str | None = None) -> Fetched:
        """The shared artifact ``key`` (see the module docstring for the order of tiers).

        With ``family`` the object is pinned in host RAM until the family closes. Raises
        `UnknownArtifactError`, `UnknownFamilyError`, `DoubleReleaseError` (closed family),
        `ArtifactLoadError` (the loader failed; ``__cause__`` is its exception).
        """
        decl = self._require(key)
        if family is not None:
            self._check_open(family)
        value = self.ram.get(key)
        if isinstance(value, SharedArtifact):
            self.metrics.hit()
            self._pin(key, family, value.nbytes)
            return Fetched(value, "ram", 0, 0)
        try:
            out = self._flight.do(key, lambda: self._load(key, decl, family))
        except ArtifactLoadError:
            raise
        except Exception as exc:  # a follower whose leader failed, or timed out
            raise ArtifactLoadError(f"load of {key!r} failed: {exc}") from exc
        artifact, source = out.value
        if not out.leader:
            self.metrics.join()
            self._pin(key, family, artifact.nbytes)
            return Fetched(artifact, "joined", 0, 0)
        return Fetched(artifact, source, int(source == "disk"), int(source == "loaded"))

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

    def prepare(self, family: str, keys: Iterable[str]) -> Prepared:
        """Application notice: load and pin ``keys`` for ``family`` now (through `Notice`)."""
        from kmesh_blend.artifacts.prepare import prepare

        return prepare(self, family, list(keys))

    def prepare_async(self, family: str, keys: Iterable[str]) -> Future[PrepareReport]:
        """`prepare` on one background thread; children arriving meanwhile join its loads."""
        from kmesh_blend.artifacts.prepare import prepare_async

        return prepare_async(self, family, list(keys))

    # -- accounting ---------------------------------------------------------------------------

    @property
    def ram_used_bytes(self) -> int:
        return self.ram.retained_bytes

    @property
    def pinned_bytes(self) -> int:
        """Host-RAM bytes of artifacts pinned by open families (at most ``pin_limit``)."""
        return self._pinned_bytes

    @property
    def disk_used_bytes(self) -> int:
        return self.disk.used_bytes

    def stats(self) -> dict[str, object]:
        """Metrics (reads by tier, hits, joins, evictions) plus RAM, disk and singleflight."""
        out: dict[str, object] = dict(self.metrics.as_dict())
        out["ram"] = self.ram.stats()
        out["disk"] = self.disk.stats()
        out["singleflight"] = self._flight.stats()
        return out

    def close(self) -> None:
        """Stop the notice thread and delete the disk tier's files."""
        from kmesh_blend.artifacts.prepare import shutdown

        shutdown(self)
        self.disk.close()

    # -- helpers -------------------------------------------------------------------------------

    def _require(self, key: str) -> _Decl:
        decl = self._decls.get(key)
        if decl is None:
            raise UnknownArtifactError(
                f"key {key!r} is not declared (or was released with its family)"
            )
        return decl

    def _check_open(self, family: str) -> None:
        state = self._families.get(family)
        if state is None:
            raise UnknownFamilyError(f"family {family!r} was never opened")
        if not state:
            raise DoubleReleaseError(f"family {family!r} was already released")

    def _pin(self, key: str, family: str | None, nbytes: int) -> None:
        """Pin ``key`` (if retained) for ``family`` while pins stay within ``pin_limit``."""
        if family is None:
            return
        self.index.pin(SegmentId(key), family)
        with self._lock:
            held = self._pins.get(key)
            if held is not None:
                if self.ram.pin(key, family):
                    held[0].add(family)
                return
            if self._pinned_bytes + nbytes <= self.pin_limit and self.ram.pin(key, family):
                self._pins[key] = ({family}, nbytes)
                self._pinned_bytes += nbytes

    def _unpin_oldest(self) -> bool:
        with self._lock:
            if not self._pins:
                return False
            key = next(iter(self._pins))
            families, size = self._pins.pop(key)
            self._pinned_bytes -= size
        for family in families:
            self.ram.unpin(key, family)
        return True

    def _unpin_family(self, family: str) -> None:
        with self._lock:
            for key, (families, size) in list(self._pins.items()):
                families.discard(family)
                if not families:
                    del self._pins[key]
                    self._pinned_bytes -= size

    def _load(self, key: str, decl: _Decl, family: str | None) -> tuple[SharedArtifact, Source]:
        self._set_state(key, SegmentState.LOADING)
        payload: object = self.disk.get(key)
        source: Source = "disk"
        try:
            if payload is None:
                source = "loaded"
                payload = decl.loader()
        except Exception as exc:
            self._set_state(key, SegmentState.COLD)
            raise ArtifactLoadError(f"loader of {key!r} ({decl.kind}) failed: {exc}") from exc
        finally:
            self.metrics.read("disk" if source == "disk" else "origin")
        artifact = SharedArtifact.of(key, decl.kind, payload)
        if source == "loaded":
            self.disk.put(key, artifact.payload)
        retained = self.ram.put(key, artifact, artifact.nbytes)
        if retained:
            self._pin(key, family, artifact.nbytes)
        elif family is not None:
            self.index.pin(SegmentId(key), family)
        self._set_state(key, SegmentState.READY if retained else SegmentState.COLD)
        self._sync_gauge()
        return artifact, source

    def _charge(self, view: ChildView, nbytes: int) -> None:
        """Charge a child's copy to host RAM; family pins give way (oldest first) if needed:
        a child's own state comes before what a family keeps for later."""
        while not self.ram.put(view.copy_key, _Copy(view), nbytes, owner=view.family):
            if not self._unpin_oldest():
                break
        if view.copy_key not in self.ram:
            raise BudgetError(
                f"child {view.child!r}'s copy of {view.key!r} needs {nbytes} bytes: host RAM "
                f"budget {self.ram.budget_bytes} has {self.ram.budget_bytes - self.ram_used_bytes}"
                " free and no unheld object to evict"
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
            with self._lock:
                pin = self._pins.pop(key, None)
                self._pinned_bytes -= pin[1] if pin is not None else 0
            dropped += 1
        return dropped

    def _on_evict(self, key: str, nbytes: int) -> None:
        self.metrics.eviction()
        self._set_state(key, SegmentState.COLD)

    def _set_state(self, key: str, state: SegmentState) -> None:
        sid = SegmentId(key)
        if sid in self.index:
            # retired meanwhile, or a concurrent transition: the index is advisory here
            with contextlib.suppress(KeyError, ValueError):
                self.index.set_state(sid, state)

    def _sync_gauge(self) -> None:
        self.metrics.set_retained_bytes(self.ram.retained_bytes)
