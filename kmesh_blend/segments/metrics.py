"""Segment-layer metrics: Prometheus metrics (``prometheus_client``) and the same numbers as a
plain dict for tests.

Each `SegmentMetrics` owns a private ``CollectorRegistry`` (several instances — tests, several
engines in one process — never collide); a server exposes it with
``prometheus_client.generate_latest(metrics.registry)`` or passes ``registry=`` to share one.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["TIERS", "SegmentMetrics"]

TIERS: tuple[str, ...] = ("cpu", "disk", "lm", "redis")
"""Backing tiers a read can come from (``kmesh.store`` kinds)."""


class SegmentMetrics:
    """Counters of the segment layer.

    Prometheus names (prefix ``kmesh_segments_``): ``reads_total{tier}``, ``hits_total``,
    ``misses_total``, ``singleflight_joins_total``, ``evictions_total``,
    ``fallbacks_total{reason}``, ``retained_bytes`` (gauge), ``prepare_seconds_total``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        p = "kmesh_segments_"
        r = self.registry
        self._reads = Counter(p + "reads", "Reads from the backing tier", ["tier"], registry=r)
        self._hits = Counter(p + "hits", "Segment lookups served from host RAM", registry=r)
        self._misses = Counter(p + "misses", "Segment lookups not found anywhere", registry=r)
        self._joins = Counter(
            p + "singleflight_joins", "Lookups that waited for another's read", registry=r
        )
        self._evictions = Counter(p + "evictions", "Objects evicted from host RAM", registry=r)
        self._fallbacks = Counter(
            p + "fallbacks", "Requests run without reuse", ["reason"], registry=r
        )
        self._retained = Gauge(p + "retained_bytes", "Bytes retained in host RAM", registry=r)
        self._prepare = Counter(
            p + "prepare_seconds", "Time spent preparing families on notice", registry=r
        )
        self._lock = threading.Lock()
        self._plain: dict[str, Any] = {
            "reads": dict.fromkeys(TIERS, 0),
            "hits": 0,
            "misses": 0,
            "singleflight_joins": 0,
            "evictions": 0,
            "fallbacks": {},
            "retained_bytes": 0,
            "prepare_seconds": 0.0,
        }

    def read(self, tier: str, n: int = 1) -> None:
        """``n`` reads from backing tier ``tier``."""
        self._reads.labels(tier=tier).inc(n)
        with self._lock:
            reads = self._plain["reads"]
            reads[tier] = reads.get(tier, 0) + n

    def hit(self, n: int = 1) -> None:
        self._hits.inc(n)
        self._add("hits", n)

    def miss(self, n: int = 1) -> None:
        self._misses.inc(n)
        self._add("misses", n)

    def join(self, n: int = 1) -> None:
        self._joins.inc(n)
        self._add("singleflight_joins", n)

    def eviction(self, n: int = 1) -> None:
        self._evictions.inc(n)
        self._add("evictions", n)

    def fallback(self, reason: str) -> None:
        """A request ran without reuse; ``reason`` should be a short, low-cardinality tag."""
        self._fallbacks.labels(reason=reason).inc()
        with self._lock:
            fb = self._plain["fallbacks"]
            fb[reason] = fb.get(reason, 0) + 1

    def set_retained_bytes(self, nbytes: int) -> None:
        self._retained.set(nbytes)
        with self._lock:
            self._plain["retained_bytes"] = nbytes

    def prepare_time(self, seconds: float) -> None:
        self._prepare.inc(seconds)
        self._add("prepare_seconds", seconds)

    def as_dict(self) -> dict[str, Any]:
        """A deep copy of every number (``reads`` and ``fallbacks`` are dicts by label)."""
        with self._lock:
            out = dict(self._plain)
            out["reads"] = dict(self._plain["reads"])
            out["fallbacks"] = dict(self._plain["fallbacks"])
            return out

    def _add(self, name: str, n: float) -> None:
        with self._lock:
            self._plain[name] += n
