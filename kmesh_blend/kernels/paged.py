"""Triton kernels: move token rows between a dense buffer and a paged KV cache.

The cache is addressed through explicit strides of a ``[block, head, offset, dim]`` view, so one
kernel serves the NHD and HND CUDA layouts and vLLM's CPU layout (K transposed within a block).
"""

import triton
import triton.language as tl


@triton.jit
def scatter_paged_kernel(
    rows_ptr,  # [n, H, D] dense rows
    cache_ptr,  # paged cache, addressed by the strides below
    slots_ptr,  # [n] int64 slot ids (block * BLOCK_SIZE + offset)
    stride_rn,
    stride_rh,
    stride_rd,
    stride_cb,  # cache stride between blocks
    stride_ch,  # ... between heads
    stride_co,  # ... between offsets within a block
    stride_cd,  # ... between channels
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    live = d < D
    slot = tl.load(slots_ptr + row)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    x = tl.load(rows_ptr + row * stride_rn + head * stride_rh + d * stride_rd, mask=live)
    dst = cache_ptr + block * stride_cb + head * stride_ch + offset * stride_co + d * stride_cd
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=live)


@triton.jit
def gather_paged_kernel(
    cache_ptr,
    rows_ptr,  # [n, H, D] output
    slots_ptr,  # [n] int64
    stride_rn,
    stride_rh,
    stride_rd,
    stride_cb,
    stride_ch,
    stride_co,
    stride_cd,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    live = d < D
    slot = tl.load(slots_ptr + row)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    src = cache_ptr + block * stride_cb + head * stride_ch + offset * stride_co + d * stride_cd
    x = tl.load(src, mask=live)
    tl.store(rows_ptr + row * stride_rn + head * stride_rh + d * stride_rd, x, mask=live)
