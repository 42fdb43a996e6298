"""The layerwise model interface: the per-layer steps a blend needs, and a prefill built on them.

A blend does not run a model end to end. It embeds the tokens it must compute, projects them to
q/k/v *before* RoPE (so keys can be compared and moved), rotates them to chosen positions, lets
them attend over a key set that mixes fresh and stored KV under an explicit mask, and finishes the
layer only for those tokens. `LayerwiseModel` names exactly those steps; the pure-torch
`ReferenceModel` implements it and vLLM-backed adapters implement it too.

Shapes (T = tokens in this call, H = query heads, Hkv = KV heads, D = head_dim, E = hidden size):
    token ids [T] int64; hidden [T, E]; q [T, H, D]; k, v [T, Hkv, D]; mask [Tq, Tk] bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from kmesh_blend.models.rope import RotaryEmbedding

__all__ = [
    "QKV",
    "LayerwiseModel",
    "ModelShape",
    "PrefillResult",
    "causal_mask",
    "greedy_generate",
    "prefill",
]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer, as the blend needs them."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype


class QKV(NamedTuple):
    """Projections of one layer before RoPE: q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@runtime_checkable
class LayerwiseModel(Protocol):
    """A decoder whose layers can be run step by step on any subset of tokens.

    ``hidden`` is whatever per-token state the model carries between layers, with tokens on
    dim 0 (the blend only selects rows of it): [T, E] for `ReferenceModel`, [T, 2, E] (hidden
    and residual) for vLLM's models, whose norms fuse the residual add."""

    shape: ModelShape
    rope: RotaryEmbedding

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 → hidden [T, E] in the model dtype."""
        ...

    def project_qkv(self, layer: int, hidden: torch.Tensor) -> QKV:
        """Pre-attention norm, q/k/v projections and any per-head q/k norm; **no RoPE**."""
        ...

    def rotate_qk(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of fresh q [n, H, D] and k [n, Hkv, D] at ``positions`` [n] int64, exactly as
        the model's own forward rotates them (it may work in place on ``q`` / ``k``).

        ``rope`` (above) is the same rotation as a table the blend uses to *move* stored keys."""
        ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of rotated q [Tq, H, D] over rotated k / v [Tk, Hkv, D].

        ``mask``: [Tq, Tk] bool, True where a query may attend a key. Returns [Tq, H, D] in the
        model dtype. A query with no allowed key gets zeros.
        """
        ...

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection + residual, post-attention norm, MLP + residual → hidden [T, E].

        ``hidden`` is the layer input [T, E]; ``attn`` the attention output [T, H, D].
        """
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: hidden [T, E] → logits [T, vocab] in fp32."""
        ...

    def combine_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-token deviation scores [n] fp32 over this model's KV heads → scores over all of
        the model's heads. A sharded model (tensor parallelism) sums its ranks' scores, so every
        rank selects the same tokens; an unsharded one returns ``scores``."""
        ...


class PrefillResult(NamedTuple):
    """KV of every layer and the scores of a full prefill.

    keys / values: per layer, [T, Hkv, D] in the model dtype; keys are rotated to their positions
    (what a paged KV cache holds). logits: [T, vocab] fp32 (only the last row if ``last_only``).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """[Tq] and [Tk] int positions → [Tq, Tk] bool, True where key position ≤ query position."""
    return k_positions[None, :] <= q_positions[:, None]


@torch.no_grad()
def prefill(
    model: LayerwiseModel,
    token_ids: torch.Tensor,
    positions: torch.Tensor | None = None,
    last_only: bool = False,
) -> PrefillResult:
    """Full causal prefill of one prompt through the layerwise steps.

    ``token_ids``: [T] int64; ``positions``: [T] int64, default ``0..T-1``.
    """
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D tensor, got {tuple(token_ids.shape)}")
    if positions is None:
        positions = torch.arange(token_ids.numel(), dtype=torch.int64)
    mask = causal_mask(positions, positions)
    hidden = model.embed(token_ids)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(model.shape.num_layers):
        q, k, v = model.project_qkv(layer, hidden)
        q, k = model.rotate_qk(layer, q, k, positions)
        keys.append(k)
        values.append(v)
        hidden = model.finish_layer(layer, hidden, model.attend(q, k, v, mask))
    logits = model.logits(hidden[-1:] if last_only else hidden)
    return PrefillResult(keys, values, logits)


@torch.no_grad()
def greedy_generate(model: LayerwiseModel, token_ids: torch.Tensor, max_tokens: int) -> list[int]:
    """Greedy continuation of ``token_ids`` ([T] int64) by ``max_tokens`` tokens.

    Recomputes the whole prefix each step: it is a reference for tests and demos, not a server.
    """
    ids = token_ids.clone()
    out: list[int] = []
    for _ in range(max_tokens):
        next_id = int(prefill(model, ids, last_only=True).logits[-1].argmax())
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([next_id], dtype=ids.dtype)])
    return out
