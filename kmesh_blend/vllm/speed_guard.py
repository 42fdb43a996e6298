"""Whether cascade decode pays on this engine and under its load: decided from its own timings.

``kmesh.speed_guard: auto`` (the default). At engine start, after the cascade path passed its
self-check, `kmesh_blend.vllm.cascade_probe` times one attention layer on scratch blocks with the
engine's heads, dtype and block size: a family of readers of one master, then one reader alone,
each on the cascade path and on vLLM's own kernel over the same requests' whole contexts
(`Timing`). `SpeedGuard.decide`:

- the family slower on the cascade path: new readers decode on vLLM's kernel (their reports say
  why, ``cascade_off``), and ``share_kv_memory`` gives no block back;
- a reader alone slower: in a step where a master has one reader, that reader is served by
  vLLM's kernel (unless its blocks went back to vLLM's pool: only the cascade path can read it);
  the same once steps where no master had two readers lose under load (`cascade_timing.Lone`,
  weighed apart: nothing is shared in them, so they say nothing of the steps that share); a new
  reader alone with its masters is armed only where it is surely faster alone, or memory pays
  (`arms_alone`): else once a sibling decodes beside it.

"Slower": the fastest run slower than vLLM's, and enough of the paired runs lost that "the same
speed" is unlikely (`sign_needed`, a sign test); about equal: the weighing while serving decides.
Arming a reader (verifying its rows, placing its own rows) is paid once, before its first cascade
step; the probe times it (`Timing.arm_s`), and a new reader whose tokens left cannot repay it
(`Timing.break_even`) is not armed (`keeps_out`) unless requests wait for blocks.

While serving, `SpeedGuard.observe` weighs each cascade step — planning and the kernel
(`cascade_clock.StepParts`; arming left out) against vLLM's kernel on the same requests (the
start-up timing per context row, times their rows and layers) — over the last `WINDOW` steps,
from `EVIDENCE` on (sooner where it lost every step weighed: the same sign test). Where the path
costs more, new readers stay off it and sharing gives no more blocks back, until it is weighed
again (`cascade_timing.Backoff`); but where requests wait for KV blocks (`note_memory`), both
stay while what the blocks buy outweighs what the path adds to each step (`memory_pays`,
`memory_value.StepFit`). Each change of the decision: one log line, the ``/metrics`` gauges
(`gauges`) and, for a reader kept out, its report. Turned off, readers that still hold their
blocks go to vLLM's kernel too; blocks go back only once the path pays under the load (or
memory does, `gives_back`): a reader without its blocks can never leave the path. ``off``
trusts the settings. Plain Python: no vLLM import.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kmesh_blend.vllm.cascade_timing import (
    EVIDENCE,
    WINDOW,
    Backoff,
    Lone,
    Parts,
    Timing,
    Weighed,
    Window,
    sign_needed,
)
from kmesh_blend.vllm.memory_value import StepFit, waits_for_blocks

__all__ = ["EVIDENCE", "WINDOW", "SpeedGuard", "Timing", "sign_needed", "waits_for_blocks"]


@dataclass
class SpeedGuard:
    """``admits``: new readers decode in cascade (and sharing gives blocks back);
    ``alone_on_stock``: a master one request of a step reads is read on vLLM's kernel;
    ``reason``: why readers are kept out (None when they are not); ``timing``: the start-up
    figures (None with ``off``, or when the probe failed: ``problem`` says why)."""

    mode: str
    timing: Timing | None = None
    problem: str | None = None
    alone_on_stock: bool = False
    load_ratio: float | None = None  # cascade cost / vLLM's estimate over the window
    freed: float = 0.0  # blocks the readers in cascade give back (or would), share of the pool
    _window: Window = field(default_factory=Window)
    fit: StepFit = field(default_factory=StepFit)
    _short: deque[bool] = field(default_factory=lambda: deque(maxlen=WINDOW))
    retry: Backoff = field(default_factory=Backoff)  # off under load: when to weigh it again
    lone: Lone = field(default_factory=Lone)  # steps where no master had two readers

    @classmethod
    def decide(cls, mode: str, timing: Timing | None, problem: str | None = None) -> SpeedGuard:
        """The guard for ``mode`` (``auto`` / ``off``) from the start-up ``timing``; ``problem``:
        why the probe could not time it (then the settings are trusted, and the log says so)."""
        if mode == "off" or timing is None:
            return cls(mode, problem=problem)
        return cls(mode, timing, alone_on_stock=timing.alone_slower)

    # --- the decision ---------------------------------------------------------------------------

    @property
    def memory_short(self) -> bool:
        """A request waited for KV blocks within the window."""
        return any(self._short)

    @property
    def arms_alone(self) -> bool:
        """A new reader no other reader of its masters decodes beside is armed now: it shares
        nothing, so arming it buys a step only where the probe found the path surely faster
        alone, and its blocks only where memory pays (``off``, untimed: as configured)."""
        if (timing := self.timing) is None:
            return True
        return not self.alone_on_stock and (self.memory_pays or timing.alone_faster)

    @property
    def admits(self) -> bool:
        return self.state not in ("slower", "load", "costly")

    @property
    def added(self) -> float | None:
        """The share of the weighed steps' wall time the path added over vLLM's kernel, arming
        included (None: not weighed yet, or their wall time unknown)."""
        return None if self.load_ratio is None else self._window.added

    @property
    def bought(self) -> float:
        """What the blocks sharing gives back buy, a share of the engine's throughput (an upper
        bound): with the pool full, requests in flight grow by ``freed`` at most, and a step by
        their tokens' time: only its fixed part (`StepFit.fixed_share`; unfitted: all of it) is
        spread over more requests."""
        fixed = self.fit.fixed_share
        return self.freed * (1.0 if fixed is None else fixed)

    @property
    def memory_pays(self) -> bool:
        """Requests wait for blocks, and what sharing gives back buys more than the path costs
        (`bought` ≥ `added`; unweighed yet: it stays)."""
        added = self.added
        return self.memory_short and (added is None or self.bought >= added)

    @property
    def state(self) -> str:
        """Which rule decides now: ``untimed``, ``memory`` (requests wait for blocks and what
        sharing gives back outweighs the path's cost), ``costly`` (they wait, and it does not),
        ``slower`` (the start-up timing), ``load`` (the weighed steps) or ``pays``."""
        if self.timing is None:
            return "untimed"
        if self.memory_pays:
            return "memory"
        if self.memory_short:
            return "costly"
        if self.timing.family_slower:
            return "slower"
        if self.load_ratio is not None and self.load_ratio > 1.0:
            return "load"
        return "pays"

    @property
    def gives_back(self) -> str | None:
        """Why ``share_kv_memory`` may not give a new reader's blocks back now (None: it may).
        A reader whose blocks went back can only be read by the cascade path, so blocks go
        back only once the path is weighed under this load and pays there (or memory does,
        `memory_pays`); before that its blocks stay and it can still leave."""
        if self.timing is None:
            return None
        if self.memory_pays and self.load_ratio is not None:
            return None
        if (reason := self.reason) is not None:
            return reason
        if self.load_ratio is None:
            return (f"speed guard: blocks go back once cascade decode is weighed under this "
                    f"load ({len(self._window.steps)} of {EVIDENCE} steps weighed) and pays, or "
                    "requests wait for KV blocks and what they buy outweighs its cost")  # fmt: skip
        return None

    @property
    def reason(self) -> str | None:
        state = self.state
        if state not in ("slower", "load", "costly"):
            return None
        assert self.timing is not None
        if state == "slower":
            return (f"speed guard: cascade decode is slower than vLLM's kernel here "
                    f"({self.timing.describe()})")  # fmt: skip
        assert self.load_ratio is not None
        steps = len(self._window.steps)
        measured, estimated = (t * 1e3 / steps for t in self._window.sums)
        load = (f"speed guard: under this load a cascade step costs {self.load_ratio:.2f}x what "
                f"vLLM's kernel would for the same requests (mean of the last {steps} "
                f"steps: {measured:.2f} ms vs {estimated:.2f} ms)")  # fmt: skip
        if state == "load":
            return f"{load} and no request waits for KV blocks"
        fixed = self.fit.fixed_share
        of = "" if fixed is None else f", {fixed:.0%} of a step's time not growing with tokens"
        return (f"{load}; requests wait for KV blocks, but the path adds {self.added:.1%} to "
                f"each step's time and the blocks sharing gives back buy {self.bought:.1%} at "
                f"most ({self.freed:.1%} of vLLM's pool{of})")  # fmt: skip

    def keeps_out(self, steps_left: int | None) -> str | None:
        """Why a new reader with ``steps_left`` decode steps at most (None: unknown) is not
        armed (None: arm it): its steps would not repay the arming (`Timing.break_even`), and no
        request waits for blocks (where one does, the blocks it gives back are the payoff)."""
        timing = self.timing
        if timing is None or steps_left is None or self.memory_pays:
            return None
        steps = timing.break_even
        if steps is None or steps_left >= steps:
            return None
        return (f"speed guard: arming a reader ({timing.arm_s * 1e3:.3f} ms per layer) is "
                f"{timing.repaid} in a family of {timing.family}; this request decodes at most "
                f"{steps_left} more and no request waits for KV blocks")  # fmt: skip

    def observe(self, parts: Parts, layers: int, freed: float = 0.0) -> str | None:
        """Weigh one finished cascade step of ``layers`` layers (``parts.period_s`` its forward's
        time, 0: unknown); ``freed``: the blocks its readers give back or would, a share of
        vLLM's pool; the new log line when the decision changed."""
        if self.timing is None:
            return None
        before = self.state
        self.freed = freed
        estimate = self.timing.stock_row_s * parts.context_rows * layers
        # arming is weighed once per reader, before it is paid (`keeps_out`), not in the load ratio
        # (a family's first step would hold all its arms); against memory: part of the blocks' cost
        cost = parts.plan_s - parts.arm_s + parts.cascade_s
        weighed = Weighed(cost, estimate, parts.arm_s, parts.period_s)
        if parts.lone and not (self.alone_on_stock or self.memory_short):  # nothing shared here
            self.alone_on_stock = self.lone.loses(weighed)
            return self.lone.line() if self.alone_on_stock else None
        self._window.steps.append(weighed)
        if self._window.weighed:
            self.load_ratio = self._window.ratio
            if self.load_ratio is not None and self.load_ratio <= 1.0:
                self.retry.paid()
        return self._changed(before)

    def note_memory(self, short: bool) -> str | None:
        """A step begins; ``short``: a request waited for blocks. Off under load long enough, the
        path is weighed again (a workload's first steps, a family's first readers, are its least
        favourable; a load changes). The new log line when the decision changed."""
        if self.timing is None:
            return None
        before = self.state
        self._short.append(short)
        if self.retry.tick(self.state == "load"):
            self._window.steps.clear()
            self.load_ratio = None
        return self._changed(before)

    def note_step(self, tokens: int, seconds: float) -> str | None:
        """A forward of ``tokens`` tokens took ``seconds`` (`StepFit`); the new log line, if any."""
        if self.timing is None:
            return None
        before = self.state
        self.fit.add(tokens, seconds)
        return self._changed(before)

    def _changed(self, before: str) -> str | None:
        return None if self.state == before else self.line()

    def line(self) -> str:
        """The decision in one log line."""
        if self.mode == "off":
            return "kmesh: speed guard off (kmesh.speed_guard): cascade decode as configured"
        if self.timing is None:
            return (f"kmesh: speed guard could not time the cascade path ({self.problem}); "
                    "trusting the settings")  # fmt: skip
        if self.reason is not None:
            return f"kmesh: {self.reason}; new readers decode on vLLM's kernel with their blocks"
        alone = "on vLLM's kernel" if self.alone_on_stock else "in cascade"
        why = "requests wait for KV blocks: sharing stays" if self.memory_pays else "it pays here"
        if self.retry.tries and self.load_ratio is None and not self.memory_pays:
            why = f"weighed again under this load (try {self.retry.tries})"
        load = f"; under load {self.load_ratio:.2f}x" if self.load_ratio is not None else ""
        return (
            f"kmesh: speed guard: cascade decode on, {why} ({self.timing.describe()}{load}); "
            f"a master with one reader in a step is read {alone}"
        )

    def gauges(self) -> dict[str, int]:
        """``/metrics`` gauges (see the module docstring); the ratios are 0 when not timed."""
        timing, load = self.timing, self.load_ratio
        return {
            "cascade_guard_admits": int(self.admits),
            "cascade_guard_family_permille": round(timing.family_ratio * 1000) if timing else 0,
            "cascade_guard_alone_permille": round(timing.alone_ratio * 1000) if timing else 0,
            "cascade_guard_load_permille": _permille(load),
            "cascade_guard_memory_short": int(self.memory_short),
            "cascade_guard_freed_permille": round(self.freed * 1000),
            "cascade_guard_added_permille": _permille(self.added),
            "cascade_guard_bought_permille": round(self.bought * 1000),
            "cascade_guard_break_even_steps": _steps(timing.break_even if timing else None),
            "cascade_guard_retries": self.retry.tries,
        }


def _steps(steps: float | None) -> int:
    """A break-even for a gauge: 0 not timed, -1 never."""
    return 0 if steps is None else -1 if math.isinf(steps) else round(steps)


def _permille(ratio: float | None) -> int:
    """A ratio for a gauge: 0 when not weighed."""
    return 0 if ratio is None else round(ratio * 1000)
