"""Launchers of the blend's kernels: validate, allocate, dispatch.

Backends: ``"triton"`` runs the kernels of `kmesh_blend.kernels` (compiled on CUDA; on the CPU
only under ``TRITON_INTERPRET=1``, which the tests use); ``"torch"`` runs the fp32 references of
`kmesh_blend.ops.reference`; ``"auto"`` picks Triton for CUDA tensors when the start-up self-check
passed (`kmesh_blend.ops.selfcheck`), torch otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from kmesh_blend.ops import reference

__all__ = ["Backend", "gather_paged", "reposition_keys", "scatter_paged", "token_deviation"]

Backend = Literal["auto", "torch", "triton"]
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def reposition_keys(
    k: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate keys by per-row position shifts.

    ``k``: [n, Hkv, D] float, rotated at old positions; ``delta``: [n] int64 (new − old);
    ``inv_freq``: [D/2] fp32. Returns [n, Hkv, D] in ``k.dtype`` — or writes into ``out``
    ([n, Hkv, D] float on k's device, e.g. a slice of a larger frame) and returns it. Tolerance
    between backends: fp32 ≤ 1e-5 relative to |k| (sin/cos implementations differ by ulps).
    """
    _check_float("k", k, 3)
    if out is not None and (out.shape != k.shape or out.device != k.device):
        raise ValueError(f"out must be {tuple(k.shape)} on {k.device}, got {tuple(out.shape)}")
    if k.shape[-1] % 2 or inv_freq.shape != (k.shape[-1] // 2,):
        raise ValueError(f"inv_freq must be [{k.shape[-1] // 2}], got {tuple(inv_freq.shape)}")
    _check_index("delta", delta, k.shape[0], k.device)
    if use_triton(backend, k):
        from kmesh_blend.kernels.reposition import reposition_kernel

        out = torch.empty_like(k) if out is None else out
        if k.shape[0]:
            half = k.shape[-1] // 2
            reposition_kernel[(k.shape[0], k.shape[1])](
                k, out, delta, inv_freq.float().contiguous(), *k.stride(), *out.stride(),
                HALF=half, BLOCK_HALF=next_pow2(half),
            )  # fmt: skip
        return out
    return reference.reposition_reference(k, delta, inv_freq, out)


def token_deviation(
    fresh: torch.Tensor, stored: torch.Tensor, backend: Backend = "auto"
) -> torch.Tensor:
    """``fresh``, ``stored``: [n, H, D] → [n] fp32 squared L2 distance per token."""
    _check_float("fresh", fresh, 3)
    if stored.shape != fresh.shape or stored.dtype != fresh.dtype:
        raise ValueError(
            f"stored must match fresh {tuple(fresh.shape)} {fresh.dtype}, "
            f"got {tuple(stored.shape)} {stored.dtype}"
        )
    if use_triton(backend, fresh):
        from kmesh_blend.kernels.deviation import deviation_kernel

        n, h, d = fresh.shape
        out = torch.empty(n, dtype=torch.float32, device=fresh.device)
        if n:
            deviation_kernel[(n,)](
                fresh, stored, out, *fresh.stride(), *stored.stride(),
                H=h, D=d, BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d),
            )  # fmt: skip
        return out
    return reference.deviation_reference(fresh, stored)


def scatter_paged(
    rows: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    backend: Backend = "auto",
) -> None:
    """Write ``rows`` [n, Hkv, D] into ``cache`` at ``slots`` [n] int64, in place (exact copy).

    ``cache``: a ``[block, head, offset, dim]`` view of one layer's K (or V) cache; any strides.
    """
    _check_paged(rows, cache, slots, block_size)
    if use_triton(backend, rows):
        from kmesh_blend.kernels.paged import scatter_paged_kernel

        if rows.shape[0]:
            d = rows.shape[-1]
            scatter_paged_kernel[(rows.shape[0], rows.shape[1])](
                rows, cache, slots, *rows.stride(), *cache.stride(),
                D=d, BLOCK_D=next_pow2(d), BLOCK_SIZE=block_size,
            )  # fmt: skip
        return
    reference.scatter_paged_reference(rows, cache, slots, block_size)


def gather_paged(
    cache: torch.Tensor, slots: torch.Tensor, block_size: int, backend: Backend = "auto"
) -> torch.Tensor:
    """Read rows at ``slots`` [n] int64 from a ``[block, head, offset, dim]`` view → [n, Hkv, D]."""
    _, heads, _, d = cache.shape
    rows = torch.empty(slots.shape[0], heads, d, dtype=cache.dtype, device=cache.device)
    _check_paged(rows, cache, slots, block_size)
    if use_triton(backend, cache):
        from kmesh_blend.kernels.paged import gather_paged_kernel

        if rows.shape[0]:
            gather_paged_kernel[(rows.shape[0], heads)](
                cache, rows, slots, *rows.stride(), *cache.stride(),
                D=d, BLOCK_D=next_pow2(d), BLOCK_SIZE=block_size,
            )  # fmt: skip
        return rows
    return reference.gather_paged_reference(cache, slots, block_size)


# --- helpers ------------------------------------------------------------------------------------


def use_triton(
    backend: Backend, like: torch.Tensor, kernels_ok: Callable[[torch.device], bool] | None = None
) -> bool:
    """The dispatch rule of every launcher: ``"triton"`` / ``"torch"`` as asked; ``"auto"`` picks
    Triton only for CUDA tensors whose kernels passed their self-check (``kernels_ok``, by default
    this module's kernels)."""
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    if backend != "auto":
        raise ValueError(f"backend={backend!r}; valid: 'auto', 'torch', 'triton'")
    if like.device.type != "cuda":
        return False
    if kernels_ok is None:
        from kmesh_blend.ops.selfcheck import triton_ok

        return triton_ok(like.device)
    return kernels_ok(like.device)


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (Triton block sizes)."""
    return 1 << max(0, (n - 1).bit_length())


def _check_float(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} unsupported; valid: {_FLOAT_DTYPES}")


def _check_index(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    if t.shape != (n,) or t.dtype != torch.int64 or t.device != device:
        raise ValueError(
            f"{name} must be [{n}] int64 on {device}, got {tuple(t.shape)} {t.dtype} on {t.device}"
        )


def _check_paged(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, bs: int) -> None:
    _check_float("rows", rows, 3)
    if cache.dim() != 4:
        raise ValueError(f"cache must be a [block, head, offset, dim] view, got {cache.dim()} dims")
    if cache.shape[2] != bs or (cache.shape[1], cache.shape[3]) != rows.shape[1:]:
        raise ValueError(
            f"cache {tuple(cache.shape)} does not fit rows {tuple(rows.shape)} with block_size={bs}"
        )
    if cache.device != rows.device:
        raise ValueError(f"cache on {cache.device}, rows on {rows.device}")
    _check_index("slots", slots, rows.shape[0], rows.device)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= cache.shape[0] * bs):
        raise ValueError(f"slots out of range [0, {cache.shape[0] * bs})")
