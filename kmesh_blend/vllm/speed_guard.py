"""Whether cascade decode pays on this engine: decided from its own timings, not from constants.

``kmesh.speed_guard: auto`` (the default). At engine start, after the cascade path passed its
self-check, `kmesh_blend.vllm.cascade_probe` times one attention layer on scratch blocks with the
engine's heads, dtype and block size: a family of readers of one master, then one reader alone,
each on the cascade path and on vLLM's own kernel over the same requests' whole contexts
(`Timing`). `SpeedGuard.decide`:

- the family slower on the cascade path than on vLLM's kernel: new readers decode on vLLM's
  kernel (their reports say why, ``cascade_off``), and ``share_kv_memory`` gives no block back
  (a released reader could only ever be served by the slower path);
- a reader alone slower: in a step where a master has one reader, that reader is served by
  vLLM's kernel (unless its blocks went back to vLLM's pool: only the cascade path can read it).

The decision and its figures go to one log line, the ``/metrics`` gauges
(``cascade_guard_admits``, ``cascade_guard_family_permille``, ``cascade_guard_alone_permille``:
cascade / vLLM time × 1000) and, for a reader it keeps out, its report. ``off`` trusts the
settings. Plain Python: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpeedGuard", "Timing"]


@dataclass(frozen=True)
class Timing:
    """One attention layer, median seconds: ``family`` readers of a master of ``rows`` rows on
    the cascade path (``family_s``) and on vLLM's kernel (``family_stock_s``); one of them alone
    likewise (``alone_s``, ``alone_stock_s``)."""

    family: int
    rows: int
    family_s: float
    family_stock_s: float
    alone_s: float
    alone_stock_s: float

    @property
    def family_ratio(self) -> float:
        return self.family_s / self.family_stock_s

    @property
    def alone_ratio(self) -> float:
        return self.alone_s / self.alone_stock_s

    def describe(self) -> str:
        return (
            f"{self.family} readers of a {self.rows}-row master: {self.family_s * 1e3:.3f} ms "
            f"vs vLLM's kernel {self.family_stock_s * 1e3:.3f} ms ({self.family_ratio:.2f}x); "
            f"one alone {self.alone_s * 1e3:.3f} ms vs {self.alone_stock_s * 1e3:.3f} ms "
            f"({self.alone_ratio:.2f}x), per layer"
        )


@dataclass(frozen=True)
class SpeedGuard:
    """``admits``: new readers decode in cascade; ``alone_on_stock``: a master one request of a
    step reads is read on vLLM's kernel; ``reason``: why readers are kept out (None when they
    are not); ``timing``: what it was decided on (None with ``off``, or when the probe failed)."""

    mode: str
    admits: bool = True
    alone_on_stock: bool = False
    reason: str | None = None
    timing: Timing | None = None
    problem: str | None = None  # why the probe could not time the path (settings trusted)

    @classmethod
    def decide(cls, mode: str, timing: Timing | None, problem: str | None = None) -> SpeedGuard:
        """The guard for ``mode`` (``auto`` / ``off``) from the start-up ``timing``; ``problem``:
        why the probe could not time it (then the settings are trusted, and the log says so)."""
        if mode == "off" or timing is None:
            return cls(mode, problem=problem)
        if timing.family_ratio > 1.0:
            reason = (f"speed guard: cascade decode is slower than vLLM's kernel here "
                      f"({timing.describe()})")  # fmt: skip
            return cls(mode, False, True, reason, timing)
        return cls(mode, True, timing.alone_ratio > 1.0, None, timing)

    def line(self) -> str:
        """The decision in one log line."""
        if self.mode == "off":
            return "kmesh: speed guard off (kmesh.speed_guard): cascade decode as configured"
        if self.timing is None:
            return (f"kmesh: speed guard could not time the cascade path ({self.problem}); "
                    "trusting the settings")  # fmt: skip
        if not self.admits:
            return (
                f"kmesh: {self.reason}; new readers decode on vLLM's kernel, keeping their blocks"
            )
        alone = "on vLLM's kernel" if self.alone_on_stock else "in cascade"
        return (
            f"kmesh: speed guard: cascade decode pays here ({self.timing.describe()}); "
            f"a master with one reader in a step is read {alone}"
        )

    def gauges(self) -> dict[str, int]:
        """``/metrics`` gauges (see the module docstring); the ratios are 0 when not timed."""
        timing = self.timing
        return {
            "cascade_guard_admits": int(self.admits),
            "cascade_guard_family_permille": round(timing.family_ratio * 1000) if timing else 0,
            "cascade_guard_alone_permille": round(timing.alone_ratio * 1000) if timing else 0,
        }
