"""Plain-torch fp32 references of every kernel's math (also the CPU run-time path).

Each function states its shapes; float math runs in fp32 and is cast to the output dtype once at
the end, so the result depends only on each element's inputs (no reductions across rows): the same
row gives the same bits whatever else is in the batch.
"""

from __future__ import annotations

import torch

__all__ = [
    "deviation_reference",
    "gather_paged_reference",
    "reposition_reference",
    "rope_tables",
    "scatter_paged_reference",
]


@torch.no_grad()
def rope_tables(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables for position shifts.

    ``delta``: [n] int64 shifts; ``inv_freq``: [D/2] fp32 → (cos, sin), each [n, D/2] fp32.
    Computed once per distinct shift with a fixed shape, so a shift's table is bit-identical no
    matter how many rows or which other shifts share the call.
    """
    global _tables_memo
    memo = _tables_memo
    if memo is not None and memo[0] is delta and memo[1] is inv_freq:
        return memo[2], memo[3]
    unique, inverse = torch.unique(delta, return_inverse=True)
    cos = torch.empty(unique.numel(), inv_freq.numel(), dtype=torch.float32)
    sin = torch.empty_like(cos)
    for i, d in enumerate(unique.tolist()):
        angle = torch.full((1,), float(d), dtype=torch.float32) * inv_freq.float()[None, :]
        cos[i], sin[i] = angle.cos()[0], angle.sin()[0]
    out = cos[inverse], sin[inverse]
    _tables_memo = (delta, inv_freq, *out)
    return out


# The last tables, reused while callers pass the very same ``delta`` tensor again (the blend does,
# layer after layer). Inputs are never mutated in place.
_tables_memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@torch.no_grad()
def reposition_reference(
    k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Move RoPE-rotated keys by ``delta`` positions (RoPE rotations compose: R(a+d) = R(d)R(a)).

    ``k``: [n, Hkv, D] (any float dtype), rotated at old positions; ``delta``: [n] int64
    (new − old); ``inv_freq``: [D/2] fp32 (scaled variants included). Returns [n, Hkv, D] in
    ``k.dtype``, or writes it into ``out`` ([n, Hkv, D], any float dtype) and returns ``out``.
    Channel i pairs with i + D/2 (the Llama/Qwen layout): (x1, x2) → (x1·c − x2·s, x2·c + x1·s),
    each product and sum rounded to fp32 on its own (computed as x·C + swap(x)·S with
    C = (c, c), S = (−s, s): the same bits, in fewer passes).
    """
    c, s = _signed_tables(delta, inv_freq)
    kf = k.float()
    half = k.shape[-1] // 2
    swapped = torch.cat((kf[..., half:], kf[..., :half]), dim=-1)
    moved = kf * c
    moved += swapped * s
    if out is None:
        return moved.to(k.dtype)
    out.copy_(moved)
    return out


def _signed_tables(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(C, S) for `reposition_reference`: [n, 1, D] fp32, or [1, 1, D] when every shift is equal
    (a broadcast of the same values); memoized like `rope_tables`."""
    global _signed_memo
    memo = _signed_memo
    if memo is not None and memo[0] is delta and memo[1] is inv_freq:
        return memo[2], memo[3]
    cos, sin = rope_tables(delta, inv_freq)
    if delta.numel() and bool((delta == delta[0]).all()):
        cos, sin = cos[:1], sin[:1]
    c = torch.cat((cos, cos), dim=-1)[:, None, :]
    s = torch.cat((-sin, sin), dim=-1)[:, None, :]
    _signed_memo = (delta, inv_freq, c, s)
    return c, s


_signed_memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@torch.no_grad()
def deviation_reference(fresh: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Per-token squared L2 deviation over heads and channels.

    ``fresh``, ``stored``: [n, H, D] (same dtype) → [n] fp32, sum of (fresh − stored)² in fp32.
    """
    diff = fresh.float() - stored.float()
    return (diff * diff).sum(dim=(1, 2))


@torch.no_grad()
def scatter_paged_reference(
    rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, block_size: int
) -> None:
    """Write ``rows`` [n, Hkv, D] into a paged cache at ``slots`` [n] int64 (in place).

    ``cache`` is any 4-D view indexed ``[block, head, offset, dim]``
    (e.g. ``cache.permute(0, 2, 1, 3)`` for an NHD ``[blocks, block_size, Hkv, D]`` cache).
    Slot s lives at block s // block_size, offset s % block_size. Data movement: exact.
    """
    blocks, offsets = slots // block_size, slots % block_size
    cache[blocks, :, offsets, :] = rows.to(cache.dtype)


@torch.no_grad()
def gather_paged_reference(
    cache: torch.Tensor, slots: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Read rows at ``slots`` [n] from a ``[block, head, offset, dim]`` view → [n, Hkv, D]."""
    blocks, offsets = slots // block_size, slots % block_size
    return cache[blocks, :, offsets, :].clone()
