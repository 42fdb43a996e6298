"""A deterministic, synthetic agent-family trace: who asks for which artifact, when.

A *family* is a parent task that fans out into 1–16 children over one or more rounds. Every
child request reads all of its family's *shared ancestors* (documents' embeddings, a retrieval
result, a tool response: of varied size, declared for the family) and ``num_private`` artifacts
drawn from a global *catalog* with Zipf popularity (what unrelated requests may share by content).
Some children change one ancestor (copy-on-write). The application may *announce* a family
``notice_lead_s`` before its first child arrives.

Times: families start with exponential gaps (``family_gap_s``); round ``r`` of a family starts
``r * round_gap_s`` after its start; its children arrive with exponential gaps (``child_gap_s``).
Arrivals are open-loop (fixed by the trace, not by how fast requests complete), so both policies
of a comparison see exactly the same requests at the same times. Same `MixConfig` (seed
included) → the same `Trace`, on any machine.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kmesh_blend.artifacts.errors import ArtifactInputError
from kmesh_blend.artifacts.objects import ArtifactKind

if TYPE_CHECKING:
    from kmesh_blend.artifacts.store import Loader

__all__ = [
    "ArtifactSpec",
    "FamilySpec",
    "MixConfig",
    "RequestSpec",
    "Trace",
    "generate",
    "synthetic_loader",
]

_ANCESTOR_KINDS: tuple[ArtifactKind, ...] = ("embedding", "retrieval", "tool")
_CATALOG_KINDS: tuple[ArtifactKind, ...] = ("tool", "retrieval", "embedding")


@dataclass(frozen=True)
class MixConfig:
    """One trace mix. Sizes are bytes, times seconds."""

    name: str
    num_families: int
    family_size: tuple[int, int] = (2, 16)
    """Children per family (uniform in the range) for families that are not singletons."""
    singleton_share: float = 0.0
    """Share of families with a single child (independent requests)."""
    num_ancestors: tuple[int, int] = (1, 4)
    """Shared ancestors per non-singleton family (singletons have none)."""
    ancestor_bytes: tuple[int, int] = (64 << 10, 1 << 20)
    """Size of one ancestor, log-uniform in the range."""
    num_private: int = 1
    """Catalog artifacts each request reads."""
    catalog_size: int = 400
    catalog_bytes: tuple[int, int] = (16 << 10, 256 << 10)
    zipf_s: float = 1.0
    """Catalog popularity: item ``i`` (0-based) is drawn with weight ``1 / (i + 1) ** zipf_s``."""
    family_gap_s: float = 2.0
    child_gap_s: float = 0.5
    rounds: tuple[int, int] = (1, 3)
    round_gap_s: float = 4.0
    notice_lead_s: float = 1.0
    """How long before its first child the application announces a family (0: never)."""
    copy_share: float = 0.25
    """Share of children (of non-singleton families) that change one ancestor."""
    work_s: float = 1.0
    """Agent work per request once its artifacts are ready."""
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_int(self.num_families, "num_families")
        _range(self.family_size, "family_size", 1, 16)
        _range(self.num_ancestors, "num_ancestors", 0, 64)
        _range(self.ancestor_bytes, "ancestor_bytes", 1, 1 << 34)
        _range(self.catalog_bytes, "catalog_bytes", 1, 1 << 34)
        _range(self.rounds, "rounds", 1, 64)
        _positive_int(self.catalog_size, "catalog_size")
        for name in ("singleton_share", "copy_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ArtifactInputError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("family_gap_s", "child_gap_s", "round_gap_s", "notice_lead_s", "work_s"):
            if not getattr(self, name) >= 0.0:
                raise ArtifactInputError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.num_private < 0 or self.zipf_s < 0:
            raise ArtifactInputError(
                f"num_private and zipf_s must be >= 0, got {self.num_private}, {self.zipf_s}"
            )


class ArtifactSpec(NamedTuple):
    key: str
    kind: ArtifactKind
    nbytes: int
    family: str | None
    """The family it is an ancestor of; None for catalog artifacts."""


class FamilySpec(NamedTuple):
    name: str
    size: int
    rounds: int
    announce_s: float
    """When the application announces it (= first arrival if there is no notice)."""
    first_arrival_s: float
    last_arrival_s: float
    ancestors: tuple[str, ...]
    request_ids: tuple[int, ...]


class RequestSpec(NamedTuple):
    rid: int
    family: str
    child: int
    round: int
    arrival_s: float
    keys: tuple[str, ...]
    """Artifacts read, in order: the family's ancestors, then catalog artifacts."""
    copy_key: str | None
    """The ancestor this child changes (copy-on-write), if any."""
    work_s: float


