"""Whether a store answers: a deadline per operation, fail-fast while it is down, a background
prober that brings it back.

A store that is down or hung must cost the requests that need it their reuse, never the engine
its progress. So every store operation runs under a deadline (`Health.deadline`: the setting
``kmesh.store_timeout_s`` plus time for the bytes it moves). The first operation that fails or
misses its deadline marks the store down; while it is down every operation fails at once with
`StoreUnavailable` (no lock taken, no socket touched), and one daemon thread probes the store
every `RETRY_S` seconds. The first probe that answers marks it up again. On a loaded machine that
thread may fall behind: an operation that finds the store down while the last failed probe is
older than `RETRY_S` probes once itself (one at a time; it costs that caller at most one
deadline), so the first request after the store answers again need not wait for the thread.

`StoreUnavailable`'s message names the store setting and address, and the reason; reports and
log lines carry it as is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RETRY_S", "Health", "StoreUnavailable"]

log = logging.getLogger(__name__)

RETRY_S = 0.5
"""Seconds between two probes of a store that is down."""
_BYTES_PER_S = 100e6
"""Slowest transfer rate (bytes/s) a healthy store is granted before its deadline passes."""


class StoreUnavailable(Exception):
    """The store did not answer (down, hung, refused): ``kmesh.store <address> unavailable: …``."""


class Health:
    """Up/down state of one store (thread-safe).

    ``address``: the ``kmesh.store`` value, as users wrote it. ``timeout_s``: the base deadline
    of one operation. ``probe``: one cheap operation on the store that raises unless it answers
    (it runs under its own deadline, on the prober thread).
    """

    def __init__(self, address: str, timeout_s: float, probe: Callable[[], None]) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._probe = probe
        self._reason: str | None = None  # None: up
        self._mutex = threading.Lock()
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self._inline = threading.Lock()  # at most one caller probes inline at a time
        self._last_failure = time.monotonic()  # of the outage or of the last failed probe
        self.num_down = 0  # how often the store went down (a counter for metrics and tests)

    def deadline(self, nbytes: int = 0) -> float:
        """Seconds one operation moving ``nbytes`` may take."""
        return self.timeout_s + nbytes / _BYTES_PER_S

    @property
    def up(self) -> bool:
        return self._reason is None

    def check(self) -> None:
        """Raise `StoreUnavailable` while the store is down: at once, or after one inline probe
        when the last failed probe is older than `RETRY_S` (the prober fell behind)."""
        if self._reason is None:
            return
        stale = time.monotonic() - self._last_failure > RETRY_S
        if stale and self._inline.acquire(blocking=False):
            try:
                if self._reason is not None:
                    self._probe_once()
            finally:
                self._inline.release()
        reason = self._reason
        if reason is not None:
            raise StoreUnavailable(reason)

    def failed(self, why: str) -> StoreUnavailable:
        """Mark the store down because of ``why`` (one log line per outage) and start probing;
        returns the error to raise."""
        with self._mutex:
            self._last_failure = time.monotonic()
            if self._reason is None:
                self._reason = f"kmesh.store {self.address} unavailable: {why}"
                self.num_down += 1
                log.warning("%s; reuse resumes when it answers", self._reason)
            reason = self._reason
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(
                    target=self._probe_until_up, name="kmesh-store-probe", daemon=True
                )
                self._prober.start()
        return StoreUnavailable(reason)

    def close(self) -> None:
        self._closed.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=self.deadline() + RETRY_S + 1)

    def _probe_once(self) -> bool:
        """One probe; marks the store up when it answers. Whether it answered."""
        try:
            self._probe()
        except Exception as exc:  # still down: the reason stays the first outage's
            self._last_failure = time.monotonic()
            log.debug("kmesh.store %s: probe failed: %s", self.address, str(exc))
            return False
        with self._mutex:
            was_down, self._reason = self._reason is not None, None
        if was_down:
            log.warning("kmesh.store %s answers again", self.address)
        return True

    def _probe_until_up(self) -> None:
        while not self._closed.wait(RETRY_S):
            if self._reason is not None:
                self._probe_once()
            with self._mutex:  # an outage after this sees no prober and starts one
                if self._reason is None:
                    self._prober = None
                    return
        with self._mutex:
            self._prober = None
