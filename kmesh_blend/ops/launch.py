"""Launchers of the blend's kernels: validate, allocate, dispatch.

Backends: ``"triton"`` runs the kernels of `kmesh_blend.kernels` (compiled on CUDA; on the CPU
only under ``TRITON_INTERPRET=1``, which the tests use); ``"torch"`` runs the fp32 references of
`kmesh_blend.ops.reference`; ``"auto"`` picks Triton for CUDA tensors when that kernel's start-up
self-check passed (`kmesh_blend.ops.selfcheck`, run by `kmesh_blend.ops.dispatch`), torch
otherwise — for re-positioning on the CPU, `kmesh_blend.cpu`'s one-pass op where this process
loaded those kernels (the reference's bits).
"""

from __future__ import annotations

import math

import torch

from kmesh_blend.cpu import drift_means_op, reposition_op, shift_rows_op
from kmesh_blend.ops import reference, selfcheck  # noqa: F401 (selfcheck registers the checks)
from kmesh_blend.ops.dispatch import (
    Backend,
    check_float,
    check_index,
    check_like,
    check_paged,
    check_slots,
    next_pow2,
    use_triton,
)

__all__ = [
    "Backend", "drift_means", "gather_paged", "reposition_keys", "scatter_paged", "shift_rows",
    "token_deviation",
]  # fmt: skip


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
    check_float("k", k, 3)
    if out is not None and (out.shape != k.shape or out.device != k.device):
        raise ValueError(f"out must be {tuple(k.shape)} on {k.device}, got {tuple(out.shape)}")
    if k.shape[-1] % 2 or inv_freq.shape != (k.shape[-1] // 2,):
        raise ValueError(f"inv_freq must be [{k.shape[-1] // 2}], got {tuple(inv_freq.shape)}")
    check_index("delta", delta, k.shape[0], k.device)
    if use_triton(backend, k, "reposition_kernel"):
        return _reposition_triton(k, delta, inv_freq, torch.empty_like(k) if out is None else out)
    if backend == "auto" and k.device.type == "cpu" and (op := reposition_op()) is not None:
        # The reference's math and roundings in one pass (kmesh_blend/cpu/reposition.cpp).
        c, s = reference.signed_tables(delta, inv_freq)
        target = torch.empty_like(k) if out is None else out
        op(k, c, s, target)
        return target
    return reference.reposition_reference(k, delta, inv_freq, out)


def shift_rows(
    k: torch.Tensor, v: torch.Tensor, shift_k: torch.Tensor, shift_v: torch.Tensor,
    cos: torch.Tensor, signed_sin: torch.Tensor,
) -> None:  # fmt: skip
    """Drift correction's shift of a segment's stale rows, in place (`shift_rows_reference`):
    ``k`` / ``v`` [n, Hkv, D], ``shift_k`` / ``shift_v`` [Hkv, D] fp32, ``cos`` /
    ``signed_sin`` [n, D] fp32. On the CPU `kmesh_blend.cpu`'s one-pass op where this process
    loaded those kernels (the reference's bits); the torch reference elsewhere."""
    check_float("k", k, 3)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k {tuple(k.shape)} {k.dtype}, got {tuple(v.shape)}")
    n, heads, dim = k.shape
    wanted = {"shift_k": (shift_k, (heads, dim)), "shift_v": (shift_v, (heads, dim)),
              "cos": (cos, (n, dim)), "signed_sin": (signed_sin, (n, dim))}  # fmt: skip
    for name, (t, shape) in wanted.items():
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"{name} must be {list(shape)} fp32, got {tuple(t.shape)} {t.dtype}")
    if k.device.type == "cpu" and (op := shift_rows_op()) is not None:
        op(k, v, shift_k.contiguous(), shift_v.contiguous(), cos.contiguous(),
           signed_sin.contiguous())  # fmt: skip
        return
    reference.shift_rows_reference(k, v, shift_k, shift_v, cos, signed_sin)


