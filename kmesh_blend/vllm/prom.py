"""`KVConnectorStats` and `KVConnectorPromMetrics` of the connector (names: `stats`)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kmesh_blend.vllm.stats import COUNTERS, GAUGES

__all__ = ["KMeshPromMetrics", "KMeshStats"]


class KMeshStats(KVConnectorStats):
    """Counters since the last report and current gauges (`kmesh_blend.vllm.stats`)."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """A new `KMeshStats`: counters summed, gauges from ``other`` where it has them. Neither
        input is changed (vLLM keeps and re-reads the payloads it has aggregated)."""
        counters = dict(self.data.get("counters", {}))
        for name, n in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + n
        gauges = {**self.data.get("gauges", {}), **other.data.get("gauges", {})}
        return KMeshStats({"counters": counters, "gauges": gauges})

    def reduce(self) -> dict[str, int | float]:
        return {**self.data.get("counters", {}), **self.data.get("gauges", {})}

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("gauges")


class KMeshPromMetrics(KVConnectorPromMetrics):
    """Registers ``vllm:kmesh_*`` and records each step's `KMeshStats` payload."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kmesh_{name}",
                documentation=doc,
                labelnames=[*labelnames, *([label] if label else [])],
            )
            for name, (doc, label) in COUNTERS.items()
        }
        self._gauges = {
            name: self._gauge_cls(
                name=f"vllm:kmesh_{name}",
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for name, doc in GAUGES.items()
        }
        # Unlabelled series exist from the start (at 0), so a scrape never misses one.
        for labels in per_engine_labelvalues.values():
            for name, (_, label) in COUNTERS.items():
                if label is None:
                    self._counters[name].labels(*labels)
            for gauge in self._gauges.values():
                gauge.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = list(self.per_engine_labelvalues.get(engine_idx, []))
        for key, n in transfer_stats_data.get("counters", {}).items():
            name, _, label = key.partition("|")
            counter = self._counters.get(name)
            if counter is not None and n > 0:
                counter.labels(*engine, *([label] if COUNTERS[name][1] else [])).inc(n)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge.labels(*engine).set(value)
