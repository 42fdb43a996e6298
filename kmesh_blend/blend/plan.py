"""What to blend and how: requests with their segment spans, options, and token selection.

Plain Python/torch (no model, no vLLM): unit-testable in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kmesh_blend.config import (
    Deviation,
    Drift,
    KMeshConfig,
    Schedule,
    Selection,
)
from kmesh_blend.ops import Backend
from kmesh_blend.rules import DRIFTS, ratio_problem, sink_tokens_problem

__all__ = [
    "BlendOptions",
    "BlendRequest",
    "Deviation",
    "SegmentUse",
    "check_ratios",
    "keep_count",
    "select_top",
]


class SegmentUse(NamedTuple):
    """A stored segment placed at the half-open token span [start, end) of a prompt."""

    start: int
    end: int
    segment_id: str


@dataclass(frozen=True)
class BlendRequest:
    """One prompt to prefill: ``token_ids`` [T] int64 and its reused segment spans.

    Spans must be non-empty, sorted, non-overlapping and inside the prompt. Tokens outside every
    span (private and gap tokens) are always computed.

    ``exact_prefix``: the first tokens' stored KV is exact at their own positions (vLLM's prefix
    cache): they are never recomputed nor selected. When positive, ``uses[0]`` must span exactly
    [0, exact_prefix) and its source holds that KV.

    ``output``: the last token's output (logits, final state) is wanted, so that token is always
    computed. False for a blend that stops inside the prompt (vLLM's forward computes the tokens
    after it): the last token is then selected like any other and no logits are computed.
    ``logits``: with ``output``, compute the last token's logits too (False for a caller that
    samples from the result's final state itself, as the vLLM worker does through vLLM's
    sampler: a vocabulary-wide projection saved).
    """

    token_ids: torch.Tensor
    uses: tuple[SegmentUse, ...] = ()
    exact_prefix: int = 0
    output: bool = True
    logits: bool = True

    def __post_init__(self) -> None:
        t = self.token_ids
        if t.dim() != 1 or t.numel() == 0 or t.dtype != torch.int64:
            raise ValueError(f"token_ids must be a non-empty [T] int64 tensor, got {t.shape}")
        prev_end = 0
        for use in self.uses:
            if not (prev_end <= use.start < use.end <= t.numel()):
                raise ValueError(
                    f"segment span {use[:2]} must be non-empty, sorted, non-overlapping "
                    f"and within [0, {t.numel()}]"
                )
            prev_end = use.end
        if self.exact_prefix and (not self.uses or self.uses[0][:2] != (0, self.exact_prefix)):
            raise ValueError(f"exact_prefix={self.exact_prefix} needs uses[0] = [0, exact_prefix)")

    @property
    def reused_mask(self) -> torch.Tensor:
        """[T] bool: True for tokens covered by a stored segment."""
        mask = torch.zeros(self.token_ids.numel(), dtype=torch.bool)
        for use in self.uses:
            mask[use.start : use.end] = True
        return mask


@dataclass(frozen=True)
class BlendOptions:
    """How to blend (the executor's view of `KMeshConfig`).

    ``check_layers`` with one layer is the released CacheBlend code's scheme (select once);
    with several it is the paper's gradual filtering: the kept share shrinks at each check layer
    down to ``recompute_ratio`` at the last one (see `check_ratios`).

    ``sink_tokens``: the first tokens of every reused segment are recomputed in every layer like
    private tokens (the start-of-segment rule: the tokens whose attention the missing prefix
    distorts most); ``recompute_ratio`` then applies to the segment's other tokens. With ratio 0
    no check layer runs.

    ``drift_correction``: ``"auto"`` shifts the rows left stale by the drift their segment's
    recomputed rows show (`kmesh_blend.blend.drift`); ``"off"`` leaves them as stored. Off here
    (the plain CacheBlend primitive); the engine's setting, `KMeshConfig.drift_correction`,
    defaults to ``"auto"`` and reaches the blend through `from_config`.
    """

    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    sink_tokens: int = 0
    deviation: Deviation = "k"
    selection: Selection = "per_request"
    schedule: Schedule = "layer_sync"
    drift_correction: Drift = "off"
    backend: Backend = "auto"

    def __post_init__(self) -> None:
        if ratio_problem(self.recompute_ratio) is not None:
            raise ValueError(f"recompute_ratio={self.recompute_ratio} must be in [0, 1]")
        if not self.check_layers or list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError(f"check_layers={self.check_layers} must be non-empty and increasing")
        if sink_tokens_problem(self.sink_tokens) is not None:
            raise ValueError(f"sink_tokens={self.sink_tokens!r} must be an int ≥ 0")
        if self.deviation not in ("k", "v", "kv"):
            raise ValueError(f"deviation={self.deviation!r}; valid: 'k', 'v', 'kv'")
        if self.drift_correction not in DRIFTS:
            raise ValueError(f"drift_correction={self.drift_correction!r}; valid: 'off', 'auto'")

    @classmethod
    def from_config(cls, config: KMeshConfig, **overrides: object) -> BlendOptions:
        fields: dict[str, object] = {
            "recompute_ratio": config.recompute_ratio,
            "check_layers": tuple(config.check_layers),
            "sink_tokens": config.sink_tokens,
            "selection": config.selection,
            "schedule": config.schedule,
            "deviation": config.deviation,
            # Cascade decode reads a sibling's stale rows straight from the master: shifted rows
            # would fail its row check and be read one request at a time. A request may still
            # ask for drift correction itself.
            "drift_correction": "off" if config.cascade_decode else config.drift_correction,
        }
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    def for_request(self, recompute_ratio: float | None, sink_tokens: int | None,
                    drift_correction: str | None = None) -> BlendOptions:  # fmt: skip
        """These options with a request's own ratio, sink tokens and drift correction (None:
        keep these)."""
        changes = {"recompute_ratio": recompute_ratio, "sink_tokens": sink_tokens,
                   "drift_correction": drift_correction}  # fmt: skip
        given = {name: value for name, value in changes.items() if value is not None}
        return dataclasses.replace(self, **given) if given else self  # type: ignore[arg-type]

    def validate_for(self, num_layers: int) -> None:
        if self.check_layers[-1] >= num_layers:
            raise ValueError(f"check_layers={self.check_layers} beyond the model's {num_layers}")


def check_ratios(ratio: float, num_checks: int) -> list[float]:
    """Kept share of reused tokens after each of ``num_checks`` check layers.

    Linear from (1 − 1/K) toward ``ratio``: K = 1 gives [ratio]; K = 3, ratio 0.15 gives
    [0.717, 0.433, 0.15]. Always non-increasing and ending at ``ratio``.
    """
    k = num_checks
    return [ratio + (1.0 - ratio) * (k - i) / k for i in range(1, k + 1)]


def keep_count(ratio: float, num_tokens: int) -> int:
    """round(ratio × num_tokens), halves rounded up, clamped to [0, num_tokens]."""
    return max(0, min(num_tokens, math.floor(ratio * num_tokens + 0.5)))


def select_top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest ``scores`` ([n] fp32), ascending.

    Ties go to the lower index (stable sort), so the choice is deterministic.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:count]
    return torch.sort(order).values
