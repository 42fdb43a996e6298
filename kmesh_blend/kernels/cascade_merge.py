"""Triton kernels of cascade attention: one level's attention state, and the state merge.

An attention state over a key set I is (v, s): v the softmax-weighted values, s = log2 Σ_I
exp(scale · q·k) (base 2, as FlashInfer). Both kernels compute in fp32: inputs are converted
right after `tl.load` (bf16 arithmetic and `tl.dot` on bf16 are wrong in the CPU interpreter),
and `tl.dot` runs with IEEE fp32 precision (TF32 would cost ~1e-3 relative on GPUs).
"""

import triton
import triton.language as tl


@triton.jit
def level_attention_kernel(
    q_ptr,  # [M, H, D] queries rotated at their own positions
    shift_ptr,  # [M] int64 rotation applied to each query first (used if HAS_SHIFT)
    inv_freq_ptr,  # [D/2] fp32 RoPE frequencies (used if HAS_SHIFT)
    k_ptr,  # [S, Hkv, D] keys of the level (read once per block of packed query rows)
    v_ptr,  # [S, Hkv, D] values
    kpos_ptr,  # [S] int64 key positions in the level's frame
    qlim_ptr,  # [M] int64: key j is visible to query m iff kpos[j] <= qlim[m]
    excl_ptr,  # [R, S] uint8, 1 = key excluded for queries of that row (used if HAS_EXCLUDE)
    excl_row_ptr,  # [M] int64 row of excl_ptr per query (used if HAS_EXCLUDE)
    out_ptr,  # [M, H, D] fp32 state values
    lse_ptr,  # [M, H] fp32 state log2-sum-exp (−inf for an empty key set)
    M,
    S,
    stride_qm,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_om,
    stride_oh,
    stride_od,
    stride_lm,
    stride_lh,
    stride_er,
    scale_log2,  # softmax scale × log2(e), so exp(scale·x) = exp2(scale_log2·x)
    GROUP: tl.constexpr,  # H / Hkv query heads per KV head (GQA)
    HALF: tl.constexpr,  # D / 2: channel i pairs with i + HALF (Llama/Qwen RoPE layout)
    D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two ≥ HALF (≥ 16 for tl.dot)
    BLOCK_D: tl.constexpr,  # next power of two ≥ D
    BLOCK_M: tl.constexpr,  # packed (query, head-in-group) rows per program (≥ 16)
    BLOCK_N: tl.constexpr,  # keys per inner step (≥ 16)
    HAS_SHIFT: tl.constexpr,
    HAS_EXCLUDE: tl.constexpr,
):
    # One program per (block of packed rows, KV head). A packed row r is query r // GROUP at
    # query head kv_head·GROUP + r % GROUP, so all query heads that share a KV head read its
    # K/V tiles in the same pass: one read of the level per KV head for up to BLOCK_M rows.
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_HALF >= 16)
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m = r // GROUP
    h = kv_head * GROUP + r % GROUP
    row_live = m < M
    i = tl.arange(0, BLOCK_HALF)
    i_live = i < HALF
    d = tl.arange(0, BLOCK_D)
    d_live = d < D

    # Phase 1: this block's queries as two channel halves, fp32, rotated by their shift
    # (R(a)·R(b) = R(a + b): moves a query at P to P + shift, the keys' frame).
    q_mask = row_live[:, None] & i_live[None, :]
    q_base = q_ptr + m[:, None] * stride_qm + h[:, None] * stride_qh
    q1 = tl.load(q_base + i[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + (i[None, :] + HALF) * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        shift = tl.load(shift_ptr + m, mask=row_live, other=0).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + i, mask=i_live, other=0.0)
        angle = shift[:, None] * inv_freq[None, :]
        c = tl.cos(angle)
        s = tl.sin(angle)
        q1, q2 = q1 * c - q2 * s, q2 * c + q1 * s
    qlim = tl.load(qlim_ptr + m, mask=row_live, other=-1)
    if HAS_EXCLUDE:
        excl_row = tl.load(excl_row_ptr + m, mask=row_live, other=0)

    # Phase 2: online softmax over key tiles, in base 2 (running max m_i, running sum l_i).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, S, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_live = n < S
        k_mask = n_live[:, None] & i_live[None, :]
        k_base = k_ptr + n[:, None] * stride_kn + kv_head * stride_kh
        k1 = tl.load(k_base + i[None, :] * stride_kd, mask=k_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_base + (i[None, :] + HALF) * stride_kd, mask=k_mask, other=0.0)
        k2 = k2.to(tl.float32)
        v = tl.load(
            v_ptr + n[:, None] * stride_vn + kv_head * stride_vh + d[None, :] * stride_vd,
            mask=n_live[:, None] & d_live[None, :],
            other=0.0,
        ).to(tl.float32)
        kpos = tl.load(kpos_ptr + n, mask=n_live, other=0)
        visible = row_live[:, None] & n_live[None, :] & (kpos[None, :] <= qlim[:, None])
        if HAS_EXCLUDE:
            ex = tl.load(
                excl_ptr + excl_row[:, None] * stride_er + n[None, :], mask=visible, other=1
            )
            visible = visible & (ex == 0)
        scores = tl.dot(q1, tl.trans(k1), input_precision="ieee")
        scores += tl.dot(q2, tl.trans(k2), input_precision="ieee")
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row with nothing visible yet keeps m = −inf; shift by 0 there so that
        # exp2(−inf − (−inf)) never produces NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    # Phase 3: normalize; an empty key set gives the neutral state (0, −inf).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(
        out_ptr + m[:, None] * stride_om + h[:, None] * stride_oh + d[None, :] * stride_od,
        out,
        mask=row_live[:, None] & d_live[None, :],
    )
    tl.store(lse_ptr + m * stride_lm + h * stride_lh, lse, mask=row_live)


