"""What the start-up probe measured (`kmesh_blend.vllm.cascade_probe`), and the sign test that
says when a difference is beyond this machine's noise; what the guard weighs of each cascade step
(`Parts`, `Weighed`) over a `Window`, steps where no master had two readers apart (`Lone`), and
when it weighs a path it switched off again (`Backoff`). Read by `kmesh_blend.vllm.speed_guard`.
Plain Python: no vLLM import.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

__all__ = [
    "EVIDENCE",
    "RETRY",
    "RETRY_MAX",
    "SIGN_LEVEL",
    "WINDOW",
    "Backoff",
    "Lone",
    "Parts",
    "Timing",
    "Weighed",
    "Window",
    "sign_needed",
]

SIGN_LEVEL = 0.05  # a "slower" must be this unlikely under "the same" (sign test)
WINDOW = 64  # cascade steps weighed together
EVIDENCE = 16  # cascade steps before the first weighing
RETRY = 256  # engine steps off under load before the path is weighed again (doubling per try)
RETRY_MAX = 8192


def sign_needed(runs: int, level: float = SIGN_LEVEL) -> int:
    """Of ``runs`` paired runs, how many the cascade path must lose for "slower" to stand: the
    fewest k with P(X ≥ k) ≤ ``level`` for X ~ Binomial(runs, ½) (either path equally likely to
    lose a run when the two are the same speed); ``runs + 1`` when no k is that unlikely."""
    tail = 0.0
    for k in range(runs, -1, -1):
        tail += math.comb(runs, k) / 2**runs
        if tail > level:
            return k + 1
    return 0


@dataclass(frozen=True)
class Timing:
    """One attention layer, seconds (the fastest of a few runs): ``family`` readers, each with
    ``context`` rows of which ``rows`` from one master, on the cascade path (``family_s``) and on
    vLLM's kernel (``family_stock_s``); one of them alone likewise (``alone_s``,
    ``alone_stock_s``). ``runs`` paired runs (each path once, in turn) gave them; of those, the
    cascade path took longer in ``family_lost`` and ``alone_lost`` (0 runs: the times alone
    decide)."""

    family: int
    rows: int
    context: int
    family_s: float
    family_stock_s: float
    alone_s: float
    alone_stock_s: float
    runs: int = 0
    family_lost: int = 0
    alone_lost: int = 0
    arm_s: float = 0.0  # arming one of the family's readers (verify, place its rows), per layer

    @property
    def break_even(self) -> float | None:
        """Decode steps in which a reader of the family repays its arming (``inf``: the family
        gains nothing per step; None: arming not timed)."""
        if self.arm_s <= 0:
            return None
        gain = (self.family_stock_s - self.family_s) / self.family  # per reader, step, layer
        return self.arm_s / gain if gain > 0 else math.inf

    @property
    def family_ratio(self) -> float:
        return self.family_s / self.family_stock_s

    @property
    def alone_ratio(self) -> float:
        return self.alone_s / self.alone_stock_s

    @property
    def family_slower(self) -> bool:
        """The family is slower on the cascade path, beyond this machine's noise: its fastest
        run is, and it lost enough of the paired runs (`sign_needed`) — where the two kernels
        are about equal, the fastest runs alone flip between engines."""
        return self.family_ratio > 1.0 and self._sure(self.family_lost)

    @property
    def alone_slower(self) -> bool:
        """A reader alone is slower on the cascade path (the same test)."""
        return self.alone_ratio > 1.0 and self._sure(self.alone_lost)

    @property
    def alone_faster(self) -> bool:
        """A reader alone is faster on the cascade path, beyond this machine's noise (the same
        test, the other way: its fastest run faster, enough of the paired runs won)."""
        return self.alone_ratio < 1.0 and self._sure(self.runs - self.alone_lost)

    def _sure(self, lost: int) -> bool:
        return self.runs == 0 or lost >= sign_needed(self.runs)

    @property
    def stock_row_s(self) -> float:
        """vLLM's kernel, seconds per context row of a decoding request, per layer."""
        return self.family_stock_s / (self.family * self.context)

    def describe(self) -> str:
        return (
            f"{self.family} readers of a {self.rows}-row master: {self.family_s * 1e3:.3f} ms "
            f"vs vLLM's kernel {self.family_stock_s * 1e3:.3f} ms ({self.family_ratio:.2f}x); "
            f"one alone {self.alone_s * 1e3:.3f} ms vs {self.alone_stock_s * 1e3:.3f} ms "
            f"({self.alone_ratio:.2f}x), per layer{self._lost()}{self._arming()}"
        )

    @property
    def repaid(self) -> str | None:
        """`break_even` in words (None: arming not timed)."""
        if (steps := self.break_even) is None:
            return None
        return "never repaid" if math.isinf(steps) else f"repaid after {steps:.0f} decode steps"

    def _arming(self) -> str:
        if (repaid := self.repaid) is None:
            return ""
        return f"; arming a reader {self.arm_s * 1e3:.3f} ms per layer, {repaid}"

    def _lost(self) -> str:
        if self.runs == 0:
            return ""
        return (f"; cascade slower in {self.family_lost} and {self.alone_lost} of {self.runs} "
                f"paired runs (slower needs {sign_needed(self.runs)})")  # fmt: skip


