"""The K/V layouts `cascade_decode.cpp` reads, from and to the plain ones (plain torch, exact).

Keys: tiles of 16 keys by pairs of dimensions, [..., ceil(S/16), D/2, 16, 2]: a tile of 16 keys
is one contiguous run (2 KiB at D = 64 in bf16), and each 32-bit word holds dimensions (2i, 2i+1)
of one key: the operand of the bf16 dot-product instruction. Values: pairs of keys,
[..., ceil(S/2), D, 2]: each 32-bit word holds (v_j[e], v_{j+1}[e]). Padding rows are zeros.
"""

from __future__ import annotations

import torch

__all__ = ["pair_values", "tile_keys", "unpair_values", "untile_keys"]


def tile_keys(k_t: torch.Tensor) -> torch.Tensor:
    """k_t [..., D, S] (keys transposed) → [..., ceil(S/16), D/2, 16, 2], contiguous."""
    *lead, dim, size = k_t.shape
    pad = -size % 16
    if pad:
        k_t = torch.cat((k_t, k_t.new_zeros(*lead, dim, pad)), dim=-1)
    tiles = k_t.reshape(*lead, dim // 2, 2, (size + pad) // 16, 16)
    b = len(lead)
    return tiles.permute(*range(b), b + 2, b, b + 3, b + 1).contiguous()


def untile_keys(tiled: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of `tile_keys`: [..., T, D/2, 16, 2] → k_t [..., D, size]."""
    *lead, tiles, half, _, _ = tiled.shape
    b = len(lead)
    k_t = tiled.permute(*range(b), b + 1, b + 3, b, b + 2).reshape(*lead, 2 * half, tiles * 16)
    return k_t[..., :size]


def pair_values(v: torch.Tensor) -> torch.Tensor:
    """v [..., S, D] → [..., ceil(S/2), D, 2], contiguous."""
    *lead, size, dim = v.shape
    if size % 2:
        v = torch.cat((v, v.new_zeros(*lead, 1, dim)), dim=-2)
    return v.reshape(*lead, (size + 1) // 2, 2, dim).transpose(-1, -2).contiguous()


def unpair_values(paired: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of `pair_values`: [..., P, D, 2] → v [..., size, D]."""
    *lead, pairs, dim, _ = paired.shape
    return paired.transpose(-1, -2).reshape(*lead, 2 * pairs, dim)[..., :size, :]
