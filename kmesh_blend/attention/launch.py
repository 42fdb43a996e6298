"""Launchers of cascade attention's two building blocks: one level's state, and the state merge.

Each validates shapes, dtypes and devices, allocates fp32 outputs and dispatches to a backend:
``"torch"`` (`kmesh_blend.attention.reference`), ``"triton"`` (`kmesh_blend.kernels.cascade_merge`;
compiled on CUDA, on the CPU only under ``TRITON_INTERPRET=1``) or ``"flashinfer"`` (CUDA only,
fp16/bf16 inputs; imported lazily and never by ``import kmesh_blend``). Backend choice for
``"auto"`` lives in `kmesh_blend.attention.backend`.
"""

from __future__ import annotations

from typing import Literal

import torch

from kmesh_blend.attention import reference
from kmesh_blend.ops import reposition_keys
from kmesh_blend.ops.launch import next_pow2

__all__ = ["CascadeBackend", "level_state", "merge_state"]

CascadeBackend = Literal["auto", "torch", "triton", "flashinfer"]
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MIN_TILE = 16  # tl.dot tiles must be ≥ 16 in compiled code (the interpreter accepts less)


def level_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_positions: torch.Tensor,
    q_limits: torch.Tensor,
    scale: float,
    exclude: torch.Tensor | None = None,
    exclude_row: torch.Tensor | None = None,
    q_shift: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    backend: Literal["torch", "triton", "flashinfer"] = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of one cascade level.

    ``q``: [M, H, D] float, rotated at its positions; with ``q_shift`` ([M] int64) and
    ``inv_freq`` ([D/2] fp32), each query is first rotated by its shift into the keys' position
    frame (inside the kernel on Triton). ``k`` / ``v``: [S, Hkv, D]
    (same dtype, H a multiple of Hkv); ``k_positions``: [S] int64; ``q_limits``: [M] int64 — key j
    is visible to query m iff ``k_positions[j] <= q_limits[m]`` and not
    ``exclude[exclude_row[m], j]`` (``exclude``: [R, S] bool, ``exclude_row``: [M] int64).
    Returns (v [M, H, D] fp32, s [M, H] fp32, s = log2-sum-exp of scaled scores, −inf if empty).
    """
    _check_level(q, k, v, k_positions, q_limits, exclude, exclude_row)
    if (q_shift is None) != (inv_freq is None):
        raise ValueError("q_shift and inv_freq go together")
    if q_shift is not None and inv_freq is not None:
        if q_shift.shape != q_limits.shape or q_shift.dtype != torch.int64:
            raise ValueError(f"q_shift must be [{q.shape[0]}] int64, got {q_shift.shape}")
        if inv_freq.shape != (q.shape[-1] // 2,) or q.shape[-1] % 2:
            raise ValueError(f"inv_freq must be [{q.shape[-1] // 2}], got {inv_freq.shape}")
    if backend == "triton":
        return _level_triton(
            q, k, v, k_positions, q_limits, exclude, exclude_row, q_shift, inv_freq, scale
        )
    if q_shift is not None and inv_freq is not None:  # torch / flashinfer: rotate first, fp32
        rot: Literal["torch", "triton"] = "torch" if backend == "torch" else "triton"
        q = reposition_keys(q.float(), q_shift, inv_freq.float(), rot)
    if backend == "torch":
        return reference.level_state_reference(
            q, k, v, k_positions, q_limits, exclude, exclude_row, scale
        )
    if backend == "flashinfer":
        return _level_flashinfer(q, k, v, k_positions, q_limits, exclude, exclude_row, scale)
    raise ValueError(f"backend={backend!r}; valid: 'torch', 'triton', 'flashinfer'")


def merge_state(
    va: torch.Tensor,
    sa: torch.Tensor,
    vb: torch.Tensor,
    sb: torch.Tensor,
    backend: Literal["torch", "triton", "flashinfer"] = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two states over disjoint key sets (base-2 log-sum-exp, FACTS.md).

    ``va`` / ``vb``: [n, H, D] float; ``sa`` / ``sb``: [n, H] fp32 (−inf: empty level).
    Returns (v [n, H, D] fp32, s [n, H] fp32); both empty → (0, −inf).
    """
    if va.dim() != 3 or vb.shape != va.shape:
        raise ValueError(f"va, vb must be equal [n, H, D], got {tuple(va.shape)}, {vb.shape}")
    for name, s in (("sa", sa), ("sb", sb)):
        if s.shape != va.shape[:2] or s.dtype != torch.float32 or s.device != va.device:
            raise ValueError(f"{name} must be {list(va.shape[:2])} fp32 on {va.device}")
    if backend == "torch":
        return reference.merge_state_reference(va, sa, vb, sb)
    if backend == "flashinfer":
        import flashinfer  # CUDA only; the self-check proves it before "auto" picks it

        v, s = flashinfer.merge_state(va.contiguous(), sa, vb.contiguous(), sb)
        return v.float(), s.float()
    if backend != "triton":
        raise ValueError(f"backend={backend!r}; valid: 'torch', 'triton', 'flashinfer'")
    from kmesh_blend.kernels.cascade_merge import merge_state_kernel

    n, h, d = va.shape
    vo = torch.empty(n, h, d, dtype=torch.float32, device=va.device)
    so = torch.empty(n, h, dtype=torch.float32, device=va.device)
    if n:
        block_r = 32  # (token, head) rows per program
        merge_state_kernel[(-(-n * h // block_r),)](
            va, sa, vb, sb, vo, so, n * h, *va.stride(), *sa.stride(), *vb.stride(),
            *sb.stride(), *vo.stride(), *so.stride(), H=h, D=d, BLOCK_R=block_r,
            BLOCK_D=next_pow2(d),
        )  # fmt: skip
    return vo, so


# --- backends -----------------------------------------------------------------------------------


def _level_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_positions: torch.Tensor,
    q_limits: torch.Tensor,
    exclude: torch.Tensor | None,
    exclude_row: torch.Tensor | None,
    q_shift: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from kmesh_blend.kernels.cascade_merge import level_attention_kernel

    m, h, d = q.shape
    s_len, hkv = k.shape[0], k.shape[1]
    group = h // hkv
    out = torch.zeros(m, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((m, h), float("-inf"), dtype=torch.float32, device=q.device)
    if m == 0 or s_len == 0:
        return out, lse
    has_exclude = exclude is not None and exclude_row is not None
    if exclude is not None and exclude_row is not None:
        excl, excl_row = exclude.to(torch.uint8).contiguous(), exclude_row
    else:  # dummies, never read (HAS_EXCLUDE=False)
        excl, excl_row = torch.zeros(1, 1, dtype=torch.uint8, device=q.device), q_limits
    has_shift = q_shift is not None and inv_freq is not None
    if q_shift is not None and inv_freq is not None:
        shift, freq = q_shift, inv_freq.float().contiguous()
    else:  # dummies, never read (HAS_SHIFT=False)
        shift, freq = q_limits, torch.zeros(1, dtype=torch.float32, device=q.device)
    if d % 2 or d // 2 < _MIN_TILE:
        raise ValueError(f"the Triton level kernel needs an even head_dim ≥ 32, got {d}")
    block_m = max(_MIN_TILE, min(64, next_pow2(m * group)))
    grid = (-(-m * group // block_m), hkv)
    level_attention_kernel[grid](
        q, shift, freq, k, v, k_positions, q_limits, excl, excl_row, out, lse, m, s_len,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(), excl.stride(0),
        scale * reference.LOG2E,
        GROUP=group, HALF=d // 2, D=d, BLOCK_HALF=next_pow2(d // 2), BLOCK_D=next_pow2(d),
        BLOCK_M=block_m, BLOCK_N=32, HAS_SHIFT=has_shift, HAS_EXCLUDE=has_exclude,
    )  # fmt: skip
    return out, lse


def _level_flashinfer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_positions: torch.Tensor,
    q_limits: torch.Tensor,
    exclude: torch.Tensor | None,
    exclude_row: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # CUDA and fp16/bf16 only; cannot run on this project's CPU machines — the start-up
    # self-check compares it with the torch reference before "auto" ever selects it.
    import flashinfer

    visible = k_positions[None, :] <= q_limits[:, None]
    if exclude is not None and exclude_row is not None:
        visible = visible & ~exclude.bool()[exclude_row]
    out, lse = flashinfer.single_prefill_with_kv_cache(
        q.to(k.dtype).contiguous(), k.contiguous(), v.contiguous(),
        custom_mask=visible.contiguous(), sm_scale=scale, return_lse=True,
    )  # fmt: skip
    out, lse = out.float(), lse.float()  # FlashInfer's lse is base 2, like our states
    empty = ~visible.any(dim=1)
    out[empty] = 0.0
    lse[empty] = float("-inf")
    return out, lse


# --- helpers ------------------------------------------------------------------------------------


def _check_level(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_positions: torch.Tensor,
    q_limits: torch.Tensor,
    exclude: torch.Tensor | None,
    exclude_row: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q [M, H, D], k = v [S, Hkv, D]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)} (D, H % Hkv)")
    if q.dtype not in _FLOAT_DTYPES or k.dtype not in _FLOAT_DTYPES or v.dtype != k.dtype:
        raise ValueError(
            f"float q, k, v (k, v alike) required; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    for name, t, n in (
        ("k_positions", k_positions, k.shape[0]),
        ("q_limits", q_limits, q.shape[0]),
    ):
        if t.shape != (n,) or t.dtype != torch.int64 or t.device != q.device:
            raise ValueError(f"{name} must be [{n}] int64 on {q.device}, got {t.shape} {t.dtype}")
    if (exclude is None) != (exclude_row is None):
        raise ValueError("exclude and exclude_row go together")
    if exclude is not None and exclude_row is not None:
        if exclude.dim() != 2 or exclude.shape[1] != k.shape[0] or exclude.dtype != torch.bool:
            raise ValueError(f"exclude must be [R, {k.shape[0]}] bool, got {exclude.shape}")
        if exclude_row.shape != (q.shape[0],) or exclude_row.dtype != torch.int64:
            raise ValueError(f"exclude_row must be [{q.shape[0]}] int64")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q on {q.device}, k on {k.device}, v on {v.device}")
