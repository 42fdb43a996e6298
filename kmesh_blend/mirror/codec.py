"""Mirror codec: one sibling's post-blend KV of a segment as a lossless diff against its master.

Terms (shapes per function; L layers, S segment tokens, H = Hkv KV heads, D head dim):

- **master**: ``kv`` [L, 2, S, H, D] (index 0 = K rotated at ``master_positions`` [S], 1 = V).
- **prediction** of a sibling that placed the segment at ``positions`` [S]: per layer, the master
  K re-positioned by ``positions - master_positions`` with the torch reference
  (`kmesh_blend.ops.reference.reposition_reference`, the op the blend's torch path uses, bit-exact
  per row whatever else is in the batch), and the master V unchanged.
- **mirror**: the sibling's KV ``keys`` / ``values`` [L, S, H, D] stored as the prediction plus the
  *units* whose bits differ from it. A unit is one token's K (or V) row of one layer
  (``"token"``), or a block of 16 / 32 consecutive tokens (``"block16"`` / ``"block32"``; the last
  block may be partial). K and V are diffed separately: a recomputed token's V may equal the
  master's (context-free layer 0), its K rarely.

Rows are compared **bitwise** (integer views), so ``-0.0`` vs ``0.0`` and NaN payloads count as
changes and the restore is `torch.equal` — and bit-identical — to the sibling's KV whenever the
restorer reproduces the prediction's bits. That is the ``predictor`` contract recorded in every
mirror (`PREDICTOR`): cos/sin from `rope_tables`, fp32 products and sums each rounded on its own
(no FMA), one cast to the KV dtype. The torch reference does exactly that; the Triton kernel does
it too when launched with the same tables and FMA contraction off (`kmesh_blend.mirror.restore`).
A blend whose unchanged rows came from another re-positioning (e.g. the Triton kernel that
computes sin/cos itself) still round-trips losslessly: those rows simply land in the diff.

Index: one bit per unit per layer and kind ([L, 2, U] bool, packed on the wire) — L·2·S/8 bytes
for token units, e.g. 12 KiB for 24 layers × 2,048 tokens, next to 25 MiB of dense bf16 KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kmesh_blend.ops.reference import reposition_reference

__all__ = [
    "GRANULARITIES",
    "PREDICTOR",
    "Granularity",
    "Mirror",
    "changed_rows",
    "encode",
    "predict_layer",
    "row_index",
]

Granularity = Literal["token", "block16", "block32"]
GRANULARITIES: dict[str, int] = {"token": 1, "block16": 16, "block32": 32}
"""Tokens per diff unit, per granularity name."""

PREDICTOR = "rope-tables-fp32-nofma/v1"
"""How predicted rows are computed (see the module docstring); bump if that ever changes."""

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@dataclass(frozen=True)
class Mirror:
    """A sibling's segment KV as a diff against one master version.

    ``positions``: [S] int64, where the sibling holds the segment. ``changed``: [L, 2, U] bool,
    units (``unit`` tokens each, U = ceil(S / unit)) stored in ``rows``. ``rows``: [n, H, D] in the
    KV dtype: every token row of every changed unit, ordered by (layer, K then V, token).
    ``master_checksum``: `kmesh_blend.segments.master.kv_checksum` of the master it applies to.
    """

    positions: torch.Tensor
    changed: torch.Tensor
    rows: torch.Tensor
    unit: int
    master_checksum: str
    predictor: str = PREDICTOR

    @property
    def num_layers(self) -> int:
        return int(self.changed.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def payload_bytes(self) -> int:
        """Replacement rows plus the packed unit bitmap (what the codec stores beyond metadata)."""
        return int(self.rows.numel() * self.rows.element_size()) + (self.changed.numel() + 7) // 8


@torch.no_grad()
def predict_layer(
    master_kv: torch.Tensor,
    master_positions: torch.Tensor,
    positions: torch.Tensor,
    layer: int,
    inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prediction of one layer: (K re-positioned, V), each [S, H, D] in the master's dtype.

    ``master_kv``: [L, 2, S, H, D]; ``master_positions``, ``positions``: [S] int64;
    ``inv_freq``: [D/2] fp32 (the model's, RoPE scaling included).
    """
    k = reposition_reference(master_kv[layer, 0], positions - master_positions, inv_freq)
    return k, master_kv[layer, 1]


