"""Where stored segment KV comes from during a blend: the narrow interface to the segment store.

The blend asks for one layer of one segment at a time, so a layer-synchronous group can fetch
each shared segment's layer once for all siblings. The segment store implements `SegmentSource`;
`DenseSegmentSource` keeps whole segments in memory and counts reads (tests, benchmarks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple, Protocol

import torch

from kmesh_blend.models.layerwise import LayerwiseModel, prefill
from kmesh_blend.segments.master import Master

__all__ = [
    "DenseSegmentSource",
    "MasterSource",
    "SegmentKV",
    "SegmentSource",
    "master_tensor",
    "segment_kv_from_prefill",
]


class SegmentKV(NamedTuple):
    """A stored segment: keys / values [L, S, Hkv, D] (keys rotated at ``positions``), and the
    positions [S] int64 they were computed at."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


class SegmentSource(Protocol):
    def positions(self, segment_id: str) -> torch.Tensor:
        """[S] int64: the positions the stored keys are rotated at."""
        ...

    def layer_kv(self, segment_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of a stored segment: (keys, values), each [S, Hkv, D]."""
        ...


class DenseSegmentSource:
    """In-memory `SegmentSource`; ``reads[(segment_id, layer)]`` counts `layer_kv` calls."""

    def __init__(self, segments: dict[str, SegmentKV] | None = None) -> None:
        self.segments: dict[str, SegmentKV] = dict(segments or {})
        self.reads: Counter[tuple[str, int]] = Counter()

    def add(self, segment_id: str, kv: SegmentKV) -> None:
        self.segments[segment_id] = kv

    def positions(self, segment_id: str) -> torch.Tensor:
        return self.segments[segment_id].positions

    def layer_kv(self, segment_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads[(segment_id, layer)] += 1
        kv = self.segments[segment_id]
        return kv.keys[layer], kv.values[layer]


def segment_kv_from_prefill(
    model: LayerwiseModel, token_ids: torch.Tensor, start: int = 0
) -> SegmentKV:
    """Compute a segment's master KV the way it is first stored: the tokens ([S] int64) prefilled
    alone at positions ``start .. start+S-1``."""
    positions = torch.arange(start, start + token_ids.numel(), dtype=torch.int64)
    result = prefill(model, token_ids, positions, last_only=True)
    return SegmentKV(torch.stack(result.keys), torch.stack(result.values), positions)


class MasterSource:
    """`SegmentSource` over masters fetched from the segment store (`kmesh_blend.segments`).

    ``masters``: segment id → its `Master` (``kv`` [L, 2, S, Hkv, D], K rotated at
    ``positions`` [S] int64) — what `SegmentCache.fetch` returns. Layer reads are views (no
    copy); ``reads`` counts them as in `DenseSegmentSource`.
    """

    def __init__(self, masters: Mapping[str, Master]) -> None:
        self.masters = masters
        self.reads: Counter[tuple[str, int]] = Counter()

    def positions(self, segment_id: str) -> torch.Tensor:
        return self.masters[segment_id].positions

    def layer_kv(self, segment_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads[(segment_id, layer)] += 1
        kv = self.masters[segment_id].kv
        return kv[layer, 0], kv[layer, 1]


def master_tensor(kv: SegmentKV) -> torch.Tensor:
    """A `SegmentKV` in the store's master layout: [L, 2, S, Hkv, D]."""
    return torch.stack((kv.keys, kv.values), dim=1)
