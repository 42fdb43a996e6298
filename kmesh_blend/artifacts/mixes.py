"""The standard trace mixes of the comparison, with the budgets and agent slots each runs with.

* ``fanout`` — agent families of 4–16 children over 1–3 rounds reading 2–4 shared ancestors
  (128 KiB–2 MiB), announced 1 s ahead; families overlap, so host RAM is contended.
* ``mixed`` — 60 % independent requests, the rest families of 2–16; two catalog reads each.
* ``independent`` — single requests, no ancestors, no notice, three catalog reads each (Zipf):
  family knowledge has nothing to act on, so it should not help.
* ``tight`` — ``fanout`` with a host-RAM budget below the families' working set and a small
  disk tier: family pins now compete with everything else.

``scale`` multiplies the number of families (the benchmark's ``--quick`` uses a smaller one);
sizes, budgets and rates do not change with it. Agent slots are sized by one rule for every mix
(`slots_for`): the offered agent work fills ``UTILIZATION`` of them when nothing waits, so waiting
for artifacts shows up as queueing and, near the end of the trace, as work not completed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from kmesh_blend.artifacts.trace import MixConfig

__all__ = ["MIX_NAMES", "UTILIZATION", "MixSetup", "slots_for", "standard_mixes"]

MIX_NAMES: tuple[str, ...] = ("fanout", "mixed", "independent", "tight")
UTILIZATION = 0.7
_MiB = 1 << 20


class MixSetup(NamedTuple):
    mix: MixConfig
    ram_bytes: int
    disk_bytes: int
    slots: int


def standard_mixes(scale: float = 1.0, *, seed: int = 0) -> dict[str, MixSetup]:
    """The four mixes, by name, with ``round(base * scale)`` families each (at least 4)."""

    def n(base: int) -> int:
        return max(4, round(base * scale))

    fanout = MixConfig(
        "fanout",
        num_families=n(120),
        family_size=(4, 16),
        num_ancestors=(2, 4),
        ancestor_bytes=(128 << 10, 2 * _MiB),
        family_gap_s=3.0,
        child_gap_s=0.5,
        rounds=(1, 3),
        round_gap_s=5.0,
        notice_lead_s=1.0,
        seed=seed,
    )
    mixed = MixConfig(
        "mixed",
        num_families=n(400),
        family_size=(2, 16),
        singleton_share=0.6,
        num_ancestors=(1, 3),
        ancestor_bytes=(64 << 10, 1 * _MiB),
        num_private=2,
        family_gap_s=0.8,
        notice_lead_s=0.5,
        seed=seed + 1,
    )
    independent = MixConfig(
        "independent",
        num_families=n(1500),
        singleton_share=1.0,
        num_private=3,
        catalog_size=600,
        catalog_bytes=(16 << 10, 512 << 10),
        zipf_s=0.9,
        family_gap_s=0.25,
        notice_lead_s=0.0,
        seed=seed + 2,
    )
    tight = replace(fanout, name="tight", seed=seed + 3)
    return {
        "fanout": MixSetup(fanout, 24 * _MiB, 256 * _MiB, slots_for(fanout)),
        "mixed": MixSetup(mixed, 16 * _MiB, 256 * _MiB, slots_for(mixed)),
        "independent": MixSetup(independent, 16 * _MiB, 64 * _MiB, slots_for(independent)),
        "tight": MixSetup(tight, 6 * _MiB, 32 * _MiB, slots_for(tight)),
    }


def slots_for(mix: MixConfig, utilization: float = UTILIZATION) -> int:
    """Agent slots such that the mix's expected agent work keeps ``utilization`` of them busy
    (requests per second × ``work_s`` / ``utilization``, rounded up)."""
    size = (mix.family_size[0] + mix.family_size[1]) / 2
    rounds = (mix.rounds[0] + mix.rounds[1]) / 2
    per_family = mix.singleton_share + (1 - mix.singleton_share) * size * rounds
    rate = per_family / mix.family_gap_s if mix.family_gap_s > 0 else float(mix.num_families)
    return max(1, math.ceil(rate * mix.work_s / utilization))
