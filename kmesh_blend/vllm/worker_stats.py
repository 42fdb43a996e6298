"""Worker side, metrics: segment-layer counters since the last report, host-RAM gauges, and (once)
what the seam found and changed in vLLM (`kmesh_blend.vllm.seam.REPORT`), as the payload
`kmesh_blend.vllm.stats` describes."""

from __future__ import annotations

from collections.abc import Callable

from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.store import LMCacheMasterStore
from kmesh_blend.vllm.seam import REPORT
from kmesh_blend.vllm.stats import Payload

__all__ = ["WorkerStats"]


class WorkerStats:
    def __init__(self, cache: SegmentCache, store: LMCacheMasterStore,
                 held: Callable[[], dict[str, int]] | None = None) -> None:  # fmt: skip
        """``held()``: gauges of KV the cascade path holds next to vLLM's budget (or None)."""
        self.cache, self.store, self.held = cache, store, held
        self._seen: dict[str, int] = {}  # counters at the last `take`
        self._gauges: dict[str, int] = {}
        self._info_sent = False

    def take(self) -> Payload | None:
        """Counters since the last call and current gauges; None when nothing changed."""
        metrics = self.cache.metrics.as_dict()
        now = {f"store_reads|{tier}": int(n) for tier, n in metrics["reads"].items()}
        for ours, theirs in [("retention_hits", "hits"), ("store_misses", "misses"),
                             ("singleflight_joins", "singleflight_joins")]:  # fmt: skip
            now[ours] = int(metrics[theirs])
        health = self.store.health
        now["store_outages"] = health.num_down
        seen, self._seen = self._seen, now
        counters = {
            name: n - seen.get(name, 0) for name, n in now.items() if n != seen.get(name, 0)
        }
        gauges = {
            "retained_bytes": int(metrics["retained_bytes"]),
            "indexed_segments": len(self.cache.index),
            "store_up": int(health.up),
            **(self.held() if self.held is not None else {}),
        }
        payload: Payload = {"counters": counters, "gauges": gauges}
        if not self._info_sent:
            self._info_sent = True
            payload["info"] = {"vllm_seam": REPORT.labels()}
        elif not counters and gauges == self._gauges:
            return None
        self._gauges = gauges
        return payload