def changed_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[S, H, D] × [S, H, D] (same float dtype) → [S] bool: rows whose bits differ anywhere."""
    view = _INT_VIEW[a.dtype]
    return (a.view(view) != b.view(view)).flatten(1).any(dim=1)


@torch.no_grad()
def encode(
    master_kv: torch.Tensor,
    master_positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    granularity: Granularity = "token",
    master_checksum: str = "",
) -> Mirror:
    """Encode a sibling's segment KV as a mirror of ``master_kv``.

    ``master_kv``: [L, 2, S, H, D]; ``master_positions``: [S] int64; ``keys`` / ``values``:
    [L, S, H, D] (or per-layer lists of [S, H, D]) of the sibling, K rotated at ``positions``
    [S] int64; ``inv_freq``: [D/2] fp32. ``master_checksum`` binds the mirror to one master
    version (`kmesh_blend.segments.master.kv_checksum`; the lifecycle fills it in).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}; valid: {sorted(GRANULARITIES)}")
    keys, values = _stack(keys), _stack(values)
    L, _, S, H, D = master_kv.shape
    if keys.shape != (L, S, H, D) or values.shape != keys.shape:
        raise ValueError(
            f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match the master "
            f"[L={L}, S={S}, H={H}, D={D}]"
        )
    if keys.dtype != master_kv.dtype or values.dtype != master_kv.dtype:
        raise ValueError(
            f"KV dtype {keys.dtype}/{values.dtype} differs from master {master_kv.dtype}"
        )
    for name, pos in (("positions", positions), ("master_positions", master_positions)):
        if pos.shape != (S,) or pos.dtype != torch.int64:
            raise ValueError(f"{name} must be [{S}] int64, got {tuple(pos.shape)} {pos.dtype}")
    unit = GRANULARITIES[granularity]
    num_units = -(-S // unit)
    changed = torch.zeros(L, 2, num_units, dtype=torch.bool)
    rows = []
    for layer in range(L):
        pred_k, pred_v = predict_layer(master_kv, master_positions, positions, layer, inv_freq)
        for kind, (actual, pred) in enumerate(((keys[layer], pred_k), (values[layer], pred_v))):
            units = _pad(changed_rows(actual, pred), unit).view(num_units, unit).any(dim=1)
            changed[layer, kind] = units
            rows.append(actual[_expand(units, unit, S)])
    return Mirror(positions.clone(), changed, torch.cat(rows), unit, master_checksum)


def row_index(mirror: Mirror) -> torch.Tensor:
    """[L, 2, S] int64: the row of ``mirror.rows`` holding each token's K / V, or -1 (predicted)."""
    L = mirror.num_layers
    S = mirror.num_tokens
    stored = mirror.changed.repeat_interleave(mirror.unit, dim=2)[:, :, :S]
    index = torch.full((L, 2, S), -1, dtype=torch.int64)
    index[stored] = torch.arange(int(stored.sum()), dtype=torch.int64)
    return index


# --- helpers ------------------------------------------------------------------------------------


def _stack(x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(x)) if isinstance(x, list | tuple) else x


def _pad(mask: torch.Tensor, unit: int) -> torch.Tensor:
    extra = -mask.numel() % unit
    return torch.cat((mask, mask.new_zeros(extra))) if extra else mask


def _expand(units: torch.Tensor, unit: int, num_tokens: int) -> torch.Tensor:
    """[U] bool per unit → [S] bool per token."""
    return units.repeat_interleave(unit)[:num_tokens]
