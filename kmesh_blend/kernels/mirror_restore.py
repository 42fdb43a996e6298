"""Triton kernel: restore one layer of a mirror straight into a paged KV cache.

A mirror row is either *predicted* (the master row, K re-positioned to the sibling's position,
V copied) or *stored* (a replacement row of the diff, copied as is). One program handles one
(token, KV head) and writes K and V at the token's slot, so the dense mirror never exists.

Bit-exactness: the rotation reads cos/sin from tables the launcher computed with the torch
reference (`kmesh_blend.ops.reference.rope_tables`), rounds each fp32 product and sum on its own
(the launcher turns off FMA contraction) and casts once, which is exactly the torch reference's
op sequence, so predicted rows carry the same bits on every backend.

The cache is addressed through the strides of a ``[block, head, offset, dim]`` view (NHD, HND
and vLLM's CPU layout with K transposed within a block), as in `kmesh_blend.kernels.paged`.
"""

import triton
import triton.language as tl


@triton.jit
def mirror_restore_kernel(
    mk_ptr,  # [S, H, D] master K of this layer, rotated at the master's positions
    mv_ptr,  # [S, H, D] master V of this layer
    diff_ptr,  # [n, H, D] the mirror's replacement rows (same dtype as the master)
    krow_ptr,  # [S] int64: row of diff holding token s's K, or -1 (predicted)
    vrow_ptr,  # [S] int64: row of diff holding token s's V, or -1 (master row)
    table_ptr,  # [S] int64: row of cos/sin for token s's position shift
    cos_ptr,  # [U, HALF] fp32, contiguous
    sin_ptr,  # [U, HALF] fp32, contiguous
    kc_ptr,  # K cache of this layer, addressed by the stride_k* below
    vc_ptr,  # V cache of this layer, addressed by the stride_v* below
    slots_ptr,  # [S] int64 slot ids (block * BLOCK_SIZE + offset)
    stride_mkn,
    stride_mkh,
    stride_mkd,
    stride_mvn,
    stride_mvh,
    stride_mvd,
    stride_rn,
    stride_rh,
    stride_rd,
    stride_kb,  # K cache stride between blocks
    stride_kh,  # ... between heads
    stride_ko,  # ... between offsets within a block
    stride_kd,  # ... between channels
    stride_vb,
    stride_vh,
    stride_vo,
    stride_vd,
    HALF: tl.constexpr,  # head_dim / 2: channel i pairs with i + HALF (Llama/Qwen RoPE)
    BLOCK_HALF: tl.constexpr,  # next power of two ≥ HALF
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    tl.static_assert(BLOCK_HALF >= HALF)
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    live = i < HALF

    # Phase 1: where this token goes in the paged cache.
    slot = tl.load(slots_ptr + row)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    kdst = kc_ptr + block * stride_kb + head * stride_kh + offset * stride_ko
    vdst = vc_ptr + block * stride_vb + head * stride_vh + offset * stride_vo

    # Phase 2: K. A stored row is copied; otherwise the master row is rotated by the shift,
    # in fp32 with each product and sum rounded on its own (as the torch reference does).
    krow = tl.load(krow_ptr + row)
    stored = (krow + tl.zeros([BLOCK_HALF], dtype=tl.int64)) >= 0  # a vector: masks must be one
    src = diff_ptr + tl.maximum(krow, 0) * stride_rn + head * stride_rh
    d1 = tl.load(src + i * stride_rd, mask=live & stored, other=0.0)
    d2 = tl.load(src + (i + HALF) * stride_rd, mask=live & stored, other=0.0)
    base = mk_ptr + row * stride_mkn + head * stride_mkh
    x1 = tl.load(base + i * stride_mkd, mask=live & ~stored, other=0.0).to(tl.float32)
    x2 = tl.load(base + (i + HALF) * stride_mkd, mask=live & ~stored, other=0.0).to(tl.float32)
    t = tl.load(table_ptr + row)
    c = tl.load(cos_ptr + t * HALF + i, mask=live, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=live, other=0.0)
    y1 = _cast(x1 * c - x2 * s, kc_ptr.dtype.element_ty)
    y2 = _cast(x2 * c + x1 * s, kc_ptr.dtype.element_ty)
    k1 = tl.where(stored, d1.to(kc_ptr.dtype.element_ty), y1)
    k2 = tl.where(stored, d2.to(kc_ptr.dtype.element_ty), y2)
    tl.store(kdst + i * stride_kd, k1, mask=live)
    tl.store(kdst + (i + HALF) * stride_kd, k2, mask=live)

    # Phase 3: V. Values are never moved: a stored row, or the master row, copied bit for bit.
    vrow = tl.load(vrow_ptr + row)
    vstored = (vrow + tl.zeros([BLOCK_HALF], dtype=tl.int64)) >= 0
    vsrc = diff_ptr + tl.maximum(vrow, 0) * stride_rn + head * stride_rh
    e1 = tl.load(vsrc + i * stride_rd, mask=live & vstored, other=0.0)
    e2 = tl.load(vsrc + (i + HALF) * stride_rd, mask=live & vstored, other=0.0)
    vbase = mv_ptr + row * stride_mvn + head * stride_mvh
    m1 = tl.load(vbase + i * stride_mvd, mask=live & ~vstored, other=0.0)
    m2 = tl.load(vbase + (i + HALF) * stride_mvd, mask=live & ~vstored, other=0.0)
    tl.store(vdst + i * stride_vd, tl.where(vstored, e1, m1), mask=live)
    tl.store(vdst + (i + HALF) * stride_vd, tl.where(vstored, e2, m2), mask=live)


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    """fp32 → DTYPE rounded to nearest, ties to even, as torch's ``.to(dtype)``.

    bf16 is rounded by hand: the CPU interpreter truncates on ``.to(tl.bfloat16)``. Adding
    0x7FFF plus the kept part's lowest bit to the fp32 bits, then dropping the low 16 bits, is
    round-half-to-even; NaN becomes torch's quiet NaN 0x7FC0.
    """
    if DTYPE == tl.bfloat16:  # noqa: SIM300 (DTYPE is a constexpr: its == unwraps it)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