def drift_means(
    fresh_k: torch.Tensor, stored_k: torch.Tensor, fresh_v: torch.Tensor, stored_v: torch.Tensor,
    cos: torch.Tensor, signed_sin: torch.Tensor, rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Drift correction's estimate (`drift_means_reference`): [n, Hkv, D] fresh / stored rows,
    [n, D] fp32 tables turning keys back to position 0, ``rows`` [m ≥ 1] int64 → the mean drift
    of those rows, (keys, values) each [Hkv, D] fp32. On the CPU one pass where `kmesh_blend.cpu`
    loaded (summed in double: within 1e-6 of the reference, not its bits)."""
    check_float("fresh_k", fresh_k, 3)
    if rows.dim() != 1 or rows.numel() == 0 or rows.dtype != torch.int64:
        raise ValueError(
            f"rows must be a non-empty [m] int64, got {tuple(rows.shape)} {rows.dtype}"
        )
    if fresh_k.device.type == "cpu" and (op := drift_means_op()) is not None:
        mean_k, mean_v = op(fresh_k, stored_k, fresh_v, stored_v, cos.contiguous(),
                            signed_sin.contiguous(), rows.contiguous())  # fmt: skip
        return mean_k, mean_v
    return reference.drift_means_reference(fresh_k, stored_k, fresh_v, stored_v, cos, signed_sin,
                                           rows)  # fmt: skip


def token_deviation(
    fresh: torch.Tensor, stored: torch.Tensor, backend: Backend = "auto"
) -> torch.Tensor:
    """``fresh``, ``stored``: [n, H, D] → [n] fp32 squared L2 distance per token."""
    check_float("fresh", fresh, 3)
    if stored.shape != fresh.shape or stored.dtype != fresh.dtype:
        raise ValueError(
            f"stored must match fresh {tuple(fresh.shape)} {fresh.dtype}, "
            f"got {tuple(stored.shape)} {stored.dtype}"
        )
    if use_triton(backend, fresh, "deviation_kernel"):
        return _deviation_triton(fresh, stored)
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
    if use_triton(backend, rows, "scatter_paged_kernel"):
        _scatter_triton(rows, cache, slots, block_size)
        return
    reference.scatter_paged_reference(rows, cache, slots, block_size)


def gather_paged(
    cache: torch.Tensor, slots: torch.Tensor, block_size: int, backend: Backend = "auto"
) -> torch.Tensor:
    """Read rows at ``slots`` [n] int64 from a ``[block, head, offset, dim]`` view → [n, Hkv, D]."""
    _, heads, _, d = cache.shape
    rows = torch.empty(slots.shape[0], heads, d, dtype=cache.dtype, device=cache.device)
    _check_paged(rows, cache, slots, block_size)
    if use_triton(backend, cache, "gather_paged_kernel"):
        return _gather_triton(cache, slots, block_size, rows)
    if backend == "torch":
        return reference.gather_paged_reference(cache, slots, block_size)
    return _gather_rows(cache, slots, block_size)


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """`gather_paged` in plain torch. Slots filling at least half of the blocks they touch (a
    request's prompt rows, the usual read): those whole blocks copied out row-major, then the
    rows picked — vLLM's CPU cache holds K transposed within a block, and a strided pick per row
    costs ≈ 6× more there (1,300 rows: 1.5 ms → 0.25 ms a layer, one core). Scattered slots:
    one ``index_select`` of [n·Hkv] rows over a 2-D view of the cache's storage (each row at a
    multiple of the strides' gcd), ≈ 6× less than the reference's advanced index."""
    blocks, heads, bs, d = cache.shape
    if slots.numel():
        ids, inverse = torch.unique(slots // bs, return_inverse=True)
        if ids.numel() * bs <= 2 * slots.numel():
            dense = cache.index_select(0, ids).transpose(1, 2).reshape(-1, heads, d)
            return dense.index_select(0, inverse * bs + slots % bs)
    s0, s1, s2, s3 = cache.stride()
    g = math.gcd(s0, s1, s2) or 1
    last = ((blocks - 1) * s0 + (heads - 1) * s1 + (bs - 1) * s2) // g
    flat = cache.as_strided((last + 1, d), (g, s3))
    at = ((slots // bs) * (s0 // g) + (slots % bs) * (s2 // g))[:, None]
    at = at + torch.arange(heads, device=slots.device)[None, :] * (s1 // g)
    return flat.index_select(0, at.reshape(-1)).view(slots.shape[0], heads, d)


# --- Triton launches (arguments already validated; scripts/gpu_check.py also times them alone) ---


def _reposition_triton(
    k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    from kmesh_blend.kernels.reposition import reposition_kernel

    if k.shape[0]:
        half = k.shape[-1] // 2
        reposition_kernel[(k.shape[0], k.shape[1])](
            k, out, delta, inv_freq.float().contiguous(), *k.stride(), *out.stride(),
            HALF=half, BLOCK_HALF=next_pow2(half),
        )  # fmt: skip
    return out


def _deviation_triton(fresh: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    from kmesh_blend.kernels.deviation import deviation_kernel

    n, h, d = fresh.shape
    out = torch.empty(n, dtype=torch.float32, device=fresh.device)
    if n:
        deviation_kernel[(n,)](
            fresh, stored, out, *fresh.stride(), *stored.stride(),
            H=h, D=d, BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d),
        )  # fmt: skip
    return out


def _scatter_triton(
    rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, block_size: int
) -> None:
    from kmesh_blend.kernels.paged import scatter_paged_kernel

    if rows.shape[0]:
        d = rows.shape[-1]
        scatter_paged_kernel[(rows.shape[0], rows.shape[1])](
            rows, cache, slots, *rows.stride(), *cache.stride(),
            D=d, BLOCK_D=next_pow2(d), BLOCK_SIZE=block_size,
        )  # fmt: skip


def _gather_triton(
    cache: torch.Tensor, slots: torch.Tensor, block_size: int, rows: torch.Tensor
) -> torch.Tensor:
    from kmesh_blend.kernels.paged import gather_paged_kernel

    if rows.shape[0]:
        d = rows.shape[-1]
        gather_paged_kernel[(rows.shape[0], rows.shape[1])](
            cache, rows, slots, *rows.stride(), *cache.stride(),
            D=d, BLOCK_D=next_pow2(d), BLOCK_SIZE=block_size,
        )  # fmt: skip
    return rows


# --- helpers ------------------------------------------------------------------------------------


def _check_paged(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, bs: int) -> None:
    check_float("rows", rows, 3)
    check_paged("cache", cache, bs, rows.shape[1], rows.shape[2])
    check_like("cache", cache, rows.device)
    check_slots(slots, rows.shape[0], rows.device, cache.shape[0] * bs)
