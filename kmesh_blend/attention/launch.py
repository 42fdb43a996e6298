"""Launchers of cascade attention's two building blocks: one level's state, and the state merge.

Each validates shapes, dtypes and devices, allocates fp32 outputs and dispatches to a backend:
``"torch"`` (`kmesh_blend.attention.reference`), ``"triton"`` (`kmesh_blend.kernels.cascade_merge`;
compiled on CUDA, on the CPU only under ``TRITON_INTERPRET=1``) or ``"flashinfer"`` (CUDA only,
fp16/bf16 inputs; imported lazily and never by ``import kmesh_blend``). ``"auto"`` here picks
Triton for CUDA tensors once that kernel passed its self-check (registered below with
`kmesh_blend.ops.dispatch`), torch otherwise; the whole cascade's ``"auto"`` (FlashInfer first)
lives in `kmesh_blend.attention.backend`.
"""

from __future__ import annotations

from typing import Literal

import torch

from kmesh_blend.attention import reference
from kmesh_blend.ops import reposition_keys
from kmesh_blend.ops.dispatch import (
    FLOAT_DTYPES,
    check_index,
    expect_close,
    next_pow2,
    resolve,
    self_check,
)

__all__ = ["CascadeBackend", "level_state", "merge_state"]

CascadeBackend = Literal["auto", "torch", "triton", "flashinfer"]
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
    backend: CascadeBackend = "torch",
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
    name = resolve(backend, q, "level_attention_kernel", ("flashinfer",))
    if name == "triton":
        return _level_triton(
            q, k, v, k_positions, q_limits, exclude, exclude_row, q_shift, inv_freq, scale
        )
    if q_shift is not None and inv_freq is not None:  # torch / flashinfer: rotate first, fp32
        rot: Literal["torch", "triton"] = "torch" if name == "torch" else "triton"
        q = reposition_keys(q.float(), q_shift, inv_freq.float(), rot)
    if name == "torch":
        return reference.level_state_reference(
            q, k, v, k_positions, q_limits, exclude, exclude_row, scale
        )
    return _level_flashinfer(q, k, v, k_positions, q_limits, exclude, exclude_row, scale)


def merge_state(
    va: torch.Tensor,
    sa: torch.Tensor,
    vb: torch.Tensor,
    sb: torch.Tensor,
    backend: CascadeBackend = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two states over disjoint key sets (base-2 log-sum-exp).

    ``va`` / ``vb``: [n, H, D] float; ``sa`` / ``sb``: [n, H] fp32 (−inf: empty level).
    Returns (v [n, H, D] fp32, s [n, H] fp32); both empty → (0, −inf).
    """
    if va.dim() != 3 or vb.shape != va.shape:
        raise ValueError(f"va, vb must be equal [n, H, D], got {tuple(va.shape)}, {vb.shape}")
    for label, s in (("sa", sa), ("sb", sb)):
        if s.shape != va.shape[:2] or s.dtype != torch.float32 or s.device != va.device:
            raise ValueError(f"{label} must be {list(va.shape[:2])} fp32 on {va.device}")
    name = resolve(backend, va, "merge_state_kernel", ("flashinfer",))
    if name == "torch":
        return reference.merge_state_reference(va, sa, vb, sb)
    if name == "flashinfer":
        import flashinfer  # CUDA only; the self-check proves it before "auto" picks it

        v, s = flashinfer.merge_state(va.contiguous(), sa, vb.contiguous(), sb)
        return v.float(), s.float()
    return _merge_triton(va, sa, vb, sb)


# --- backends (arguments already validated; scripts/gpu_check.py also times the Triton ones) ----


def _merge_triton(
    va: torch.Tensor, sa: torch.Tensor, vb: torch.Tensor, sb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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


# --- self-checks (fp32 scratch inputs against the fp32 torch references) ------------------------


@self_check("level_attention_kernel")
def _check_level_kernel(device: torch.device) -> None:
    """GQA 4:2, head_dim 32, 45 keys (a partial tile), shifts, exclusions, one empty query."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for n, h in ((6, 4), (45, 2), (45, 2)))
    k_pos = torch.arange(40, 85)
    q_lim = torch.randint(30, 90, (6,), generator=gen)
    q_lim[0] = 10  # sees no key: the empty state (0, −inf)
    exclude = torch.rand(3, 45, generator=gen) < 0.3
    exclude_row = torch.randint(0, 3, (6,), generator=gen)
    shift = torch.randint(-500, 500, (6,), generator=gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    cpu = (q, k, v, k_pos, q_lim, exclude, exclude_row, shift, inv_freq)
    qd, kd, vd, kp, ql, ex, er, sh, fr = (t.to(device) for t in cpu)
    got = level_state(qd, kd, vd, kp, ql, 0.17, ex, er, sh, fr, backend="triton")
    want = level_state(q, k, v, k_pos, q_lim, 0.17, exclude, exclude_row, shift, inv_freq)
    expect_close("level values", got[0], want[0], rtol=1e-4, atol=1e-4)
    expect_close("level log2-sum-exp", got[1], want[1], rtol=1e-4, atol=1e-4)


@self_check("merge_state_kernel")
def _check_merge_kernel(device: torch.device) -> None:
    """Random states, one side empty, both empty, far apart (2^-300 underflows)."""
    gen = torch.Generator().manual_seed(0)
    va, vb = torch.randn(2, 37, 3, 32, generator=gen)
    sa, sb = torch.randn(2, 37, 3, generator=gen) * 20
    sa[0], sb[1], sa[2], sb[2], sa[3], sb[3] = (float("-inf"),) * 4 + (150.0, -150.0)
    dva, dsa, dvb, dsb = (t.to(device) for t in (va, sa, vb, sb))
    got = merge_state(dva, dsa, dvb, dsb, backend="triton")
    want = merge_state(va, sa, vb, sb, backend="torch")
    expect_close("merged values", got[0], want[0], rtol=1e-5, atol=1e-5)
    expect_close("merged log2-sum-exp", got[1], want[1], rtol=1e-5, atol=1e-5)


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
    if q.dtype not in FLOAT_DTYPES or k.dtype not in FLOAT_DTYPES or v.dtype != k.dtype:
        raise ValueError(
            f"float q, k, v (k, v alike) required; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    check_index("k_positions", k_positions, k.shape[0], q.device)
    check_index("q_limits", q_limits, q.shape[0], q.device)
    if (exclude is None) != (exclude_row is None):
        raise ValueError("exclude and exclude_row go together")
    if exclude is not None and exclude_row is not None:
        if exclude.dim() != 2 or exclude.shape[1] != k.shape[0] or exclude.dtype != torch.bool:
            raise ValueError(f"exclude must be [R, {k.shape[0]}] bool, got {exclude.shape}")
        if exclude_row.shape != (q.shape[0],) or exclude_row.dtype != torch.int64:
            raise ValueError(f"exclude_row must be [{q.shape[0]}] int64")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q on {q.device}, k on {k.device}, v on {v.device}")