@triton.jit
def merge_state_kernel(
    va_ptr,  # [n, H, D] state A values (any float dtype)
    sa_ptr,  # [n, H] fp32 state A log2-sum-exp
    vb_ptr,  # [n, H, D] state B values
    sb_ptr,  # [n, H] fp32
    vo_ptr,  # [n, H, D] fp32 merged values
    so_ptr,  # [n, H] fp32 merged log2-sum-exp
    NH,  # n · H packed (token, head) rows
    stride_van,
    stride_vah,
    stride_vad,
    stride_san,
    stride_sah,
    stride_vbn,
    stride_vbh,
    stride_vbd,
    stride_sbn,
    stride_sbh,
    stride_von,
    stride_voh,
    stride_vod,
    stride_son,
    stride_soh,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # packed (token, head) rows per program
    BLOCK_D: tl.constexpr,  # next power of two ≥ D
):
    # One program per BLOCK_R packed rows: row r is token r // H, head r % H.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_live = r < NH
    tok = r // H
    h = r % H
    d = tl.arange(0, BLOCK_D)
    live = row_live[:, None] & (d[None, :] < D)

    # Phase 1: weights relative to the larger of the two states; both empty → weights 0.
    sa = tl.load(sa_ptr + tok * stride_san + h * stride_sah, mask=row_live, other=float("-inf"))
    sb = tl.load(sb_ptr + tok * stride_sbn + h * stride_sbh, mask=row_live, other=float("-inf"))
    s_max = tl.maximum(sa, sb)
    s_ref = tl.where(s_max == float("-inf"), 0.0, s_max)
    wa = tl.exp2(sa - s_ref)
    wb = tl.exp2(sb - s_ref)
    total = wa + wb
    empty = total == 0.0
    total_safe = tl.where(empty, 1.0, total)

    # Phase 2: weighted values, fp32 right after the loads.
    va = tl.load(
        va_ptr + tok[:, None] * stride_van + h[:, None] * stride_vah + d[None, :] * stride_vad,
        mask=live,
        other=0.0,
    ).to(tl.float32)
    vb = tl.load(
        vb_ptr + tok[:, None] * stride_vbn + h[:, None] * stride_vbh + d[None, :] * stride_vbd,
        mask=live,
        other=0.0,
    ).to(tl.float32)
    out = (va * wa[:, None] + vb * wb[:, None]) / total_safe[:, None]
    s = tl.where(empty, float("-inf"), s_ref + tl.log2(total_safe))
    vo = vo_ptr + tok[:, None] * stride_von + h[:, None] * stride_voh + d[None, :] * stride_vod
    tl.store(vo, out, mask=live)
    tl.store(so_ptr + tok * stride_son + h * stride_soh, s, mask=row_live)
