"""Capacity projection for family-aware artifact retention — a PROJECTION (a model), not a
measurement.

What it projects: the host-RAM *working set* of the family-aware policy — the shared ancestors
of every open family (pinned while the family is open), the children's copy-on-write copies and
the resident vector indexes — against the RAM and disk budgets: whether and how much it spills,
and which share of the children's ancestor gets host RAM still serves.

The model (Little's law, compound Poisson): families arrive at rate λ and stay open for ``L``
seconds holding ``A`` bytes of ancestors, so the pinned bytes ``W`` have mean ``λ·E[A·L]`` and
variance ``λ·E[A²·L]``; ``W`` is taken as normal. Spill is ``E[(W − R)⁺]`` for the RAM left to
families ``R`` (the store's pin cap, at most budget − indexes − mean copies); the RAM hit
share of ancestor gets is ``(1 − cold) · E[min(W, R)] / E[W]``, where ``cold`` is the share of
gets that are a family's first, unannounced get of an ancestor (a load whatever the budget).
The disk tier (written through) serves what RAM does not while the disk budget holds the
families' ancestors plus the catalog's working set.

`FamilyStats.from_trace` takes the statistics from a trace's *schedule* (arrivals, sizes, work,
loader costs) without replaying it, so the projection can be checked against the harness
(`kmesh_blend.artifacts.replay`) on sizes that fit here, then used on sizes that do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from kmesh_blend.artifacts.costs import DEFAULT_COSTS, CostModel
from kmesh_blend.artifacts.errors import ArtifactInputError
from kmesh_blend.artifacts.trace import Trace

__all__ = ["LABEL", "CapacityInputs", "FamilyStats", "Projection", "project", "ram_for_hit_rate"]

LABEL = "PROJECTION (model, not a measurement)"


@dataclass(frozen=True)
class FamilyStats:
    """Family statistics: measured from a trace, or assumed for a deployment."""

    family_rate_per_s: float
    """λ: families started per second."""
    mean_bytes_lifetime: float
    """E[A·L]: ancestor bytes × open time (byte-seconds per family)."""
    mean_bytes_sq_lifetime: float
    """E[A²·L] (byte²-seconds per family), for the variance."""
    mean_family_bytes: float
    """E[A]: ancestor bytes per family."""
    request_rate_per_s: float
    copy_share: float
    """Share of requests holding one copy-on-write copy while they work."""
    mean_copy_bytes: float
    mean_copy_s: float
    """How long a copy lives (about a request's work time)."""
    cold_share: float
    """Share of ancestor gets that are a family's first get of it without notice."""

    @classmethod
    def from_trace(cls, trace: Trace, costs: CostModel = DEFAULT_COSTS) -> FamilyStats:
        """Statistics of ``trace``'s schedule: a family is open from its announcement until its
        last arrival or its slowest ancestor load (whichever is later) plus one request's work
        (queueing and waiting for other artifacts are not modelled)."""
        window = trace.span_s + trace.mix.work_s
        al = a2l = a_sum = 0.0
        cold = gets = 0
        for fam in trace.families:
            sizes = [trace.artifacts[k].nbytes for k in fam.ancestors]
            # loads run concurrently from the announcement; the last child cannot finish before
            # both its arrival and the slowest load, plus its work
            load = max(
                (
                    costs.origin_s(trace.artifacts[k].kind, n)
                    for k, n in zip(fam.ancestors, sizes, strict=True)
                ),
                default=0.0,
            )
            life = (
                max(fam.last_arrival_s, fam.announce_s + load) - fam.announce_s + trace.mix.work_s
            )
            a = float(sum(sizes))
            al += a * life
            a2l += a * a * life
            a_sum += a
            gets += len(fam.ancestors) * len(fam.request_ids)
            if fam.announce_s >= fam.first_arrival_s:
                cold += len(fam.ancestors)
        copies = [trace.artifacts[r.copy_key].nbytes for r in trace.requests if r.copy_key]
        n = len(trace.families)
        return cls(
            family_rate_per_s=n / window,
            mean_bytes_lifetime=al / n,
            mean_bytes_sq_lifetime=a2l / n,
            mean_family_bytes=a_sum / n,
            request_rate_per_s=len(trace.requests) / window,
            copy_share=len(copies) / len(trace.requests),
            mean_copy_bytes=sum(copies) / len(copies) if copies else 0.0,
            mean_copy_s=trace.mix.work_s,
            cold_share=cold / gets if gets else 0.0,
        )


@dataclass(frozen=True)
class CapacityInputs:
    stats: FamilyStats
    ram_bytes: int
    disk_bytes: int
    index_bytes: int = 0
    """Resident vector indexes (a flat faiss index: vectors × dim × 4 bytes)."""
    catalog_bytes: float = 0.0
    """Bytes of unpinned artifacts the disk tier should also hold (the catalog's working set)."""
    pin_share: float = 0.75
    """The store's cap on family pins, as a share of the RAM budget (`ArtifactStore`)."""

    def __post_init__(self) -> None:
        for name in ("ram_bytes", "disk_bytes", "index_bytes", "catalog_bytes"):
            if not getattr(self, name) >= 0:
                raise ArtifactInputError(f"{name} must be >= 0, got {getattr(self, name)!r}")


class Projection(NamedTuple):
    label: str
    open_families: float
    """Mean number of open families (λ·E[L])."""
    working_set_bytes: float
    """Mean pinned ancestors + copies + indexes."""
    working_set_p95_bytes: float
    ram_for_families_bytes: float
    spill_probability: float
    """P[ancestors of open families exceed the RAM left to them]."""
    spill_bytes: float
    """E[bytes of open families' ancestors that host RAM cannot hold]."""
    ram_hit_rate: float
    """Share of the children's ancestor gets served from host RAM."""
    disk_holds_spill: bool
    ram_or_disk_hit_rate: float

    def format(self) -> str:
        mib = 1 / 2**20
        return (
            f"{self.label}: working set {self.working_set_bytes * mib:.1f} MiB "
            f"(p95 {self.working_set_p95_bytes * mib:.1f} MiB, {self.open_families:.1f} open "
            f"families) vs {self.ram_for_families_bytes * mib:.1f} MiB of RAM for families; "
            f"spills with p={self.spill_probability:.2f} (mean {self.spill_bytes * mib:.1f} MiB); "
            f"ancestor gets from RAM {self.ram_hit_rate:.3f}, RAM or disk "
            f"{self.ram_or_disk_hit_rate:.3f}"
        )


def project(inputs: CapacityInputs) -> Projection:
    """The projection for ``inputs`` (see the module docstring)."""
    s = inputs.stats
    pinned_mean = s.family_rate_per_s * s.mean_bytes_lifetime
    pinned_sd = math.sqrt(max(0.0, s.family_rate_per_s * s.mean_bytes_sq_lifetime))
    copies = s.request_rate_per_s * s.copy_share * s.mean_copy_bytes * s.mean_copy_s
    left = inputs.ram_bytes - inputs.index_bytes - copies
    room = max(0.0, min(inputs.pin_share * inputs.ram_bytes, left))
    over, p_spill = _excess(pinned_mean, pinned_sd, room)
    kept = (pinned_mean - over) / pinned_mean if pinned_mean > 0 else 1.0
    warm = 1.0 - s.cold_share
    disk_need = pinned_mean + inputs.catalog_bytes
    disk_ok = inputs.disk_bytes >= disk_need
    disk_share = 1.0 if disk_ok else min(1.0, inputs.disk_bytes / disk_need)
    open_families = (
        s.family_rate_per_s * s.mean_bytes_lifetime / s.mean_family_bytes
        if s.mean_family_bytes
        else 0.0
    )
    return Projection(
        label=LABEL,
        open_families=open_families,
        working_set_bytes=pinned_mean + copies + inputs.index_bytes,
        working_set_p95_bytes=pinned_mean + 1.645 * pinned_sd + copies + inputs.index_bytes,
        ram_for_families_bytes=room,
        spill_probability=p_spill,
        spill_bytes=over,
        ram_hit_rate=warm * kept,
        disk_holds_spill=disk_ok,
        ram_or_disk_hit_rate=warm * (kept + (1.0 - kept) * disk_share),
    )


def ram_for_hit_rate(inputs: CapacityInputs, target: float) -> int:
    """Smallest host-RAM budget whose projected ancestor hit rate reaches ``target`` (bytes);
    raises `ArtifactInputError` if no budget can (the cold share caps the rate)."""
    best = project(CapacityInputs(inputs.stats, 1 << 62, inputs.disk_bytes, inputs.index_bytes))
    if not 0 < target <= best.ram_hit_rate:
        raise ArtifactInputError(
            f"target must be in (0, {best.ram_hit_rate:.4f}] (cold gets cap it), got {target!r}"
        )
    lo, hi = 0, 1 << 62
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        trial = CapacityInputs(inputs.stats, mid, inputs.disk_bytes, inputs.index_bytes)
        lo, hi = (lo, mid) if project(trial).ram_hit_rate >= target else (mid, hi)
    return hi


def _excess(mean: float, sd: float, room: float) -> tuple[float, float]:
    """``E[(W - room)+]`` and ``P[W > room]`` for ``W ~ Normal(mean, sd)``."""
    if sd <= 0:
        return max(0.0, mean - room), float(mean > room)
    z = (room - mean) / sd
    pdf = math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    tail = 0.5 * math.erfc(z / math.sqrt(2))
    return sd * (pdf - z * tail), tail
