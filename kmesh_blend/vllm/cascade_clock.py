"""What each recent cascade step cost, in parts: measured on the hot path for a few clock reads.

`kmesh_blend.vllm.cascade_decode` opens a `StepParts` when a step's plan is built and adds to
it per layer; the last `KEEP` steps stay (a bounded deque: a server runs for weeks). The load
benchmark (`bench/cascade_load.py`) reads them to split a step into its parts. Plain Python.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

__all__ = ["KEEP", "StepClock", "StepParts"]

KEEP = 4096  # steps kept


@dataclass
class StepParts:
    """One step that ran the cascade path: ``cascade`` requests decoding in cascade, ``others``
    query rows of the step's other requests (vLLM's kernel); seconds, summed over layers:
    ``plan_s`` matching requests to plans, placing own rows and composing the set's levels (once
    per step), of it ``arm_s`` arming the step's new readers (verifying their rows against the
    masters, tiling a new master, giving blocks back, placing its own rows in its slot: once
    per request); ``cascade_s`` the
    cascade kernel (or its torch fallback); ``others_s`` vLLM's kernel on the other rows and
    their copy into the output."""

    serial: int
    cascade: int
    others: int
    plan_s: float = 0.0
    arm_s: float = 0.0
    context_rows: int = 0  # the cascade requests' context rows, summed (what vLLM would read)
    cascade_s: float = 0.0
    others_s: float = 0.0
    opened: float = 0.0  # clock reading when the step's plan began
    period_s: float = 0.0  # from then to the end of the step's forward (0: not ended yet)
    lone: bool = False  # no master had two readers in it (nothing shared: `cascade_timing.Lone`)


class StepClock:
    """The parts of the last `KEEP` cascade steps; ``serial`` counts every step ever opened."""

    def __init__(self, keep: int = KEEP) -> None:
        self.steps: deque[StepParts] = deque(maxlen=keep)
        self.serial = 0

    now = staticmethod(time.perf_counter)

    def open(self, cascade: int, others: int, plan_s: float, arm_s: float = 0.0,
             context_rows: int = 0, lone: bool = False) -> StepParts:  # fmt: skip
        self.serial += 1
        parts = StepParts(self.serial, cascade, others, plan_s, arm_s, context_rows,
                          opened=self.now() - plan_s, lone=lone)  # fmt: skip
        self.steps.append(parts)
        return parts

    def since(self, serial: int) -> list[StepParts]:
        """The kept steps opened after step ``serial``."""
        return [s for s in self.steps if s.serial > serial]
