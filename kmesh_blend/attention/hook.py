"""Consumer (a): the group recomputation's attention through cascade attention.

`cascade_hooks` returns one `AttentionHook` per request for `blend_group(..., attention=...)`.
Each hook attends a layer's computed tokens over (1) every stored segment the request uses, read
as the master's own rows — the tokens the request recomputed in a span are its replaced rows,
masked out there — and (2) the request's unique rows (private tokens + recomputed rows). The
hooks of one group share a cache of the current layer's segment reads, so in ``layer_sync`` the
store is read once per segment layer for the group (``sequential`` revisits layers: N reads).

Limits, stated precisely:
- Per-request selection only. In ``collective`` mode borrowed rows come from the segment's leader,
  not from the master; these hooks would attend the master instead (`check_request` refuses).
- Not bit-exact with the model's own `attend`: the shared rows are scored through rotated queries
  instead of re-positioned keys (fp32 tiny Llamas: logits within 1.3e-6; measured in
  tests/attention/test_hook.py). Bit-identical across schedules: each hook's math depends only on
  its own request, with the same shapes in ``sequential`` and ``layer_sync``.
- One kernel read of a master per layer *per request*: the hook interface hands over one request's
  queries at a time. Reading each master once per layer for the whole group needs a group-level
  attention callback in `blend/group.py` (collect every member's q, then one `cascade_attention`
  call with all members as siblings) — a change outside this package.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kmesh_blend.attention.cascade import SharedSegment, Sibling, cascade_attention
from kmesh_blend.attention.launch import CascadeBackend
from kmesh_blend.blend.executor import AttentionHook
from kmesh_blend.blend.plan import BlendOptions, BlendRequest
from kmesh_blend.blend.source import SegmentSource
from kmesh_blend.models.layerwise import LayerwiseModel

__all__ = ["CascadeHook", "cascade_hooks"]


def cascade_hooks(
    model: LayerwiseModel,
    requests: Sequence[BlendRequest],
    source: SegmentSource,
    options: BlendOptions,
    backend: CascadeBackend = "auto",
) -> list[AttentionHook]:
    """One `CascadeHook` per request, sharing one cache of segment layer reads."""
    if options.selection != "per_request":
        raise ValueError(
            f"cascade hooks need selection='per_request', got {options.selection!r}: borrowed "
            "rows come from the leader, not the master"
        )
    shared = _CachedSource(source)
    scale = float(getattr(model, "scale", model.shape.head_dim**-0.5))
    return [CascadeHook(req, shared, scale, model.rope.inv_freq, backend) for req in requests]


class CascadeHook:
    """`AttentionHook` of one request: ``(layer, q [n, H, D], layer_k / layer_v [T, Hkv, D],
    q_positions [n]) → [n, H, D]`` in ``q.dtype``; keys of ``layer_k`` are at positions 0..T-1."""

    def __init__(
        self,
        request: BlendRequest,
        source: SegmentSource,
        scale: float,
        inv_freq: torch.Tensor,
        backend: CascadeBackend = "auto",
    ) -> None:
        self.request, self.source, self.scale = request, source, scale
        self.inv_freq, self.backend = inv_freq, backend

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        layer_k: torch.Tensor,
        layer_v: torch.Tensor,
        q_positions: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = layer_k.shape[0]
        computed = torch.zeros(num_tokens, dtype=torch.bool)
        computed[q_positions] = True
        unique = torch.ones(num_tokens, dtype=torch.bool)
        segments: list[SharedSegment] = []
        replaced: list[torch.Tensor | None] = []
        offsets: list[int | None] = []
        for use in self.request.uses:
            rows = computed[use.start : use.end]
            unique[use.start : use.end] = rows
            if bool(rows.all()):  # every row recomputed: nothing left to share
                continue
            k, v = self.source.layer_kv(use.segment_id, layer)
            segments.append(SharedSegment(k, v, self.source.positions(use.segment_id)))
            replaced.append(rows.clone())
            offsets.append(use.start)
        # One sibling, one entry per use: a segment used twice appears twice (two offsets).
        kv_rows = unique.nonzero().squeeze(1)
        sibling = Sibling(
            q, q_positions, offsets, replaced, layer_k[kv_rows], layer_v[kv_rows], kv_rows
        )
        return cascade_attention([sibling], segments, self.scale, self.inv_freq, self.backend)[0]


class _CachedSource:
    """A `SegmentSource` that reads each (segment, layer) once and keeps only the newest layer."""

    def __init__(self, inner: SegmentSource) -> None:
        self.inner = inner
        self.layer = -1
        self.cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self, segment_id: str) -> torch.Tensor:
        return self.inner.positions(segment_id)

    def layer_kv(self, segment_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer != self.layer:  # sequential schedule revisits layers: keep memory bounded
            self.layer, self.cache = layer, {}
        if segment_id not in self.cache:
            self.cache[segment_id] = self.inner.layer_kv(segment_id, layer)
        return self.cache[segment_id]
