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
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from kmesh_blend.artifacts.disk import DiskTier
from kmesh_blend.artifacts.errors import (
    ArtifactInputError,
    ArtifactLoadError,
    UnknownArtifactError,
)
from kmesh_blend.artifacts.families import FamilyLifecycle, Released, _Copy
from kmesh_blend.artifacts.objects import KINDS, ArtifactKind, ChildView, SharedArtifact
from kmesh_blend.artifacts.pins import PinLedger
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


class ArtifactStore(FamilyLifecycle):
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
        self.index = SegmentIndex(keep_rounds)
        self.metrics = metrics if metrics is not None else SegmentMetrics()
        self.ram: RetentionPool[str, SharedArtifact | _Copy] = RetentionPool(
            ram_bytes, on_evict=self._on_evict
        )
        self.disk = DiskTier(disk_bytes, disk_dir)
        self.pins: PinLedger[str] = PinLedger(self.ram, int(ram_bytes * pin_share))
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

    def prepare(self, family: str, keys: Iterable[str]) -> Prepared:
        """Application notice: load and pin ``keys`` for ``family`` now (through `Notice`)."""
        from kmesh_blend.artifacts.prepare import prepare

        keys = self._check_keys(family, keys)
        return prepare(self, family, keys)

    def prepare_async(self, family: str, keys: Iterable[str]) -> Future[PrepareReport]:
        """`prepare` on one background thread; children arriving meanwhile join its loads."""
        from kmesh_blend.artifacts.prepare import make_notice

        keys = self._check_keys(family, keys)
        with self._lock:
            if self._notice is None:
                self._notice = make_notice(self)
            notice = self._notice
        return notice.prepare_async(family, [SegmentId(k) for k in keys])

    # -- accounting ---------------------------------------------------------------------------

    @property
    def ram_used_bytes(self) -> int:
        return self.ram.retained_bytes

    @property
    def pinned_bytes(self) -> int:
        """Host-RAM bytes of artifacts pinned by open families (at most ``pin_limit``)."""
        return self.pins.pinned_bytes

    @property
    def pin_limit(self) -> int:
        """Most bytes family pins may hold in host RAM (``pin_share`` of the budget)."""
        return self.pins.limit_bytes

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
        if self._notice is not None:
            self._notice.close()
            self._notice = None
        self.disk.close()

    # -- helpers -------------------------------------------------------------------------------

    def _check_keys(self, family: str, keys: Iterable[str]) -> list[str]:
        self._check_open(family)
        out = list(keys)
        for key in out:
            self._require(key)
        return out

    def _require(self, key: str) -> _Decl:
        decl = self._decls.get(key)
        if decl is None:
            raise UnknownArtifactError(
                f"key {key!r} is not declared (or was released with its family)"
            )
        return decl

    def _pin(self, key: str, family: str | None, nbytes: int) -> None:
        """Pin ``key`` (if retained) for ``family`` while pins stay within ``pin_limit``."""
        if family is None:
            return
        self.index.pin(SegmentId(key), family)
        self.pins.pin(key, family, nbytes)

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
