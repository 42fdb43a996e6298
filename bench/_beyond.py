"""The variants `bench/beyond_selection.py` measures: drift estimates, budgets and rankings, each
a small change to the served executor (`RequestBlend`) run on the same stale rows."""

from __future__ import annotations

from typing import Any

import torch

from kmesh_blend.blend import BlendOptions, BlendRequest, RequestBlend
from kmesh_blend.blend.drift import DriftCorrection
from kmesh_blend.blend.plan import check_ratios, keep_count
from kmesh_blend.models.rope import rotate

FIXED_ALPHA = 0.3
POSITION_BIN = 16


class FixedShare(DriftCorrection):
    """Drift correction with one share for every segment and head."""

    def calibrate(self, computed: Any, fresh_k: Any, fresh_v: Any, stored_k: Any, stored_v: Any,
                  keep: Any) -> None:  # fmt: skip
        super().calibrate(computed, fresh_k, fresh_v, stored_k, stored_v, keep)
        self.alphas = {s: (torch.full_like(a, FIXED_ALPHA), torch.full_like(b, FIXED_ALPHA))
                       for s, (a, b) in self.alphas.items()}  # fmt: skip


class OracleShift(DriftCorrection):
    """Stale rows shifted by their own true mean error (``full``: per layer (K, V) [T, Hkv, D]),
    per segment and KV head — or, with ``bin_size``, per run of ``bin_size`` positions from the
    segment's start: the best a drift model by position can do."""

    def __init__(self, full: list[tuple[torch.Tensor, torch.Tensor]], bin_size: int | None,
                 *args: Any) -> None:  # fmt: skip
        super().__init__(*args)
        self.full, self.bin_size, self.layer = full, bin_size, -1

    def apply(self, computed: Any, fresh_k: Any, fresh_v: Any, stored_k: Any, stored_v: Any,
              layer_k: torch.Tensor, layer_v: torch.Tensor) -> None:  # fmt: skip
        full_k, full_v = self.full[self.layer]
        is_computed = torch.zeros_like(self.own)
        is_computed[computed] = True
        for start, end in self.spans:
            step = self.bin_size or (end - start)
            for lo in range(start, end, step):
                hi = min(end, lo + step)
                stale = (self.own & ~is_computed)[lo:hi].nonzero().squeeze(1) + lo
                if stale.numel() == 0:
                    continue
                pos = self.positions[stale]
                dk = self.rope.apply((full_k[stale] - layer_k[stale]).float(), -pos).mean(0)
                moved = self.rope.apply(dk.expand(stale.numel(), -1, -1).contiguous(), pos)
                layer_k[stale] += moved.to(layer_k.dtype)
                layer_v[stale] += (full_v[stale] - layer_v[stale]).float().mean(0).to(layer_v.dtype)


class CalibratedMap(DriftCorrection):
    """Stale rows shifted by a model-level per-token map (`drift_predictability.calibrated_maps`:
    {layer: (K map, V map), each [Hkv, 2·D + 1, D]}) of each row's own deviation at the first
    check layer, where every candidate row is fresh (keys unrotated, then values, per head)."""

    def __init__(self, maps: dict[int, tuple[torch.Tensor, torch.Tensor]], *args: Any) -> None:
        super().__init__(*args)
        self.maps, self.layer, self.feat = maps, -1, None

    def calibrate(self, computed: Any, fresh_k: Any, fresh_v: Any, stored_k: Any, stored_v: Any,
                  keep: Any) -> None:  # fmt: skip
        if self.feat is None:
            back = self._back_for(computed, fresh_k.device)  # fresh − stored, keys unrotated
            dk = rotate(fresh_k.float() - stored_k.float(), back)
            dv = fresh_v.float() - stored_v.float()
            heads, dim = dk.shape[1], dk.shape[2]
            self.feat = torch.zeros(self.own.numel(), heads, 2 * dim)
            self.feat[computed] = torch.cat([dk, dv], -1)
            self.known = torch.zeros_like(self.own)
            self.known[computed] = True

    def apply(self, computed: Any, fresh_k: Any, fresh_v: Any, stored_k: Any, stored_v: Any,
              layer_k: torch.Tensor, layer_v: torch.Tensor) -> None:  # fmt: skip
        self.last_rows = 0
        if self.feat is None or self.layer not in self.maps:
            return
        stale = self.own & self.known
        stale[computed] = False
        rows = stale.nonzero().squeeze(1)
        x = self.feat[rows]
        wk, wv = self.maps[self.layer]
        dk = torch.einsum("mhf,hfo->mho", x, wk[:, :-1]) + wk[:, -1]
        dv = torch.einsum("mhf,hfo->mho", x, wv[:, :-1]) + wv[:, -1]
        layer_k[rows] += self.rope.apply(dk, self.positions[rows]).to(layer_k.dtype)
        layer_v[rows] += dv.to(layer_v.dtype)
        self.last_rows = rows.numel()
        self.shifted_rows += rows.numel()


