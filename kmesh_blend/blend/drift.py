"""Drift correction: shift a segment's stale rows by what its recomputed rows show.

A reused segment's stored KV was computed after another prefix than the one it now follows; the
new context moves every row of it (its *drift*). Selection recomputes the rows that moved most
and leaves the rest stale. The recomputed rows measure the drift: at every layer, fresh minus
stored over a segment's recomputed rows gives a mean shift per KV head, which the stale rows of
that segment receive too — keys in RoPE's unrotated frame (the shift is a property of the
content, not of the position), rotated to each stale row's own position.

The recomputed rows are the ones that moved *most*, so their mean overstates the stale rows'.
How much is measured, not assumed: at a check layer every candidate row is still fresh, so the
rows kept and the rows dropped both show their drift. Per segment and KV head, the share of the
kept rows' mean shift that the dropped rows share is ``α = ⟨m_dropped, m_kept⟩ / ‖m_kept‖²``,
clamped to [0, 1]; later layers shift stale rows by ``α · m_kept``. The last check layer's α
holds until the end (it is the closest to the layers it corrects).

Nothing changes where a request computes every row (ratio 1.0: bit-exact), where no check layer
runs (ratio 0, the start-of-segment rule alone) or for rows a request borrows (exact prefix
cache rows, a collective leader's rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kmesh_blend.blend.plan import SegmentUse
from kmesh_blend.models.rope import RotaryEmbedding, Rotation
from kmesh_blend.ops import drift_means, shift_rows

__all__ = ["DriftCorrection"]


class DriftCorrection:
    """One request's drift estimate. Call `calibrate` at each check layer, `apply` at every layer
    whose KV holds stale rows of the request's own.

    ``positions``: [T] int64 the request's token positions; ``own``: [T] bool the reused rows
    this request computes or leaves stale itself (not borrowed); ``uses``: its segment spans.
    """

    def __init__(
        self, rope: RotaryEmbedding, positions: torch.Tensor, own: torch.Tensor,
        uses: tuple[SegmentUse, ...],
    ) -> None:  # fmt: skip
        self.rope, self.positions, self.own = rope, positions, own
        self.spans = [(u.start, u.end) for u in uses]
        # span start → (α_k, α_v), each [Hkv, 1] fp32
        self.alphas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.shifted_rows = 0  # stale rows shifted, summed over layers
        self.last_rows = 0  # stale rows shifted in the latest layer
        # Each use's own rows and their rotation: the request's, made at the first plan.
        self._ranges: list[_OwnRange] | None = None
        # Per computed set (the executor keeps one tensor from a check layer to the next): the
        # rotation back to position 0 of its rows, and which of each use's own rows it holds.
        self._plan_for: torch.Tensor | None = None
        self._back: Rotation | None = None
        self._spans: list[_SpanPlan] = []

    @torch.no_grad()
    def calibrate(
        self, computed: torch.Tensor, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
        stored_k: torch.Tensor, stored_v: torch.Tensor, keep: torch.Tensor,
    ) -> None:  # fmt: skip
        """Measure α at a check layer.

        ``computed``: [n] int64 rows computed before the cut; ``fresh_k`` / ``fresh_v``: their
        [n, Hkv, D] fresh rows (keys rotated at their positions); ``stored_k`` / ``stored_v``:
        the stored rows of the same tokens [n, Hkv, D], re-positioned; ``keep``: [n'] int64
        indices into ``computed`` that stay computed.
        """
        back = self._back_for(computed, fresh_k.device)
        kept = torch.zeros(computed.numel(), dtype=torch.bool)
        kept[keep] = True
        rows = (fresh_k, stored_k, fresh_v, stored_v, *back)
        for span in self._spans:
            a, b = (span.inside & kept).nonzero(), (span.inside & ~kept).nonzero()
            if a.numel() and b.numel():
                mk_a, mv_a = drift_means(*rows, a.squeeze(1).to(fresh_k.device))
                mk_b, mv_b = drift_means(*rows, b.squeeze(1).to(fresh_k.device))
                self.alphas[span.own.start] = (_share(mk_a, mk_b), _share(mv_a, mv_b))

    @torch.no_grad()
    def apply(
        self, computed: torch.Tensor, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
        stored_k: torch.Tensor, stored_v: torch.Tensor, layer_k: torch.Tensor,
        layer_v: torch.Tensor,
    ) -> None:  # fmt: skip
        """Shift the own rows of ``layer_k`` / ``layer_v`` [T, Hkv, D] (in place), *before* the
        caller writes the computed rows over them: every own row of a segment use is shifted (one
        contiguous range, no gather), and the computed ones are then overwritten.

        ``computed``: [n] int64 rows computed in this layer, ``fresh_*`` their rows and
        ``stored_*`` the stored rows of the same tokens, each [n, Hkv, D].
        """
        self.last_rows = 0
        if not self.alphas:
            return
        back = self._back_for(computed, fresh_k.device)
        for span in self._spans:
            alphas = self.alphas.get(span.own.start)
            if alphas is None or span.stale == 0 or not span.rows.numel():
                continue
            inside = span.rows.to(fresh_k.device)
            mean_k, mean_v = drift_means(fresh_k, stored_k, fresh_v, stored_v, *back, inside)
            shift_k = alphas[0] * mean_k  # [Hkv, D] fp32, unrotated
            shift_v = alphas[1] * mean_v
            rows = slice(span.own.first, span.own.last)
            turn = span.own.turn
            if turn.cos.device != layer_k.device:
                turn = span.own.turn = Rotation(*(t.to(layer_k.device) for t in turn))
            # rotated to each row's position and added in fp32, rounded once (one pass on CPU)
            shift_rows(layer_k[rows], layer_v[rows], shift_k, shift_v, *turn)
            self.shifted_rows += span.stale
            self.last_rows += span.stale

    def _back_for(self, computed: torch.Tensor, device: torch.device) -> Rotation:
        """The rotation of the computed rows back to position 0 ([n, D] fp32 tables); the plan
        for this computed set made first."""
        if computed is not self._plan_for:
            self._plan(computed)
        back = self._back
        assert back is not None
        if back.cos.device != device:  # the model's device (CUDA); positions stay on CPU
            back = self._back = Rotation(*(t.to(device) for t in back))
        return back

    def _plan(self, computed: torch.Tensor) -> None:
        if self._ranges is None:
            self._ranges = self._own_ranges()
        self._plan_for = computed
        self._back = self.rope.tables(-self.positions[computed], torch.float32)
        own_computed = self.own[computed]
        self._spans = []
        for own in self._ranges:
            inside = own_computed & (computed >= own.first) & (computed < own.last)
            stale = own.last - own.first - int(inside.sum())
            self._spans.append(_SpanPlan(own, inside, inside.nonzero().squeeze(1), stale))

    def _own_ranges(self) -> list[_OwnRange]:
        out = []
        for start, end in self.spans:
            # A use's own rows are one range: all of it, or what follows an exact prefix.
            own = self.own[start:end].nonzero().squeeze(1)
            if own.numel() == 0:
                continue
            first, last = start + int(own[0]), start + int(own[-1]) + 1
            if last - first != own.numel():
                raise ValueError(f"segment use [{start}, {end}): its own rows are not one range")
            turn = self.rope.tables(self.positions[first:last], torch.float32)
            out.append(_OwnRange(start, first, last, turn))
        return out


@dataclass
class _OwnRange:
    """A segment use (starting at ``start``) and its own rows [first, last); ``turn``: the
    rotation to their positions, fp32 (moved to the KV's device at first use)."""

    start: int
    first: int
    last: int
    turn: Rotation


class _SpanPlan(NamedTuple):
    """A use's own rows under one computed set: ``inside`` [n] bool, which computed rows are
    among them; ``stale``: how many of them are not computed."""

    own: _OwnRange
    inside: torch.Tensor
    rows: torch.Tensor  # [m] int64: where ``inside`` is True
    stale: int


def _share(m_kept: torch.Tensor, m_dropped: torch.Tensor) -> torch.Tensor:
    """[Hkv, 1] fp32 in [0, 1]: the projection of the dropped rows' mean shift ``m_dropped`` on
    the kept rows' ``m_kept`` (each [Hkv, D] fp32)."""
    norm = m_kept.pow(2).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    return ((m_kept * m_dropped).sum(-1) / norm).clamp(0.0, 1.0)[:, None]
