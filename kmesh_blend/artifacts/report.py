"""`ReplayResult`: what one policy did on one trace, as measured by the replay harness."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ReplayResult"]


@dataclass(frozen=True)
class ReplayResult:
    """What one policy did on one trace (accesses are the children's gets, in trace order)."""

    policy: str
    mix: str
    num_requests: int
    completed_requests: int
    """Requests finished by ``horizon_s`` = last arrival + ``work_s``."""
    completed_work_s: float
    horizon_s: float
    makespan_s: float
    wait_mean_s: float
    """Arrival to start of agent work: queueing for a slot plus waiting for artifacts."""
    wait_p95_s: float
    sources: Mapping[str, int]
    """Children's gets by how they were served: ram, joined, disk, loaded."""
    shared_accesses: int
    shared_ram: int
    """Gets of family ancestors served from host RAM (ram or joined)."""
    catalog_accesses: int
    catalog_ram: int
    storage_reads: int
    """Disk-tier reads, all of them (children, preparation, copies)."""
    origin_loads: int
    """Loader calls, all of them."""
    ram_mean_bytes: float
    """Host RAM retained, time-averaged over the makespan."""
    ram_peak_bytes: int
    family_ws_mean_bytes: float
    """Ancestors of open families resident in host RAM plus children's copies, time-averaged."""
    family_ws_peak_bytes: int
    ram_budget: int
    disk_budget: int
    copy_overflows: int
    busy_slot_s: float
    """Sum over requests of the time they held an agent slot (waiting included)."""
    """Children's copies that did not fit in host RAM at all (made outside the budget)."""
    access_sources: tuple[tuple[str, ...], ...] = field(repr=False)
    """Per request, how each of its gets was served (pairs the two policies' runs)."""
    outputs: tuple[int, ...] = field(repr=False)
    """Per request, a CRC of every payload it read and of its copy after its change."""

    @property
    def shared_hit_rate(self) -> float:
        return self.shared_ram / self.shared_accesses if self.shared_accesses else math.nan

    @property
    def ram_hit_rate(self) -> float:
        total = sum(self.sources.values())
        return (self.sources["ram"] + self.sources["joined"]) / total if total else math.nan