class _QuerySpy:
    """The model, remembering the last rotated queries (for the query-aware ranking)."""

    def __init__(self, model: Any) -> None:
        self._model, self.q = model, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def rotate_qk(self, layer: int, q: Any, k: Any, positions: Any) -> Any:
        q, k = self._model.rotate_qk(layer, q, k, positions)
        self.q = q
        return q, k


class Variant(RequestBlend):
    """A request blend with a drift variant (``drift``), an adaptive budget (``mass``), a
    per-layer budget (``later``: {check layer after the usual ones: kept share}), a
    query-aware ranking (``query``) or the stale keys scaled by ``key_scale`` (attention
    temperature, APE). ``token_layers`` counts reused rows computed, summed over
    layers (the work a budget buys)."""

    def __init__(self, model: Any, request: BlendRequest, options: BlendOptions,
                 drift: Any = None, mass: float | None = None,
                 later: dict[int, float] | None = None, query: bool = False,
                 key_scale: float | None = None) -> None:  # fmt: skip
        self.later, self.key_scale = later or {}, key_scale
        if self.later:
            options = BlendOptions(recompute_ratio=options.recompute_ratio,
                                   check_layers=options.check_layers + tuple(self.later),
                                   drift_correction=options.drift_correction)  # fmt: skip
        spy = _QuerySpy(model) if query else None
        super().__init__(spy or model, request, options)
        self.spy, self.mass, self.token_layers = spy, mass, 0
        if drift is not None:
            self.drift = drift(model.rope, self.positions, self.reused.clone(), request.uses)
        ends = [u.end for u in request.uses]
        self.question = self.positions >= max(ends)  # the prompt's own text after the segments

    def begin(self, layer: int, stored_k: Any, stored_v: Any) -> Any:
        if isinstance(self.drift, (OracleShift, CalibratedMap)):
            self.drift.layer = layer
        inp = super().begin(layer, stored_k, stored_v)
        self.token_layers += int(self.reused[self.computed].sum())
        if self.key_scale is not None and not self.computes_everything:
            # APE-style temperature on the stale rows: q·(s k) = s (q·k), in every later read too
            stale = self.reused.clone()
            stale[self.computed] = False
            inp.layer_k[stale] *= self.key_scale
        return inp

    def _check_plan(self, own: torch.Tensor, per_segment: bool) -> dict[int, list[tuple]]:
        if not self.later:
            return super()._check_plan(own, per_segment)
        usual = self.options.check_layers[: -len(self.later)]
        ratios = check_ratios(self.options.recompute_ratio, len(usual)) + list(self.later.values())
        layers = usual + tuple(self.later)
        count = int(own.sum())
        return {c: [(own, keep_count(r, count))] for c, r in zip(layers, ratios, strict=True)}

    def _score(self, k: Any, v: Any, stored_k: Any, stored_v: Any) -> torch.Tensor:
        score = super()._score(k, v, stored_k, stored_v)
        layer = len(self.keys)
        if self.spy is not None:
            score = score * self._question_attention(self.spy.q, k)
        if self.mass is not None and layer == self.options.check_layers[0]:
            rows = self.checks[layer][0][0][self.computed]
            ranked = torch.sort(score[rows], descending=True).values
            need = int((ranked.cumsum(0) / ranked.sum() < self.mass).sum()) + 1
            ratio = max(self.options.recompute_ratio, need / ranked.numel())
            shares = check_ratios(ratio, len(self.options.check_layers))
            self.checks = {
                c: [(g, keep_count(share, int(g.sum()))) for g, _ in self.checks[c]]
                for c, share in zip(self.options.check_layers, shares, strict=True)
            }
        return score

    def _question_attention(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[n] fp32: the attention the question's queries pay each computed row at this layer
        (mean over the question's tokens and the heads), over the computed rows' fresh keys."""
        pos = self.positions[self.computed]
        asks = self.question[self.computed]
        qq = q[asks].float()  # [m, H, D]
        kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [n, H, D]
        logits = torch.einsum("mhd,nhd->hmn", qq, kk) / qq.shape[-1] ** 0.5
        logits.masked_fill_(pos[None, None, :] > pos[asks][None, :, None], float("-inf"))
        return logits.softmax(-1).mean((0, 1))
