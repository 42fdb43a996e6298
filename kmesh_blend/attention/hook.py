"""Consumer (a): the group recomputation's attention through cascade attention.

Two forms, both per-request selection only (in ``collective`` mode borrowed rows come from the
segment's leader, not from the master, so attending the master would be wrong; both refuse it):

- `CascadeGroupAttention` (``blend_group(..., group_attention=...)``): one `cascade_attention`
  call per layer for a whole wave of siblings — in ``layer_sync`` every sibling of the group — so
  each master segment's layer is read once and attended by the computed tokens of all siblings.
  Pass its `source` as the blend's source too: the frames the blend writes (the KV each sibling
  keeps) are then built from the same single read per segment and layer.
- `cascade_hooks` (``blend_group(..., attention=...)``): one hook per request; each request's
  call reads the masters for itself (one kernel read per layer *per request*), the hooks sharing
  a cache of the current layer's store reads.

In both, a request attends (1) every stored segment it uses, read as the master's own rows — the
tokens the request recomputed in a span are its replaced rows, masked out there — and (2) its
unique rows (private tokens + recomputed rows), merged exactly (log2-sum-exp).

Exactness, measured in tests/attention/test_hook.py (fp32 tiny Llamas, 4 layers):
- Not bit-exact with the model's own `attend`: shared rows are scored through rotated queries
  instead of re-positioned keys (logits within 1.3e-6 of the plain blend; tolerance 1e-5).
- `cascade_hooks`: bit-identical across schedules (each hook's math depends only on its request,
  with the same shapes in ``sequential`` and ``layer_sync``).
- `CascadeGroupAttention`: *not* guaranteed bit-identical across schedules — the shared level
  scores the queries of all siblings in one GEMM whose row count depends on the group, and CPU
  GEMMs are not batch-invariant (fp32 rows change bits with the row count below ~64 rows); the
  measured difference is printed by the test and bounded there (≤ 1e-5 on logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kmesh_blend.attention.cascade import SharedSegment, Sibling, cascade_attention
from kmesh_blend.attention.launch import CascadeBackend
from kmesh_blend.blend.executor import AttentionHook, AttentionInput
from kmesh_blend.blend.plan import BlendOptions, BlendRequest
from kmesh_blend.blend.source import SegmentSource
from kmesh_blend.models.layerwise import LayerwiseModel

__all__ = ["CascadeGroupAttention", "CascadeHook", "cascade_hooks"]


def cascade_hooks(
    model: LayerwiseModel,
    requests: Sequence[BlendRequest],
    source: SegmentSource,
    options: BlendOptions,
    backend: CascadeBackend = "auto",
) -> list[AttentionHook]:
    """One `CascadeHook` per request, sharing one cache of segment layer reads."""
    _check_per_request(options)
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
        inp = AttentionInput(q, layer_k, layer_v, q_positions)
        entries, sibling_of = _sibling(self.request, inp, self.source, layer)
        segments = [seg for _, seg in entries]
        sibling = sibling_of(list(range(len(entries))), len(entries))
        return cascade_attention([sibling], segments, self.scale, self.inv_freq, self.backend)[0]


class CascadeGroupAttention:
    """`GroupAttention` over cascade attention: ``(layer, members, inputs) → [n_i, H, D]``.

    One `cascade_attention` call per wave; a segment used by several members (or twice by one)
    is one `SharedSegment` per occurrence index, built from a single read of the store.
    """

    def __init__(
        self,
        model: LayerwiseModel,
        requests: Sequence[BlendRequest],
        source: SegmentSource,
        options: BlendOptions,
        backend: CascadeBackend = "auto",
    ) -> None:
        _check_per_request(options)
        self.requests = list(requests)
        self.source = _CachedSource(source)
        self.scale = float(getattr(model, "scale", model.shape.head_dim**-0.5))
        self.inv_freq, self.backend = model.rope.inv_freq, backend

    def __call__(
        self, layer: int, members: Sequence[int], inputs: Sequence[AttentionInput]
    ) -> list[torch.Tensor]:
        slot: dict[tuple[str, int], int] = {}  # (segment id, occurrence in a request) → level
        segments: list[SharedSegment] = []
        built = []
        for i, inp in zip(members, inputs, strict=True):
            entries, sibling_of = _sibling(self.requests[i], inp, self.source, layer)
            seen: dict[str, int] = {}
            levels = []
            for segment_id, seg in entries:
                key = (segment_id, seen.setdefault(segment_id, 0))
                seen[segment_id] += 1
                if key not in slot:
                    slot[key] = len(segments)
                    segments.append(seg)
                levels.append(slot[key])
            built.append((levels, sibling_of))
        siblings = [sibling_of(levels, len(segments)) for levels, sibling_of in built]
        return cascade_attention(siblings, segments, self.scale, self.inv_freq, self.backend)


def _check_per_request(options: BlendOptions) -> None:
    if options.selection != "per_request":
        raise ValueError(
            f"cascade attention needs selection='per_request', got {options.selection!r}: "
            "borrowed rows come from the leader, not the master"
        )


def _sibling(
    request: BlendRequest, inp: AttentionInput, source: SegmentSource, layer: int
) -> tuple[list[tuple[str, SharedSegment]], Callable[[list[int], int], Sibling]]:
    """One request's side of a cascade call.

    Returns its shared entries (segment id, master layer) in use order — uses whose rows were all
    recomputed are left out — and a builder that places them at the given level indices among
    ``n`` levels and returns the `Sibling`.
    """
    num_tokens = inp.layer_k.shape[0]
    computed = torch.zeros(num_tokens, dtype=torch.bool)
    computed[inp.positions] = True
    unique = torch.ones(num_tokens, dtype=torch.bool)
    entries: list[tuple[str, SharedSegment]] = []
    replaced: list[torch.Tensor] = []
    offsets: list[int] = []
    for use in request.uses:
        rows = computed[use.start : use.end]
        unique[use.start : use.end] = rows
        if bool(rows.all()):  # every row recomputed: nothing left to share
            continue
        k, v = source.layer_kv(use.segment_id, layer)
        entries.append((use.segment_id, SharedSegment(k, v, source.positions(use.segment_id))))
        replaced.append(rows.clone())
        offsets.append(use.start)
    kv_rows = unique.nonzero().squeeze(1)

    def sibling_of(levels: list[int], n: int) -> Sibling:
        offs: list[int | None] = [None] * n
        reps: list[torch.Tensor | None] = [None] * n
        for level, off, rep in zip(levels, offsets, replaced, strict=True):
            offs[level], reps[level] = off, rep
        return Sibling(
            inp.q, inp.positions, offs, reps, inp.layer_k[kv_rows], inp.layer_v[kv_rows], kv_rows
        )

    return entries, sibling_of


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