class Parts(Protocol):
    """What `observe` reads of a step (`kmesh_blend.vllm.cascade_clock.StepParts`)."""

    plan_s: float
    arm_s: float
    cascade_s: float
    context_rows: int
    period_s: float
    lone: bool


class Weighed(NamedTuple):
    """One weighed cascade step, seconds: ``cost`` the path (planning and kernel, no arming),
    ``estimate`` vLLM's kernel on the same requests, ``arm`` arming its new readers, ``period``
    the step's wall time (0: unknown)."""

    cost: float
    estimate: float
    arm: float = 0.0
    period: float = 0.0


@dataclass
class Backoff:
    """When a path switched off under load is weighed again: after ``wait`` engine steps off,
    `RETRY` at first, doubled by each try that loses (up to `RETRY_MAX`), `RETRY` again once it
    pays (`paid`); ``tries``: the times it was weighed again."""

    wait: int = RETRY
    off: int = 0
    tries: int = 0

    def tick(self, off: bool) -> bool:
        """One engine step (``off``: the path is off under load); True: weigh it again now."""
        self.off = self.off + 1 if off else 0
        if self.off < self.wait:
            return False
        self.tries += 1
        self.wait, self.off = min(2 * self.wait, RETRY_MAX), 0
        return True

    def paid(self) -> None:
        self.wait = RETRY


@dataclass
class Window:
    """The last `WINDOW` weighed steps of one kind. ``weighed``: from `EVIDENCE` steps on, or
    sooner where so many cost more than vLLM's kernel that "the same cost" is unlikely (the sign
    test, `sign_needed`: 5 of 5) and they do in sum: off after 5 steps, on only after 16."""

    steps: deque[Weighed] = field(default_factory=lambda: deque(maxlen=WINDOW))

    @property
    def sums(self) -> tuple[float, float]:
        """(the path's seconds, vLLM's estimated seconds) over the window."""
        return sum(w.cost for w in self.steps), sum(w.estimate for w in self.steps)

    @property
    def weighed(self) -> bool:
        if len(self.steps) >= EVIDENCE:
            return True
        cost, estimate = self.sums
        lost = sum(w.cost > w.estimate for w in self.steps)
        return lost >= sign_needed(len(self.steps)) and cost > estimate

    @property
    def ratio(self) -> float | None:
        """The path's cost / vLLM's estimate once weighed (None: not yet, or no estimate)."""
        cost, estimate = self.sums
        return cost / estimate if self.weighed and estimate > 0 else None

    @property
    def added(self) -> float | None:
        """The share of the steps' wall time the path added over vLLM's kernel, arming included
        (None: their wall time unknown)."""
        period = sum(w.period for w in self.steps)
        return sum(w.cost - w.estimate + w.arm for w in self.steps) / period if period > 0 else None


@dataclass
class Lone:
    """Steps in which every cascade request read its masters alone (nothing shared: only the
    kernel's own speed can win there), weighed apart from the steps that share (a `Window` of
    their own): `loses` once they are weighed and cost more than vLLM's kernel would."""

    window: Window = field(default_factory=Window)

    def loses(self, step: Weighed) -> bool:
        self.window.steps.append(step)
        return (ratio := self.window.ratio) is not None and ratio > 1.0

    def line(self) -> str:
        """The log line once they lose."""
        steps, ratio = len(self.window.steps), self.window.ratio or 0.0
        return (f"kmesh: speed guard: serving, steps where every master has one reader cost "
                f"{ratio:.2f}x what vLLM's kernel would ({steps} weighed): from now on a master "
                "with one reader in a step is read on vLLM's kernel")  # fmt: skip
