"""Plain-torch fp32 references of every kernel's math (also the CPU run-time path).

Each function states its shapes; float math runs in fp32 and is cast to the output dtype once at
the end, so the result depends only on each element's inputs (no reductions across rows): the same
row gives the same bits whatever else is in the batch.
"""

from __future__ import annotations

import torch

__all__ = [
    "deviation_reference",
    "drift_means_reference",
    "gather_paged_reference",
    "reposition_reference",
    "rope_tables",
    "scatter_paged_reference",
    "shift_rows_reference",
    "signed_tables",
]


@torch.no_grad()
def rope_tables(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables for position shifts.

    ``delta``: [n] int64 shifts; ``inv_freq``: [D/2] fp32 → (cos, sin), each [n, D/2] fp32.
    Computed once per distinct shift with a fixed shape, so a shift's table is bit-identical no
    matter how many rows or which other shifts share the call.
    """
    if (hit := _TABLES.get(delta, inv_freq)) is not None:
        return hit
    unique, inverse = torch.unique(delta, return_inverse=True)
    cos = torch.empty(unique.numel(), inv_freq.numel(), dtype=torch.float32)
    sin = torch.empty_like(cos)
    for i, d in enumerate(unique.tolist()):
        angle = torch.full((1,), float(d), dtype=torch.float32) * inv_freq.float()[None, :]
        cos[i], sin[i] = angle.cos()[0], angle.sin()[0]
    return _TABLES.put(delta, inv_freq, (cos[inverse], sin[inverse]))


class _Memo:
    """Recent results, keyed by the identity of their input tensors: the blend passes the very
    same ``delta`` tensor again layer after layer, one per segment use (one entry thrashed with
    several segments in a prompt, and the tables cost more than the rotation). At most `BYTES` of
    tables are held (the oldest go first). Inputs are never mutated in place; entries hold them,
    so an identity is never reused while its entry lives."""

    BYTES = 16 << 20

    def __init__(self) -> None:
        self.items: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Tables]] = {}
        self.held = 0

    def get(self, delta: torch.Tensor, inv_freq: torch.Tensor) -> Tables | None:
        hit = self.items.get((id(delta), id(inv_freq)))
        return hit[2] if hit is not None else None

    def put(self, delta: torch.Tensor, inv_freq: torch.Tensor, tables: Tables) -> Tables:
        self.items[(id(delta), id(inv_freq))] = (delta, inv_freq, tables)
        self.held += _nbytes(tables)
        while self.held > self.BYTES and len(self.items) > 1:
            self.held -= _nbytes(self.items.pop(next(iter(self.items)))[2])
        return tables


def _nbytes(tables: Tables) -> int:
    return sum(t.numel() * t.element_size() for t in tables)


Tables = tuple[torch.Tensor, torch.Tensor]
_TABLES, _SIGNED = _Memo(), _Memo()  # `rope_tables`, `signed_tables`


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
    c, s = signed_tables(delta, inv_freq)
    kf = k.float()
    half = k.shape[-1] // 2
    swapped = torch.cat((kf[..., half:], kf[..., :half]), dim=-1)
    moved = kf * c
    moved += swapped * s
    if out is None:
        return moved.to(k.dtype)
    out.copy_(moved)
    return out


def signed_tables(delta: torch.Tensor, inv_freq: torch.Tensor) -> Tables:
    """(C, S) for `reposition_reference`: [n, 1, D] fp32, or [1, 1, D] when every shift is equal
    (a broadcast of the same values); memoized like `rope_tables`."""
    if (hit := _SIGNED.get(delta, inv_freq)) is not None:
        return hit
    cos, sin = rope_tables(delta, inv_freq)
    if delta.numel() and bool((delta == delta[0]).all()):
        cos, sin = cos[:1], sin[:1]
    c = torch.cat((cos, cos), dim=-1)[:, None, :]
    s = torch.cat((-sin, sin), dim=-1)[:, None, :]
    return _SIGNED.put(delta, inv_freq, (c, s))


@torch.no_grad()
def shift_rows_reference(
    k: torch.Tensor, v: torch.Tensor, shift_k: torch.Tensor, shift_v: torch.Tensor,
    cos: torch.Tensor, signed_sin: torch.Tensor,
) -> None:  # fmt: skip
    """Drift correction's shift of stale rows, in place: ``k`` / ``v`` [n, Hkv, D] (one float
    dtype) get ``shift_k`` [Hkv, D] fp32 (unrotated) rotated to each row's position by ``cos`` /
    ``signed_sin`` [n, D] fp32 (cos, (−sin, sin)), and ``shift_v`` [Hkv, D] fp32. Each product
    and sum rounded to fp32 on its own, the result once to ``k``'s dtype."""
    half = shift_k.shape[-1] // 2
    swapped = torch.cat((shift_k[:, half:], shift_k[:, :half]), dim=-1)
    turned = shift_k[None] * cos[:, None, :]
    turned += swapped[None] * signed_sin[:, None, :]
    k.copy_(k.float() + turned)
    v.copy_(v.float() + shift_v[None])


@torch.no_grad()
def drift_means_reference(
    fresh_k: torch.Tensor, stored_k: torch.Tensor, fresh_v: torch.Tensor, stored_v: torch.Tensor,
    cos: torch.Tensor, signed_sin: torch.Tensor, rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Drift correction's estimate: the mean over ``rows`` [m] int64 of fresh − stored
    ([n, Hkv, D] each), keys turned back to position 0 by ``cos`` / ``signed_sin`` [n, D] fp32
    (cos, (−sin, sin)) → (mean_k, mean_v), each [Hkv, D] fp32."""
    dk = fresh_k[rows].float() - stored_k[rows].float()
    half = dk.shape[-1] // 2
    swapped = torch.cat((dk[..., half:], dk[..., :half]), dim=-1)
    turned = dk * cos[rows][:, None, :]
    turned += swapped * signed_sin[rows][:, None, :]
    return turned.mean(0), (fresh_v[rows].float() - stored_v[rows].float()).mean(0)


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
