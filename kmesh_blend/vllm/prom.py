"""`KVConnectorStats` and `KVConnectorPromMetrics` of the connector (names: `stats`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kmesh_blend.vllm.stats import COUNTERS, GAUGES, INFOS, Payload

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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
        info = {**self.data.get("info", {}), **other.data.get("info", {})}
        return KMeshStats({"counters": counters, "gauges": gauges, "info": info})

    def reduce(self) -> dict[str, int | float]:
        return {**self.data.get("counters", {}), **self.data.get("gauges", {})}

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "gauges", "info"))


class KMeshPromMetrics(KVConnectorPromMetrics):
    """Registers ``vllm:kmesh_*`` and records each step's `KMeshStats` payload."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str],
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
        self._infos = {
            name: self._gauge_cls(
                name=f"vllm:kmesh_{name}_info",
                documentation=doc,
                labelnames=[*labelnames, *fields],
                multiprocess_mode="mostrecent",
            )
            for name, (doc, fields) in INFOS.items()
        }
        # Unlabelled series exist from the start (at 0), so a scrape never misses one.
        for labels in per_engine_labelvalues.values():
            for name, (_, label) in COUNTERS.items():
                if label is None:
                    self._counters[name].labels(*labels)
            for gauge in self._gauges.values():
                gauge.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, object], engine_idx: int = 0) -> None:
        data = cast(Payload, transfer_stats_data)
        engine = list(self.per_engine_labelvalues.get(engine_idx, []))
        for key, n in data.get("counters", {}).items():
            name, _, label = key.partition("|")
            counter = self._counters.get(name)
            if counter is not None and n > 0:
                counter.labels(*engine, *([label] if COUNTERS[name][1] else [])).inc(n)
        for name, value in data.get("gauges", {}).items():
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge.labels(*engine).set(value)
        for name, fields in data.get("info", {}).items():
            info = self._infos.get(name)
            if info is not None:
                labels = [fields.get(field, "") for field in INFOS[name][1]]
                info.labels(*engine, *labels).set(1)
