"""Triton kernel: per-token squared L2 deviation between fresh and stored K (or V)."""

import triton
import triton.language as tl


@triton.jit
def deviation_kernel(
    fresh_ptr,  # [n, H, D]
    stored_ptr,  # [n, H, D]
    out_ptr,  # [n] fp32
    stride_fn,
    stride_fh,
    stride_fd,
    stride_sn,
    stride_sh,
    stride_sd,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two ≥ H
    BLOCK_D: tl.constexpr,  # next power of two ≥ D
):
    # One program per token; the whole [H, D] tile fits in registers for real head sizes.
    row = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    live = (h < H) & (d < D)
    f = tl.load(fresh_ptr + row * stride_fn + h * stride_fh + d * stride_fd, mask=live, other=0.0)
    s = tl.load(stored_ptr + row * stride_sn + h * stride_sh + d * stride_sd, mask=live, other=0.0)
    diff = f.to(tl.float32) - s.to(tl.float32)
    tl.store(out_ptr + row, tl.sum(tl.sum(diff * diff, axis=1), axis=0))
