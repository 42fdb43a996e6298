"""Triton kernel: move RoPE-rotated keys to new positions (rotate by a per-row shift)."""

import triton
import triton.language as tl


@triton.jit
def reposition_kernel(
    k_ptr,  # [n, H, D] input keys, rotated at old positions
    out_ptr,  # [n, H, D] output keys, rotated at new positions
    delta_ptr,  # [n] int64, new − old position
    inv_freq_ptr,  # [D/2] fp32
    stride_kn,
    stride_kh,
    stride_kd,
    stride_on,
    stride_oh,
    stride_od,
    HALF: tl.constexpr,  # D / 2
    BLOCK_HALF: tl.constexpr,  # next power of two ≥ HALF
):
    # One program per (row, head): the rotation angle depends on the row, not on the head.
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    live = i < HALF

    # Phase 1: angles for this row's shift, in fp32 (as the reference).
    delta = tl.load(delta_ptr + row).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + i, mask=live, other=0.0)
    angle = delta * inv_freq
    c = tl.cos(angle)
    s = tl.sin(angle)

    # Phase 2: rotate the (i, i + D/2) channel pairs; convert right after loading because bf16
    # arithmetic is not reliable in every backend (the CPU interpreter among them).
    base = k_ptr + row * stride_kn + head * stride_kh
    x1 = tl.load(base + i * stride_kd, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(base + (i + HALF) * stride_kd, mask=live, other=0.0).to(tl.float32)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s

    obase = out_ptr + row * stride_on + head * stride_oh
    tl.store(obase + i * stride_od, y1.to(out_ptr.dtype.element_ty), mask=live)
    tl.store(obase + (i + HALF) * stride_od, y2.to(out_ptr.dtype.element_ty), mask=live)
