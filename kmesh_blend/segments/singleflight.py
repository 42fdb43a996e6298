"""Singleflight: concurrent requests for the same key share one call of the loader.

The first caller of `SingleFlight.do` for a key becomes the *leader* and runs ``fn``; callers that
arrive while it runs are *followers*: they wait (bounded by a timeout) and adopt the leader's
value — the very same object, which they must treat as read-only. If the leader's ``fn`` raises,
the leader gets its own exception back and one follower *takes over* (runs ``fn`` itself; the
others follow it), up to ``max_attempts`` calls in a row; after that every follower gets
`SingleFlightError` (the caller's cue to fall back to recompute). A follower whose deadline passes
gets `SingleFlightTimeout`; a hung leader therefore never blocks anyone but itself (``fn`` should
bound its own I/O).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

__all__ = ["Outcome", "SingleFlight", "SingleFlightError", "SingleFlightTimeout"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlightError(RuntimeError):
    """Every allowed attempt failed; ``__cause__`` is the last leader's exception."""


class SingleFlightTimeout(TimeoutError):
    """A follower waited longer than its timeout."""


class Outcome(NamedTuple, Generic[V]):
    """What `SingleFlight.do` returns: the value and how this caller got it."""

    value: V
    leader: bool
    """True if this caller ran ``fn`` itself (first caller or a takeover)."""
    attempt: int
    """1 for the first call of ``fn`` in this flight, 2 after one takeover, ..."""


@dataclass
class _Flight(Generic[V]):
    attempt: int
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    value: V | None = None
    error: BaseException | None = None
    num_followers: int = 0


class SingleFlight(Generic[K, V]):
    """Deduplicate concurrent loads per key. Thread-safe; nothing is cached after a flight."""

    def __init__(self, *, timeout_s: float = 30.0, max_attempts: int = 2) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        self.timeout_s = float(timeout_s)
        self.max_attempts = int(max_attempts)
        self._flights: dict[K, _Flight[V]] = {}
        self._lock = threading.Lock()
        self._stats = {"calls": 0, "leads": 0, "joins": 0, "takeovers": 0, "failures": 0}
        self._stats.update({"timeouts": 0, "gave_up": 0})

    def stats(self) -> dict[str, int]:
        """Counters: calls, leads (fn runs), joins, takeovers, failures, timeouts, gave_up."""
        with self._lock:
            return dict(self._stats)

    def in_flight(self, key: K) -> bool:
        with self._lock:
            return key in self._flights

    def do(self, key: K, fn: Callable[[], V], *, timeout_s: float | None = None) -> Outcome[V]:
        """Run ``fn`` once for all concurrent callers of ``key`` and return its value to each.

        Raises: the leader's own exception (to the leader), `SingleFlightError` (followers, once
        ``max_attempts`` calls failed), `SingleFlightTimeout` (followers, past the deadline).
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            self._stats["calls"] += 1
        failed: _Flight[V] | None = None  # the flight this caller last saw fail
        joined = False
        while True:
            with self._lock:
                flight = self._flights.get(key)
                if flight is None:
                    attempt = 1 if failed is None else failed.attempt + 1
                    flight = self._flights[key] = _Flight(attempt)
                    self._stats["leads"] += 1
                    if failed is not None:
                        self._stats["takeovers"] += 1
                    lead = True
                else:
                    flight.num_followers += 1
                    self._stats["joins"] += 0 if joined else 1
                    joined, lead = True, False
            if lead:
                return self._lead(key, flight, fn)
            if not flight.done.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    self._stats["timeouts"] += 1
                raise SingleFlightTimeout(
                    f"waited past the deadline for key {key!r} (attempt {flight.attempt})"
                )
            if flight.ok:
                return Outcome(flight.value, False, flight.attempt)  # type: ignore[arg-type]
            if flight.attempt >= self.max_attempts:
                with self._lock:
                    self._stats["gave_up"] += 1
                raise SingleFlightError(
                    f"key {key!r}: {flight.attempt} attempt(s) failed"
                ) from flight.error
            failed = flight  # try to take over (or follow whoever did)

    def _lead(self, key: K, flight: _Flight[V], fn: Callable[[], V]) -> Outcome[V]:
        try:
            value = fn()
        except BaseException as exc:
            with self._lock:
                self._stats["failures"] += 1
                if self._flights.get(key) is flight:
                    del self._flights[key]
                flight.error = exc
            flight.done.set()
            raise
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
            flight.value, flight.ok = value, True
        flight.done.set()
        return Outcome(value, True, flight.attempt)
