"""The K/V layouts `cascade_decode.cpp` reads, from and to the plain ones (plain torch, exact).

Keys: tiles of 16 keys by pairs of dimensions, [..., ceil(S/16), D/2, 16, 2]: a tile of 16 keys
is one contiguous run (2 KiB at D = 64 in bf16), and each 32-bit word holds dimensions (2i, 2i+1)
of one key: the operand of the bf16 dot-product instruction. Values: pairs of keys,
[..., ceil(S/2), D, 2]: each 32-bit word holds (v_j[e], v_{j+1}[e]). Padding rows are zeros.

A master read by matrix products (the GEMM level) is held in chunks of W keys instead:
keys [..., Hkv, ceil(S/W), D, W] (each chunk K^T, row-major) and values [..., Hkv, ceil(S/W), W, D],
zero rows past S (`gemm_chunks`), row-major operands for torch's bf16 GEMM.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["CHUNK", "chunk_rows", "chunk_width", "gemm_chunks", "pair_value_rows", "pair_values",
           "tile_key_rows", "tile_keys", "unpair_values", "untile_keys"]  # fmt: skip

CHUNK = 256  # keys per GEMM chunk: two threads get work from a family of a 512-token master


def tile_keys(k_t: torch.Tensor) -> torch.Tensor:
    """k_t [..., D, S] (keys transposed) → [..., ceil(S/16), D/2, 16, 2], contiguous."""
    return tile_key_rows(k_t.transpose(-1, -2).unsqueeze(-2)).squeeze(-5)


def untile_keys(tiled: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of `tile_keys`: [..., T, D/2, 16, 2] → k_t [..., D, size]."""
    *lead, tiles, half, _, _ = tiled.shape
    b = len(lead)
    k_t = tiled.permute(*range(b), b + 1, b + 3, b, b + 2).reshape(*lead, 2 * half, tiles * 16)
    return k_t[..., :size]


def pair_values(v: torch.Tensor) -> torch.Tensor:
    """v [..., S, D] → [..., ceil(S/2), D, 2], contiguous."""
    return pair_value_rows(v.unsqueeze(-2)).squeeze(-4)


def tile_key_rows(k: torch.Tensor) -> torch.Tensor:
    """`tile_keys` from keys as stored, k [..., S, Hkv, D] → [..., Hkv, ceil(S/16), D/2, 16, 2]
    contiguous, the same elements. A master's keys go through here once per engine: read in
    order, and in 16-bit dtypes moved as 32-bit words (a pair of dimensions is one word in
    both layouts), ≈ 4× less time than transposing first."""
    *lead, size, heads, dim = k.shape
    pad = -size % 16
    if pad:
        k = torch.cat((k, k.new_zeros(*lead, pad, heads, dim)), dim=-3)
    b, tiles = len(lead), (size + pad) // 16
    if k.element_size() == 2:
        words = k.contiguous().view(torch.int32).view(*lead, tiles, 16, heads, dim // 2)
        out = words.permute(*range(b), b + 2, b, b + 3, b + 1).contiguous()
        return out.view(k.dtype).view(*out.shape, 2)
    x = k.contiguous().view(*lead, tiles, 16, heads, dim // 2, 2)
    return x.permute(*range(b), b + 2, b, b + 3, b + 1, b + 4).contiguous()


def pair_value_rows(v: torch.Tensor) -> torch.Tensor:
    """`pair_values` from values as stored, v [..., S, Hkv, D] → [..., Hkv, ceil(S/2), D, 2]
    contiguous, the same elements. In 16-bit dtypes each pair is built as one 32-bit word
    (row 2j in the low half, as the layout holds it) before the heads move: ≈ 2× less time."""
    *lead, size, heads, dim = v.shape
    if size % 2:
        v = torch.cat((v, v.new_zeros(*lead, 1, heads, dim)), dim=-3)
    b = len(lead)
    if v.element_size() == 2 and sys.byteorder == "little":  # row 2j in a word's low half
        bits = v.view(torch.int16)
        low, high = bits[..., 0::2, :, :], bits[..., 1::2, :, :]
        words = (low.to(torch.int32) & 0xFFFF) | (high.to(torch.int32) << 16)
        out = words.transpose(-3, -2).contiguous()  # [..., Hkv, S/2, D] words
        return out.view(v.dtype).view(*out.shape, 2)
    x = v.contiguous().view(*lead, (size + size % 2) // 2, 2, heads, dim)
    return x.permute(*range(b), b + 2, b, b + 3, b + 1).contiguous()


def unpair_values(paired: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of `pair_values`: [..., P, D, 2] → v [..., size, D]."""
    *lead, pairs, dim, _ = paired.shape
    return paired.transpose(-1, -2).reshape(*lead, 2 * pairs, dim)[..., :size, :]


def chunk_width(size: int) -> int:
    """Keys per chunk for a master of ``size`` rows: `CHUNK`, or fewer (a multiple of 16) for a
    shorter master, so that padding stays under 16 rows there."""
    return min(CHUNK, max(16, -(-size // 16) * 16))


def chunk_rows(k: torch.Tensor, v: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as stored, k / v [..., S, Hkv, D] → keys [..., Hkv, C, D, W] and values
    [..., Hkv, C, W, D], C = ceil(S / W) chunks of W = ``width`` keys, contiguous, zero rows
    past S; the same dtype and elements."""
    *lead, size, heads, dim = k.shape
    pad = -size % width
    if pad:
        k = torch.cat((k, k.new_zeros(*lead, pad, heads, dim)), dim=-3)
        v = torch.cat((v, v.new_zeros(*lead, pad, heads, dim)), dim=-3)
    b, chunks = len(lead), (size + pad) // width
    k = k.reshape(*lead, chunks, width, heads, dim)
    v = v.reshape(*lead, chunks, width, heads, dim)
    keys = k.permute(*range(b), b + 2, b, b + 3, b + 1).contiguous()
    values = v.permute(*range(b), b + 2, b, b + 1, b + 3).contiguous()
    return keys, values


def gemm_chunks(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A master's bf16 rows k / v [L, S, Hkv, D] in the GEMM level's layout: `chunk_rows` at
    `chunk_width`."""
    return chunk_rows(k, v, chunk_width(int(k.shape[-3])))