class Trace(NamedTuple):
    mix: MixConfig
    artifacts: Mapping[str, ArtifactSpec]
    families: tuple[FamilySpec, ...]
    requests: tuple[RequestSpec, ...]
    """Sorted by arrival time; ``requests[i].rid == i``."""

    @property
    def span_s(self) -> float:
        """Time of the last arrival."""
        return max(r.arrival_s for r in self.requests)

    def fingerprint(self) -> int:
        """CRC-32 of every request and artifact (equal traces have equal fingerprints)."""
        crc = zlib.crc32(repr(sorted(self.artifacts.values())).encode())
        return zlib.crc32(repr(self.requests).encode(), crc)


def generate(mix: MixConfig) -> Trace:
    """The trace of ``mix`` (see the module docstring)."""
    rng = np.random.default_rng(mix.seed)
    artifacts: dict[str, ArtifactSpec] = {}
    for i in range(mix.catalog_size):
        key = f"catalog/{i}"
        kind = _CATALOG_KINDS[i % len(_CATALOG_KINDS)]
        artifacts[key] = ArtifactSpec(key, kind, _log_uniform(rng, mix.catalog_bytes), None)
    weights = 1.0 / np.arange(1, mix.catalog_size + 1) ** mix.zipf_s
    weights /= weights.sum()

    pending: list[tuple[float, int, str, int, int, tuple[str, ...], str | None]] = []
    families = []
    start = 0.0
    for f in range(mix.num_families):
        start += float(rng.exponential(mix.family_gap_s)) if f else 0.0
        name = f"fam{f:05d}"
        single = bool(rng.random() < mix.singleton_share)
        size = 1 if single else int(rng.integers(mix.family_size[0], mix.family_size[1] + 1))
        rounds = 1 if single else int(rng.integers(mix.rounds[0], mix.rounds[1] + 1))
        num_anc = 0 if single else int(rng.integers(mix.num_ancestors[0], mix.num_ancestors[1] + 1))
        ancestors = []
        for a in range(num_anc):
            key = f"{name}/ancestor{a}"
            kind = _ANCESTOR_KINDS[a % len(_ANCESTOR_KINDS)]
            artifacts[key] = ArtifactSpec(key, kind, _log_uniform(rng, mix.ancestor_bytes), name)
            ancestors.append(key)
        arrivals = []
        for r in range(rounds):
            t = start + mix.notice_lead_s + r * mix.round_gap_s
            for c in range(size):
                t += float(rng.exponential(mix.child_gap_s)) if c else 0.0
                private = rng.choice(mix.catalog_size, size=mix.num_private, p=weights)
                keys = (*ancestors, *(f"catalog/{int(i)}" for i in private))
                change = ancestors and not single and rng.random() < mix.copy_share
                copy_key = ancestors[int(rng.integers(len(ancestors)))] if change else None
                pending.append((t, f, name, c, r, keys, copy_key))
                arrivals.append(t)
        families.append((name, size, rounds, start, min(arrivals), max(arrivals), ancestors))

    pending.sort(key=lambda p: (p[0], p[1], p[4], p[3]))
    requests = tuple(
        RequestSpec(rid, name, c, r, t, keys, copy_key, mix.work_s)
        for rid, (t, _, name, c, r, keys, copy_key) in enumerate(pending)
    )
    by_family: dict[str, list[int]] = {}
    for req in requests:
        by_family.setdefault(req.family, []).append(req.rid)
    specs = tuple(
        FamilySpec(name, size, rounds, start, first, last, tuple(anc), tuple(by_family[name]))
        for name, size, rounds, start, first, last, anc in families
    )
    return Trace(mix, artifacts, specs, requests)


def synthetic_loader(spec: ArtifactSpec) -> Loader:
    """A loader of ``spec.nbytes`` deterministic bytes (seeded by the key)."""

    def load() -> np.ndarray:
        rng = np.random.default_rng(zlib.crc32(spec.key.encode()))
        return rng.integers(0, 256, spec.nbytes, dtype=np.uint8)

    return load


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    return round(float(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


def _positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArtifactInputError(f"{name} must be an int >= 1, got {value!r}")


def _range(value: object, name: str, lo: int, hi: int) -> None:
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and lo <= value[0] <= value[1] <= hi
    )
    if not ok:
        raise ArtifactInputError(f"{name} must be a pair (lo, hi) with {lo} <= lo <= hi <= {hi}")
