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

import torch

from kmesh_blend.blend.plan import SegmentUse
from kmesh_blend.models.rope import RotaryEmbedding

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
        self.shifted_rows = 0

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
        dk, dv = self._deltas(computed, fresh_k, fresh_v, stored_k, stored_v)
        kept = torch.zeros(computed.numel(), dtype=torch.bool)
        kept[keep] = True
        own = self.own[computed]
        for start, end in self.spans:
            inside = own & (computed >= start) & (computed < end)
            a, b = inside & kept, inside & ~kept
            if bool(a.any()) and bool(b.any()):
                self.alphas[start] = (_share(dk[a], dk[b]), _share(dv[a], dv[b]))

    @torch.no_grad()
    def apply(
        self, computed: torch.Tensor, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
        stored_k: torch.Tensor, stored_v: torch.Tensor, layer_k: torch.Tensor,
        layer_v: torch.Tensor,
    ) -> None:  # fmt: skip
        """Shift the stale own rows of ``layer_k`` / ``layer_v`` [T, Hkv, D] (in place).

        ``computed``: [n] int64 rows computed in this layer, ``fresh_*`` their rows and
        ``stored_*`` the stored rows of the same tokens, each [n, Hkv, D].
        """
        if not self.alphas:
            return
        dk, dv = self._deltas(computed, fresh_k, fresh_v, stored_k, stored_v)
        is_computed = torch.zeros_like(self.own)
        is_computed[computed] = True
        stale_all = self.own & ~is_computed
        own_computed = self.own[computed]
        for start, end in self.spans:
            alphas = self.alphas.get(start)
            if alphas is None:
                continue
            inside = own_computed & (computed >= start) & (computed < end)
            stale = stale_all[start:end].nonzero().squeeze(1) + start
            if not bool(inside.any()) or stale.numel() == 0:
                continue
            shift_k = (alphas[0] * dk[inside].mean(0)).expand(stale.numel(), -1, -1)
            shift_v = alphas[1] * dv[inside].mean(0)
            moved = self.rope.apply(shift_k.contiguous(), self.positions[stale])
            layer_k[stale] += moved.to(layer_k.dtype)
            layer_v[stale] += shift_v.to(layer_v.dtype)
            self.shifted_rows += stale.numel()

    def _deltas(
        self, computed: torch.Tensor, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
        stored_k: torch.Tensor, stored_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """fresh − stored, [n, Hkv, D] fp32: keys turned back to position 0 (unrotated)."""
        back = -self.positions[computed]
        dk = self.rope.apply((fresh_k.float() - stored_k.float()).contiguous(), back)
        return dk, fresh_v.float() - stored_v.float()


def _share(kept: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """[Hkv, 1] fp32 in [0, 1]: the projection of the dropped rows' mean shift on the kept rows'
    (``kept`` [a, Hkv, D], ``dropped`` [b, Hkv, D])."""
    m_kept, m_dropped = kept.mean(0), dropped.mean(0)
    norm = m_kept.pow(2).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    return ((m_kept * m_dropped).sum(-1) / norm).clamp(0.0, 1.0)[:, None]
