"""Group recomputation of sibling requests: schedules and selection modes.

Schedules (``BlendOptions.schedule``):
- ``sequential``: one request at a time, all its layers; each request reads its segments itself.
- ``layer_sync``: layer l for every sibling before layer l+1; each shared segment's stored layer
  is read once for the group and re-positioned for every sibling in one launch.

Selection (``BlendOptions.selection``):
- ``per_request``: every request selects and recomputes its own tokens. The per-request math is
  the same in both schedules, so results are bit-identical between them.
- ``collective`` (TokenDance-style): the first sibling that uses a segment (its leader) selects
  that segment's tokens and recomputes them in its own context; the other siblings compute only
  their private tokens and take the segment's layer KV from the leader, re-positioned to their
  own offsets. Much cheaper for large groups; its quality is measured against ``per_request``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

import torch

from kmesh_blend.blend.executor import AttentionHook, BlendResult, GroupAttention, RequestBlend
from kmesh_blend.blend.plan import BlendOptions, BlendRequest, SegmentUse
from kmesh_blend.blend.source import SegmentSource
from kmesh_blend.models.layerwise import LayerwiseModel
from kmesh_blend.ops import reposition_keys

__all__ = ["blend_group", "blend_one"]


def blend_one(
    model: LayerwiseModel, request: BlendRequest, source: SegmentSource, options: BlendOptions
) -> BlendResult:
    """Blend a single request (a group of one)."""
    return blend_group(model, [request], source, options)[0]


@torch.no_grad()
def blend_group(
    model: LayerwiseModel,
    requests: Sequence[BlendRequest],
    source: SegmentSource,
    options: BlendOptions,
    attention: Sequence[AttentionHook | None] | None = None,
    group_attention: GroupAttention | None = None,
) -> list[BlendResult]:
    """Prefill ``requests`` reusing the stored segments of ``source``; results in input order.

    ``attention``: optional per-request attention hooks (see `RequestBlend`).
    ``group_attention``: optional attention of a whole wave of members in one call (layer_sync
    passes every sibling of the layer at once, sequential one at a time); exclusive with
    ``attention``."""
    if attention is not None and group_attention is not None:
        raise ValueError("pass either attention (per request) or group_attention, not both")
    group = _Group(model, list(requests), source, options, attention)
    group.group_attention = group_attention
    num_layers = model.shape.num_layers
    if options.schedule == "sequential":
        for i in range(len(requests)):
            for layer in range(num_layers):
                group.step(layer, [i])
    elif options.schedule == "layer_sync":
        for layer in range(num_layers):
            group.step(layer, list(range(len(requests))))
    else:
        raise ValueError(f"schedule={options.schedule!r}; valid: 'layer_sync', 'sequential'")
    return [state.finish() for state in group.states]


class _Group:
    def __init__(
        self,
        model: LayerwiseModel,
        requests: list[BlendRequest],
        source: SegmentSource,
        options: BlendOptions,
        attention: Sequence[AttentionHook | None] | None = None,
    ) -> None:
        if options.selection not in ("per_request", "collective"):
            raise ValueError(f"selection={options.selection!r}; valid: 'per_request', 'collective'")
        self.model, self.requests, self.source, self.options = model, requests, source, options
        self.group_attention: GroupAttention | None = None
        self._shift_memo: dict[tuple[object, ...], torch.Tensor] = {}
        self.outside = [_outside_spans(req) for req in requests]
        collective = options.selection == "collective"
        # segment id → (request index, use) of its first user: the leader in collective mode.
        self.leader: dict[str, tuple[int, SegmentUse]] = {}
        for i, req in enumerate(requests):
            for use in req.uses:
                self.leader.setdefault(use.segment_id, (i, use))
        self.states = []
        for i, req in enumerate(requests):
            borrowed = torch.zeros(req.token_ids.numel(), dtype=torch.bool)
            for use in self._borrowed_uses(i) if collective else []:
                borrowed[use.start : use.end] = True
            borrowed[: req.exact_prefix] = True  # exact KV: read, never computed
            hook = attention[i] if attention is not None else None
            self.states.append(RequestBlend(model, req, options, borrowed, collective, hook))

    def _borrowed_uses(self, i: int) -> list[SegmentUse]:
        return [u for u in self.requests[i].uses if self.leader[u.segment_id][0] != i]

    def step(self, layer: int, members: list[int]) -> None:
        """Run ``layer`` for ``members``; each wave reads every segment layer once for all.

        A member that borrows rows from a leader waits for a later wave, after the leader has run
        this layer (one wave unless the selection is collective).
        """
        pending = list(members)
        while pending:
            wave = [i for i in pending if self._leaders_done(i, layer)]
            if not wave:
                raise RuntimeError(f"layer {layer}: circular leader dependency in {pending}")
            frames = self._stored_frames(layer, [i for i in wave if self._needs_stored(i, layer)])
            inputs = [self.states[i].begin(layer, *frames.get(i, (None, None))) for i in wave]
            if self.group_attention is not None:
                outputs = self.group_attention(layer, wave, inputs)
            else:
                pairs = zip(wave, inputs, strict=True)
                outputs = [self.states[i].attend(layer, x) for i, x in pairs]
            for i, out in zip(wave, outputs, strict=True):
                self.states[i].end(layer, out)
            pending = [i for i in pending if i not in wave]

    def _leaders_done(self, i: int, layer: int) -> bool:
        if self.options.selection != "collective":
            return True
        leaders = {self.leader[u.segment_id][0] for u in self._borrowed_uses(i)}
        return all(len(self.states[j].keys) > layer for j in leaders)

    def _needs_stored(self, i: int, layer: int) -> bool:
        state = self.states[i]
        return bool(self.requests[i].uses) and (
            not state.computes_everything or layer in state.checks
        )

    def _stored_frames(
        self, layer: int, members: list[int]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """This layer's stored KV in each member's frame: {i: (k, v) each [T_i, Hkv, D]}."""
        # Which rows each segment (or leader copy) must provide, grouped so each is read once.
        wanted: dict[tuple[str, bool], list[tuple[int, SegmentUse]]] = defaultdict(list)
        collective = self.options.selection == "collective"
        for i in members:
            for use in self.requests[i].uses:
                from_leader = collective and self.leader[use.segment_id][0] != i
                wanted[(use.segment_id, from_leader)].append((i, use))
        frames: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        shape = self.model.shape
        for i in members:
            # Every row is written below or computed by the request; only rows outside any
            # segment (computed anyway) are zeroed, so a check layer never scores stale memory.
            t = self.requests[i].token_ids.numel()
            k_frame = torch.empty(t, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
            v_frame = torch.empty_like(k_frame)
            for span in self.outside[i]:
                k_frame[span], v_frame[span] = 0.0, 0.0
            frames[i] = (k_frame, v_frame)
        for (segment_id, from_leader), users in wanted.items():
            k, v, positions = self._read(segment_id, layer, from_leader)
            shifts = self._shifts(segment_id, from_leader, users, positions)
            if len(users) == 1:  # one user: rotate straight into its frame
                i, use = users[0]
                span = slice(use.start, use.end)
                reposition_keys(
                    k, shifts, self.model.rope.inv_freq, self.options.backend, frames[i][0][span]
                )
                frames[i][1][span] = v
                continue
            moved = reposition_keys(
                k.repeat(len(users), 1, 1),
                shifts,
                self.model.rope.inv_freq,
                self.options.backend,
            )
            offset = 0
            for i, use in users:
                n = use.end - use.start
                frames[i][0][use.start : use.end] = moved[offset : offset + n]
                frames[i][1][use.start : use.end] = v
                offset += n
        return frames

    def _shifts(
        self, segment_id: str, from_leader: bool, users: list[tuple[int, SegmentUse]],
        positions: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """[rows] int64 position shifts (new − stored) for ``users`` of a segment; the same tensor
        for every layer, so the rotation tables built for it are reused."""
        key = (segment_id, from_leader, tuple(users))
        if key not in self._shift_memo:
            new = torch.cat([torch.arange(u.start, u.end) for _, u in users])
            self._shift_memo[key] = new - positions.repeat(len(users))
        return self._shift_memo[key]

    def _read(
        self, segment_id: str, layer: int, from_leader: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, positions) of a segment's layer: from the store, or from its leader's result."""
        if from_leader:
            i, use = self.leader[segment_id]
            state = self.states[i]
            if len(state.keys) <= layer:
                raise RuntimeError(f"leader of {segment_id!r} has not run layer {layer} yet")
            span = slice(use.start, use.end)
            return (
                state.keys[layer][span],
                state.values[layer][span],
                torch.arange(use.start, use.end),
            )
        k, v = self.source.layer_kv(segment_id, layer)
        positions = self.source.positions(segment_id)
        if k.shape[0] != positions.numel():
            raise ValueError(
                f"segment {segment_id!r}: {k.shape[0]} rows, {positions.numel()} positions"
            )
        return k, v, positions


def _outside_spans(request: BlendRequest) -> list[slice]:
    """Spans of ``request``'s tokens that no segment covers (private and gap tokens)."""
    covered = request.reused_mask
    edges = torch.nonzero(covered[1:] != covered[:-1]).squeeze(1) + 1
    bounds = [0, *edges.tolist(), covered.numel()]
    return [slice(a, b) for a, b in itertools.pairwise(bounds) if not bool(covered[a])]
