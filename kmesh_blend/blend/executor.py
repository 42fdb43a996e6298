"""Selective recomputation (CacheBlend-style) of one request, one layer at a time.

`RequestBlend` holds one request's state between layers, so the group scheduler can run layer l
for every sibling before layer l+1. Per layer it:
1. projects q/k/v for the tokens it currently computes and rotates them to their new positions;
2. at a check layer, scores those reused tokens by the deviation of fresh from stored KV and
   keeps the top share (private/gap tokens, the first ``sink_tokens`` of every segment and the
   last prompt token are always kept); with drift correction on, it also measures how far the
   rows it drops moved (`kmesh_blend.blend.drift`);
3. builds the layer's KV for all T tokens — fresh rows where computed, re-positioned stored rows
   elsewhere (shifted by the estimated drift when it is on) — and lets the computed tokens attend
   over it causally;
4. finishes the layer (o-proj + MLP) for the computed tokens only.

Ratio 1.0 computes every token in every layer with the same shapes as `prefill`: bit-identical.
Ratio 0 computes only private tokens, the segments' sink tokens and the last token: plain reuse
when ``sink_tokens`` is 0, the start-of-segment rule otherwise (no check layer runs).

Everything a request computes depends only on its own tensors, with shapes that do not depend on
its siblings, so a group gives the same bits in any schedule (CPU GEMMs are not batch-invariant).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kmesh_blend.blend.drift import DriftCorrection
from kmesh_blend.blend.plan import BlendOptions, BlendRequest, check_ratios, keep_count, select_top
from kmesh_blend.models.layerwise import LayerwiseModel, causal_mask
from kmesh_blend.ops import token_deviation

__all__ = ["AttentionHook", "AttentionInput", "BlendResult", "GroupAttention", "RequestBlend"]

# (layer, q [n, H, D] rotated, layer K / V [T, Hkv, D], q positions [n] ascending) → [n, H, D]:
# causal attention of the computed tokens over the layer's KV, when a caller (the vLLM worker)
# runs it on another kernel than the model's own `attend`.
AttentionHook = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class AttentionInput(NamedTuple):
    """What one request's layer hands to attention: q [n, H, D] rotated at ``positions`` [n]
    int64 ascending (the computed tokens), and the layer's full KV ``layer_k`` / ``layer_v``
    [T, Hkv, D] (keys at positions 0..T-1)."""

    q: torch.Tensor
    layer_k: torch.Tensor
    layer_v: torch.Tensor
    positions: torch.Tensor


# (layer, member indices into the group, their inputs) → per member [n_i, H, D]: attention of a
# whole wave of siblings in one call, so a shared segment can be read once for the group.
GroupAttention = Callable[[int, Sequence[int], Sequence[AttentionInput]], list[torch.Tensor]]


class BlendResult(NamedTuple):
    """The blended prefill of one request.

    keys / values: per layer [T, Hkv, D] (keys rotated at positions 0..T-1), what the paged KV
    cache must hold. logits: [1, vocab] fp32 of the last prompt token (None when the request
    wants no output or no logits: `BlendRequest.output`, `.logits`). recomputed: [T] bool,
    reused tokens that were recomputed through the last layer. last_state: the last layer's
    output of the prompt's last m tokens, [m, ...] in the model's state format (what its final
    norm and LM head read; the vLLM worker hands it to vLLM's sampler in place of vLLM's own):
    the run of computed tokens that ends the prompt, m ≥ 1 (m = 1 also when the last token was
    not computed: then the last computed token's).
    drift_rows: with drift correction on, the stale rows it shifted in the last layer (0: it
    had nothing to measure or shift); None when it was off or no check layer ran (ratio 0
    or 1.0).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor | None
    recomputed: torch.Tensor
    num_reused: int
    num_recomputed: int
    last_state: torch.Tensor
    drift_rows: int | None = None

    def report_fields(self) -> dict[str, int]:
        """The counts a request's report carries about its blend."""
        fields = {"reused_tokens": int(self.num_reused),
                  "recomputed_tokens": int(self.num_recomputed)}  # fmt: skip
        return (
            fields if self.drift_rows is None else {**fields, "drift_shifted_rows": self.drift_rows}
        )


class RequestBlend:
    """Per-request blend state. For layers 0..L-1 in order call `begin`, attention (`attend`, or a
    group's), `end`; then `finish`.

    ``borrowed``: [T] bool, reused tokens this request never computes itself (collective mode:
    their rows come from the segment's leader; an exact prefix: from vLLM's prefix cache).
    ``per_segment``: select the top share within each segment instead of across all reused
    tokens. ``attention``: run attention through this hook instead of ``model.attend``.
    """

    def __init__(
        self,
        model: LayerwiseModel,
        request: BlendRequest,
        options: BlendOptions,
        borrowed: torch.Tensor | None = None,
        per_segment: bool = False,
        attention: AttentionHook | None = None,
    ) -> None:
        options.validate_for(model.shape.num_layers)
        self.model, self.request, self.options = model, request, options
        self.attention = attention
        num_tokens = request.token_ids.numel()
        self.positions = torch.arange(num_tokens, dtype=torch.int64)
        self.reused = request.reused_mask
        own = self.reused.clone() if borrowed is None else self.reused & ~borrowed
        sinks = self._sinks(own, options.sink_tokens)
        self.always = ~self.reused | sinks  # private and gap tokens, and segments' first tokens
        self.always[-1] = request.output  # the last prompt token's logits are the output
        self.num_reused = int(self.reused.sum()) - request.exact_prefix  # segments' tokens only
        ratio = options.recompute_ratio
        ranked = own & ~sinks  # what the deviation ranking chooses from
        if ratio >= 1.0 or (ratio > 0.0 and bool(ranked.any())):
            self.checks = self._check_plan(ranked, per_segment) if ratio < 1.0 else {}
            computed = self.always | own
        else:  # ratio 0, or nothing of our own to select from: plain reuse
            self.checks = {}
            computed = self.always.clone()
        self.computed = computed.nonzero().squeeze(1)  # [n] int64, ascending
        self.drift = (
            DriftCorrection(model.rope, self.positions, own, request.uses)
            if options.drift_correction == "auto" and self.checks
            else None
        )
        self._pos_for, self._pos = self.computed, self.positions[self.computed]
        self.hidden = model.embed(request.token_ids[self.computed])
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._pending: AttentionInput | None = None

    @property
    def computes_everything(self) -> bool:
        return self.computed.numel() == self.positions.numel()

    @torch.no_grad()
    def begin(
        self, layer: int, stored_k: torch.Tensor | None, stored_v: torch.Tensor | None
    ) -> AttentionInput:
        """First half of a layer: project, rotate, select at a check layer, build the layer's KV.

        ``stored_k`` / ``stored_v``: [T, Hkv, D], this layer's stored KV already re-positioned to
        this request's positions (rows of unreused tokens are ignored), or None when the request
        computes every token in this layer. The call takes ownership of them: computed rows are
        written into them and they become the layer's KV. Follow with `end` for the same layer.
        """
        if self._pending is not None or layer != len(self.keys):
            raise RuntimeError(f"begin({layer}) out of order: {len(self.keys)} layers done")
        m = self.model
        q, k, v = m.project_qkv(layer, self.hidden)
        pos = self._computed_positions()
        q, k = m.rotate_qk(layer, q, k, pos)
        if layer in self.checks and stored_k is not None and stored_v is not None:
            keep = self._select(layer, k, v, stored_k, stored_v)
            if self.drift is not None:
                self.drift.calibrate(self.computed, k, v, stored_k[self.computed],
                                     stored_v[self.computed], keep)  # fmt: skip
            q, k, v, self.hidden = q[keep], k[keep], v[keep], self.hidden[keep]
            self.computed = self.computed[keep]
            pos = self._computed_positions()
        if self.computes_everything:
            layer_k, layer_v = k, v
        else:
            if stored_k is None or stored_v is None:
                raise ValueError(f"layer {layer}: stored KV is required for reused tokens")
            layer_k, layer_v = stored_k, stored_v  # the frames are ours to fill (see `begin`)
            if self.drift is not None:  # shifts own rows; the computed ones are overwritten next
                stored = (layer_k[self.computed], layer_v[self.computed])
                self.drift.apply(self.computed, k, v, *stored, layer_k, layer_v)
            layer_k[self.computed], layer_v[self.computed] = k, v
        self._pending = AttentionInput(q, layer_k, layer_v, pos)
        return self._pending

    def attend(self, layer: int, inp: AttentionInput) -> torch.Tensor:
        """Causal attention of ``inp``'s queries over its layer KV: [n, H, D] model dtype."""
        if self.attention is not None:
            return self.attention(layer, inp.q, inp.layer_k, inp.layer_v, inp.positions)
        mask = causal_mask(inp.positions, self.positions)
        return self.model.attend(inp.q, inp.layer_k, inp.layer_v, mask)

    @torch.no_grad()
    def end(self, layer: int, attn: torch.Tensor) -> None:
        """Second half of a layer: o-proj + MLP of the computed tokens on ``attn`` [n, H, D]."""
        inp = self._pending
        if inp is None or layer != len(self.keys):
            raise RuntimeError(f"end({layer}) without begin({layer})")
        if attn.shape != inp.q.shape:
            raise ValueError(f"layer {layer}: attention output {attn.shape}, want {inp.q.shape}")
        self.hidden = self.model.finish_layer(layer, self.hidden, attn)
        self.keys.append(inp.layer_k)
        self.values.append(inp.layer_v)
        self._pending = None

    @torch.no_grad()
    def finish(self) -> BlendResult:
        if len(self.keys) != self.model.shape.num_layers:
            raise RuntimeError(f"finish() after {len(self.keys)} of {self.model.shape.num_layers}")
        recomputed = torch.zeros_like(self.reused)
        recomputed[self.computed] = True
        recomputed &= self.reused
        # The computed tokens that end the prompt: from the last, each one position before the
        # next (ascending and distinct, so the gap to the prompt's end never shrinks).
        gaps = self.positions.numel() - 1 - self.computed.flip(0)
        run = int((gaps == torch.arange(gaps.numel())).sum())
        last = self.hidden[-max(1, run) :]
        wanted = self.request.output and self.request.logits
        logits = self.model.logits(last[-1:]) if wanted else None
        drift = None if self.drift is None else self.drift.last_rows
        return BlendResult(self.keys, self.values, logits, recomputed, self.num_reused,
                           int(recomputed.sum()), last, drift)  # fmt: skip

    # --- helpers --------------------------------------------------------------------------------

    def _computed_positions(self) -> torch.Tensor:
        """[n] positions of the computed tokens; the same tensor until the set changes, so the
        rotary tables computed for it are reused across layers."""
        if self._pos_for is not self.computed:
            self._pos_for = self.computed
            self._pos = self.positions[self.computed]
        return self._pos

    def _check_plan(self, own: torch.Tensor, per_segment: bool) -> dict[int, list[tuple]]:
        """Check layer → list of (candidate mask [T] bool, tokens to keep) groups."""
        groups = [own & self._span_mask(u.start, u.end) for u in self.request.uses]
        if not per_segment:
            groups = [own]
        ratios = check_ratios(self.options.recompute_ratio, len(self.options.check_layers))
        return {
            layer: [(g, keep_count(r, int(g.sum()))) for g in groups if bool(g.any())]
            for layer, r in zip(self.options.check_layers, ratios, strict=True)
        }

    def _sinks(self, own: torch.Tensor, count: int) -> torch.Tensor:
        """[T] bool: the first ``count`` tokens of every segment use that this request computes
        itself (``own``); a use cut by an exact prefix starts where the cut left it."""
        sinks = torch.zeros_like(own)
        if count <= 0:
            return sinks
        for use in self.request.uses:
            rows = own[use.start : use.end].nonzero().squeeze(1)[:count] + use.start
            sinks[rows] = True
        return sinks

    def _span_mask(self, start: int, end: int) -> torch.Tensor:
        mask = torch.zeros_like(self.reused)
        mask[start:end] = True
        return mask

    def _select(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        stored_k: torch.Tensor,
        stored_v: torch.Tensor,
    ) -> torch.Tensor:
        """Rows of the computed set to keep after this check layer: [n'] int64 into computed."""
        score = self._score(k, v, stored_k, stored_v)
        keep = self.always[self.computed].clone()
        for candidates, count in self.checks[layer]:
            rows = candidates[self.computed].nonzero().squeeze(1)
            keep[rows[select_top(score[rows], count)]] = True
        return keep.nonzero().squeeze(1)

    def _score(
        self, k: torch.Tensor, v: torch.Tensor, stored_k: torch.Tensor, stored_v: torch.Tensor
    ) -> torch.Tensor:
        """[n] fp32 rank of the computed tokens at a check layer (higher: recompute first): the
        deviation of their fresh k/v [n, Hkv, D] from the stored rows [T, Hkv, D]."""
        kind = self.options.deviation
        backend = self.options.backend
        score = torch.zeros(self.computed.numel(), dtype=torch.float32)
        if kind in ("k", "kv"):
            score += token_deviation(k, stored_k[self.computed], backend)
        if kind in ("v", "kv"):
            score += token_deviation(v, stored_v[self.computed], backend)
        return self.model.combine_scores(score)
