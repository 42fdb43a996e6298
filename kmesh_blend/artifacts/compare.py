"""The fair comparison: one trace, both policies, the same budgets, and the same outputs.

`compare` replays a trace under ordinary LRU caching and under the family-aware policy (same
store, tiers, budgets, loaders, costs and agent slots), checks that every request produced the
same output under both, and pairs the two runs get by get to count *displaced hits*: catalog
gets (artifacts that are nobody's declared ancestor, i.e. what unrelated requests share by
content) that host RAM served under LRU but not under the family-aware policy — hits that
unrelated requests lost because of family retention.

`verdict` says what one comparison shows, by fixed rules (`VERDICT_RULES`), so a mix can come
out as a win, a loss, mixed or no difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from kmesh_blend.artifacts.costs import DEFAULT_COSTS, CostModel
from kmesh_blend.artifacts.replay import ReplayResult, replay
from kmesh_blend.artifacts.trace import Trace

__all__ = [
    "VERDICT_RULES",
    "Comparison",
    "compare",
    "format_table",
    "slots_for_trace",
    "summary",
    "verdict",
]

_HIT = ("ram", "joined")
VERDICT_RULES = (
    "family-aware is better on a measure if it completes more agent work, or is >5% lower on "
    "mean wait, storage reads or origin loads; worse if the reverse. win = better on some and "
    "worse on none; loss = worse on some and better on none; mixed = both; no difference = neither"
)


class Comparison(NamedTuple):
    mix: str
    lru: ReplayResult
    family: ReplayResult
    displaced_hits: int
    """Catalog gets served from host RAM under LRU but not under family-aware."""
    gained_hits: int
    """Gets of any artifact served from host RAM under family-aware but not under LRU."""
    lost_hits: int
    """Gets of any artifact served from host RAM under LRU but not under family-aware."""


def compare(
    trace: Trace,
    *,
    ram_bytes: int,
    disk_bytes: int,
    slots: int = 16,
    costs: CostModel = DEFAULT_COSTS,
) -> Comparison:
    """Replay ``trace`` under both policies; raises `AssertionError` if any output differs."""
    runs = {
        policy: replay(
            trace, policy, ram_bytes=ram_bytes, disk_bytes=disk_bytes, slots=slots, costs=costs
        )
        for policy in ("lru", "family")
    }
    lru, fam = runs["lru"], runs["family"]
    if lru.outputs != fam.outputs:
        bad = [i for i, (a, b) in enumerate(zip(lru.outputs, fam.outputs, strict=True)) if a != b]
        raise AssertionError(f"{len(bad)} request outputs differ between policies, first {bad[:5]}")
    displaced = gained = lost = 0
    for req in trace.requests:
        pairs = zip(lru.access_sources[req.rid], fam.access_sources[req.rid], strict=True)
        for key, (a, b) in zip(req.keys, pairs, strict=True):
            lost_here = a in _HIT and b not in _HIT
            lost += lost_here
            gained += b in _HIT and a not in _HIT
            displaced += lost_here and trace.artifacts[key].family is None
    return Comparison(trace.mix.name, lru, fam, displaced, gained, lost)


def slots_for_trace(
    trace: Trace, costs: CostModel = DEFAULT_COSTS, utilization: float = 0.7
) -> int:
    """Agent slots for a fair, unsaturated comparison, chosen by neither policy: replay the
    trace on unlimited slots with host RAM and disk large enough to keep everything (an oracle:
    every artifact loaded once), and size the slots so that this ideal run's slot time would
    keep ``utilization`` of them busy. Both policies then run with the same slots."""
    total = sum(a.nbytes for a in trace.artifacts.values())
    room = 2 * total + (64 << 20)
    ideal = replay(trace, "lru", ram_bytes=room, disk_bytes=room, slots=1 << 30, costs=costs)
    return max(1, math.ceil(ideal.busy_slot_s / ideal.makespan_s / utilization))


def verdict(c: Comparison) -> str:
    """``"win"``, ``"loss"``, ``"mixed"`` or ``"no difference"`` for the family-aware policy
    (rules: `VERDICT_RULES`)."""
    better = worse = False
    if c.family.completed_work_s != c.lru.completed_work_s:
        better |= c.family.completed_work_s > c.lru.completed_work_s
        worse |= c.family.completed_work_s < c.lru.completed_work_s
    for name in ("wait_mean_s", "storage_reads", "origin_loads"):
        a, b = float(getattr(c.lru, name)), float(getattr(c.family, name))
        better |= b < 0.95 * a
        worse |= b > 1.05 * a and b - a > 1e-9
    if better and worse:
        return "mixed"
    return "win" if better else "loss" if worse else "no difference"


def summary(c: Comparison) -> dict[str, object]:
    """The comparison as plain numbers (for JSON): per policy, then the paired counts."""

    def one(r: ReplayResult) -> dict[str, object]:
        return {
            "completed_work_s": round(r.completed_work_s, 3),
            "completed_requests": r.completed_requests,
            "wait_mean_ms": round(1e3 * r.wait_mean_s, 3),
            "wait_p95_ms": round(1e3 * r.wait_p95_s, 3),
            "storage_reads": r.storage_reads,
            "origin_loads": r.origin_loads,
            "ram_hit_rate": round(r.ram_hit_rate, 4),
            "shared_hit_rate": round(r.shared_hit_rate, 4) if r.shared_accesses else None,
            "ram_mean_mib": round(r.ram_mean_bytes / 2**20, 3),
            "ram_peak_mib": round(r.ram_peak_bytes / 2**20, 3),
            "copy_overflows": r.copy_overflows,
            "sources": dict(r.sources),
        }

    return {
        "requests": c.lru.num_requests,
        "lru": one(c.lru),
        "family": one(c.family),
        "displaced_hits": c.displaced_hits,
        "gained_hits": c.gained_hits,
        "lost_hits": c.lost_hits,
        "verdict": verdict(c),
    }


def format_table(comparisons: Sequence[Comparison]) -> str:
    """Side by side: one row per measure, an ``lru | family`` column pair per mix."""
    rows: list[tuple[str, str, str]] = [
        ("completed agent work (s)", "completed_work_s", "{:.0f}"),
        ("mean wait (ms)", "wait_mean_s", "ms"),
        ("p95 wait (ms)", "wait_p95_s", "ms"),
        ("storage reads (disk)", "storage_reads", "{:d}"),
        ("origin loads", "origin_loads", "{:d}"),
        ("RAM hit rate", "ram_hit_rate", "{:.3f}"),
        ("retained RAM, mean (MiB)", "ram_mean_bytes", "mib"),
        ("retained RAM, peak (MiB)", "ram_peak_bytes", "mib"),
    ]
    width = 28
    head = f"{'':26}" + "".join(f"{c.mix + ' (lru | family)':>{width}}" for c in comparisons)
    lines = [head]
    for label, attr, fmt in rows:
        cells = []
        for c in comparisons:
            pair = [_fmt(getattr(r, attr), fmt) for r in (c.lru, c.family)]
            cells.append(f"{pair[0] + ' | ' + pair[1]:>{width}}")
        lines.append(f"{label:26}" + "".join(cells))
    for label, fn in (
        ("displaced hits", lambda c: str(c.displaced_hits)),
        ("gained | lost hits", lambda c: f"{c.gained_hits} | {c.lost_hits}"),
        ("verdict (family-aware)", verdict),
    ):
        lines.append(f"{label:26}" + "".join(f"{fn(c):>{width}}" for c in comparisons))
    return "\n".join(lines)


def _fmt(value: float, fmt: str) -> str:
    if fmt == "ms":
        return f"{1e3 * value:.1f}"
    if fmt == "mib":
        return f"{value / 2**20:.1f}"
    return fmt.format(value)
