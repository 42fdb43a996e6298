"""Launcher of the mirror restore: plan once per mirror, then restore one layer at a time.

    plan = plan_restore(master.kv, master.positions, mirror, inv_freq)
    for layer in range(L):
        restore_layer(plan, master.kv, layer, k_cache[layer], v_cache[layer], slots, block_size)

Backends: ``"triton"`` runs `kmesh_blend.kernels.mirror_restore` (compiled on CUDA; on the CPU
only under ``TRITON_INTERPRET=1``); ``"torch"`` runs `kmesh_blend.mirror.reference`; ``"auto"``
picks Triton for CUDA tensors when this kernel's self-check (registered with
`kmesh_blend.ops.dispatch`: a restore that must equal the reference bit for bit) passed on that
device, torch otherwise.

Both backends compute predicted K rows with the same op sequence (`PREDICTOR`): cos/sin from
`kmesh_blend.ops.reference.rope_tables`, computed once per plan on the CPU and shared; the kernel
is launched with FMA contraction off. So both write the same bits, and a mirror restores
losslessly on either. A mirror with another ``predictor`` is refused (`ValueError`), never guessed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kmesh_blend.mirror import reference
from kmesh_blend.mirror.codec import PREDICTOR, Mirror, row_index
from kmesh_blend.ops import dispatch
from kmesh_blend.ops.dispatch import (
    Backend,
    check_like,
    check_paged,
    check_slots,
    expect_close,
    next_pow2,
    self_check,
    use_triton,
)
from kmesh_blend.ops.reference import rope_tables

__all__ = ["RestorePlan", "mirror_kernel_ok", "plan_restore", "restore_layer", "run_self_check"]

KERNEL = "mirror_restore_kernel"


class RestorePlan(NamedTuple):
    """Per-mirror state shared by every layer's restore (all on the KV's device).

    ``row_of``: [L, 2, S] int64 row of ``rows`` per token, or -1; ``table``: [S] int64 row of
    ``cos``/``sin`` per token; ``cos``/``sin``: [U, D/2] fp32, one row per distinct shift;
    ``rows``: [n, H, D] the mirror's stored rows; ``master_positions``/``positions``: [S] int64.
    """

    mirror: Mirror
    row_of: torch.Tensor
    table: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rows: torch.Tensor
    master_positions: torch.Tensor
    inv_freq: torch.Tensor


@torch.no_grad()
def plan_restore(
    master_kv: torch.Tensor,
    master_positions: torch.Tensor,
    mirror: Mirror,
    inv_freq: torch.Tensor,
) -> RestorePlan:
    """Check that ``mirror`` fits the master and build the per-mirror tables.

    ``master_kv``: [L, 2, S, H, D] (CPU or CUDA); ``master_positions``: [S] int64;
    ``inv_freq``: [D/2] fp32. Raises `ValueError` on any mismatch (shape, dtype, predictor).
    """
    if mirror.predictor != PREDICTOR:
        raise ValueError(
            f"mirror predictor {mirror.predictor!r}; this build restores {PREDICTOR!r}"
        )
    L, two, S, H, D = master_kv.shape
    if two != 2 or mirror.changed.shape[:2] != (L, 2) or mirror.num_tokens != S:
        raise ValueError(
            f"mirror of {mirror.num_layers} layers × {mirror.num_tokens} tokens does not fit "
            f"master {tuple(master_kv.shape)}"
        )
    if mirror.rows.dtype != master_kv.dtype or tuple(mirror.rows.shape[1:]) != (H, D):
        raise ValueError(
            f"mirror rows {tuple(mirror.rows.shape)} {mirror.rows.dtype} do not fit "
            f"[n, {H}, {D}] {master_kv.dtype}"
        )
    if inv_freq.shape != (D // 2,) or D % 2:
        raise ValueError(f"inv_freq must be [{D // 2}], got {tuple(inv_freq.shape)}")
    index = row_index(mirror)
    if int((index >= 0).sum()) != int(mirror.rows.shape[0]):
        raise ValueError(f"mirror holds {mirror.rows.shape[0]} rows; its index wants another count")
    delta = mirror.positions - master_positions.cpu()
    unique, table = torch.unique(delta, return_inverse=True)
    cos, sin = rope_tables(unique, inv_freq.float().cpu())
    dev = master_kv.device
    return RestorePlan(
        mirror,
        index.to(dev),
        table.to(dev),
        cos.contiguous().to(dev),
        sin.contiguous().to(dev),
        mirror.rows.to(dev),
        master_positions.to(dev),
        inv_freq.float().to(dev),
    )


@torch.no_grad()
def restore_layer(
    plan: RestorePlan,
    master_kv: torch.Tensor,
    layer: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    backend: Backend = "auto",
) -> None:
    """Write layer ``layer`` of the sibling's segment KV into a paged cache, in place.

    ``master_kv``: [L, 2, S, H, D], the master the plan was built for; ``k_cache`` / ``v_cache``:
    ``[block, head, offset, dim]`` views (any strides) of this layer's K and V cache, in the
    master's dtype; ``slots``: [S] int64 slot ids (block × block_size + offset).
    """
    S, H, D = master_kv.shape[2:]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_paged(name, c, block_size, H, D)
        check_like(name, c, master_kv.device, master_kv.dtype)
    check_slots(slots, S, master_kv.device, k_cache.shape[0] * block_size)
    if not 0 <= layer < master_kv.shape[0]:
        raise ValueError(f"layer {layer} outside [0, {master_kv.shape[0]})")
    if use_triton(backend, master_kv, KERNEL):
        _launch(plan, master_kv, layer, k_cache, v_cache, slots, block_size)
        return
    reference.restore_paged_reference(
        master_kv, plan.master_positions, plan.mirror, layer, plan.inv_freq.cpu(),
        k_cache, v_cache, slots, block_size, plan.row_of,
    )  # fmt: skip


def mirror_kernel_ok(device: torch.device) -> bool:
    """True when the kernel restored a small mirror on ``device`` bit-identically to the torch
    reference (checked once per device; one warning line otherwise)."""
    return dispatch.kernel_ok(KERNEL, device)


def run_self_check(device: torch.device | str) -> str | None:
    """Run the kernel's self-check now; None, or why it cannot be trusted."""
    return dispatch.run_self_check(KERNEL, device)


