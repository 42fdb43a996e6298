"""What getting an artifact costs in the replay's virtual time, per tier and artifact kind.

`DEFAULT_COSTS` are rough CPU figures for tests; the benchmark measures its own on the real
loaders (MiniLM, faiss, the HTTP tool, the disk tier) in the same run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_COSTS", "CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Virtual seconds of each way of getting an artifact (a RAM hit costs 0)."""

    origin_latency_s: Mapping[str, float]
    """Per kind: fixed cost of one loader call (model call, search, HTTP round trip)."""
    origin_s_per_byte: Mapping[str, float]
    """Per kind: cost per byte of the result (e.g. embedding time per output byte)."""
    disk_latency_s: float = 2e-4
    disk_s_per_byte: float = 1.0 / 2e9

    def origin_s(self, kind: str, nbytes: int) -> float:
        return self.origin_latency_s.get(kind, 0.0) + nbytes * self.origin_s_per_byte.get(kind, 0.0)

    def disk_s(self, nbytes: int) -> float:
        return self.disk_latency_s + nbytes * self.disk_s_per_byte


DEFAULT_COSTS = CostModel(
    # Rough CPU figures (the benchmark replaces them with measured ones): MiniLM ~3 ms per
    # document = per 1536-byte row; a faiss flat search ~2 ms; a remote tool ~50 ms.
    origin_latency_s={"embedding": 0.01, "retrieval": 0.002, "tool": 0.05, "blob": 0.01},
    origin_s_per_byte={"embedding": 3e-3 / 1536, "retrieval": 0.0, "tool": 1e-9, "blob": 1e-9},
)
