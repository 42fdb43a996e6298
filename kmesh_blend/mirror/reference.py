"""Plain-torch references of the mirror restore (also the CPU run-time path).

The math is the prediction of `kmesh_blend.mirror.codec` (master K re-positioned by the torch
reference, master V as is) with the mirror's stored rows written over it: exact data movement plus
a rotation whose op sequence defines `kmesh_blend.mirror.codec.PREDICTOR`.
"""

from __future__ import annotations

import torch

from kmesh_blend.mirror.codec import Mirror, predict_layer, row_index
from kmesh_blend.ops.reference import scatter_paged_reference

__all__ = ["restore_dense_reference", "restore_layer_reference", "restore_paged_reference"]


@torch.no_grad()
def restore_layer_reference(
    master_kv: torch.Tensor,
    master_positions: torch.Tensor,
    mirror: Mirror,
    layer: int,
    inv_freq: torch.Tensor,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of the sibling's KV: (K, V), each [S, H, D] in the master's dtype.

    ``master_kv``: [L, 2, S, H, D]; ``master_positions``: [S] int64; ``inv_freq``: [D/2] fp32;
    ``index``: `row_index(mirror)` [L, 2, S] int64 if already computed.
    """
    index = row_index(mirror) if index is None else index
    k, v = predict_layer(master_kv, master_positions, mirror.positions, layer, inv_freq)
    k, v = k.clone(), v.clone()
    for kind, out in enumerate((k, v)):
        rows = index[layer, kind]
        stored = rows >= 0
        out[stored] = mirror.rows[rows[stored]]
    return k, v


@torch.no_grad()
def restore_dense_reference(
    master_kv: torch.Tensor, master_positions: torch.Tensor, mirror: Mirror, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """All layers: (keys, values), each [L, S, H, D] — for tests and promotion to a master."""
    index = row_index(mirror)
    layers = [
        restore_layer_reference(master_kv, master_positions, mirror, layer, inv_freq, index)
        for layer in range(mirror.num_layers)
    ]
    return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])


@torch.no_grad()
def restore_paged_reference(
    master_kv: torch.Tensor,
    master_positions: torch.Tensor,
    mirror: Mirror,
    layer: int,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    index: torch.Tensor | None = None,
) -> None:
    """Write one restored layer into a paged cache at ``slots`` [S] int64, in place.

    ``k_cache`` / ``v_cache``: ``[block, head, offset, dim]`` views of the layer's K and V cache
    (any strides; see `kmesh_blend.ops.reference.scatter_paged_reference`).
    """
    k, v = restore_layer_reference(master_kv, master_positions, mirror, layer, inv_freq, index)
    scatter_paged_reference(k, k_cache, slots, block_size)
    scatter_paged_reference(v, v_cache, slots, block_size)