@self_check(KERNEL)
def _check_restore(device: torch.device) -> None:
    """Restore a random mirror (two shifts, replaced K and V rows) with both backends."""
    from kmesh_blend.mirror.codec import encode

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(2, 2, 21, 2, 64, generator=gen)
    pos = torch.arange(21, dtype=torch.int64)
    keys, values = master[:, 0].clone(), master[:, 1].clone()
    keys[:, 3], values[1, 7] = 1.0, -2.0
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2) / 64)
    mirror = encode(master, pos, keys, values, pos, inv_freq)
    mirror = Mirror(pos + 300, mirror.changed, mirror.rows, mirror.unit, "")
    caches = [torch.zeros(2, 2, 16, 64).to(device) for _ in range(4)]
    slots = torch.randperm(32, generator=gen)[:21].to(device)
    dev_master = master.to(device)
    plan = plan_restore(dev_master, pos.to(device), mirror, inv_freq)
    for layer in range(2):
        restore_layer(plan, dev_master, layer, caches[0], caches[1], slots, 16, "triton")
        restore_layer(plan, dev_master, layer, caches[2], caches[3], slots, 16, "torch")
        expect_close(f"K cache of layer {layer}", caches[0], caches[2])
        expect_close(f"V cache of layer {layer}", caches[1], caches[3])


# --- helpers ------------------------------------------------------------------------------------


def _launch(
    plan: RestorePlan,
    master_kv: torch.Tensor,
    layer: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> None:
    from kmesh_blend.kernels.mirror_restore import mirror_restore_kernel

    S, H, D = master_kv.shape[2:]
    if not S:
        return
    mk, mv = master_kv[layer, 0], master_kv[layer, 1]
    rows = plan.rows if plan.rows.shape[0] else master_kv.new_zeros(1, H, D)
    half = D // 2
    mirror_restore_kernel[(S, H)](
        mk, mv, rows, plan.row_of[layer, 0], plan.row_of[layer, 1], plan.table,
        plan.cos, plan.sin, k_cache, v_cache, slots,
        *mk.stride(), *mv.stride(), *rows.stride(), *k_cache.stride(), *v_cache.stride(),
        HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_SIZE=block_size,
        enable_fp_fusion=False,  # round each product and sum alone, as the torch reference does
    )  # fmt: skip
