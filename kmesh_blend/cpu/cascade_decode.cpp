// Cascade decode on CPU (AVX-512): one decode query per request over its own rows and the shared
// masters, each master's K/V read once for all its readers. Same math as the fp32 reference
// kmesh_blend.attention.decode.decode_cascade; built and loaded by kmesh_blend/cpu/__init__.py.
//
// One call per attention layer does the whole step of the cascade requests: append this step's
// key/value to each request's own rows, rotate each query into every master's frame, score,
// softmax and weight the values per (level, KV head, key chunk) on the intra-op threads, merge
// the chunks' (max, sum, unnormalized output) states exactly, and write the output rows.
// K/V are read in their stored dtype. fp32: fp32 products. bf16: vdpbf16ps (pairs of bf16
// products summed in fp32); the operands bf16 does not hold — queries rotated into a master's
// frame, softmax probabilities — go in rounded to bf16 once, or with ``exact`` as two bf16 terms
// (value, then what its rounding left), so the products are as exact as fp32 on the stored K/V.
// A bf16 master held in chunks ([Hkv, chunks, D, W] keys, [Hkv, chunks, W, D] values) is read by
// matrix products instead (run_gemm_item: torch's bf16 GEMM with fp32 output, oneDNN), the same
// two-term operands and fp32 sums; kmesh_blend/cpu/level.py chooses which layout a master gets.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
constexpr int kChunk = 256;  // master keys per work item (even): enough items for two threads
constexpr int kRows = 12;    // query rows per score tile (accumulators held in registers)
constexpr float kMaskedBelow = -1e29f;  // a bias at or below: the key is masked (-1e30)

inline __mmask16 lanes(int left) {
  if (left <= 0) return 0;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

// The two halves of 16 interleaved pairs (a0 b0 a1 b1 ...) held in lo (pairs 0-7), hi (8-15).
inline void split_pairs(__m512 lo, __m512 hi, __m512& a, __m512& b) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  a = _mm512_permutex2var_ps(lo, even, hi);
  b = _mm512_permutex2var_ps(lo, odd, hi);
}

// e^x on 16 lanes for x <= 0: 2^n * poly(r), r = x - n ln2 in [-ln2/2, ln2/2], Taylor series to
// degree 7 (truncation < 1e-8 relative). x below -104 underflows to 0: masked keys weigh nothing.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203094172e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  const float c[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
  for (float k : c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k));
  return _mm512_scalef_ps(p, n);
}

// One work item: `rows` queries against keys [j0, j1) (j0 even) of one level and KV head.
// Keys in tiles of 16 keys by pairs of dimensions: element (d, j) at
// k[((j / 16) * (D / 2) + d / 2) * 32 + (j % 16) * 2 + d % 2] (a tile's 2 KiB read in order); values
// in pairs of keys: element (j, e) at v[((j / 2) * D + e) * 2 + j % 2]. q[i]: row i's query, fp32;
// qp[i]: the same rounded to bf16, as pairs of dimensions, and ql[i] what that rounding left
// (bf16 storage only; ``split``: use ql too — queries rotated into a master's frame, which bf16
// does not hold exactly; the model's own queries are bf16 already). bias[i]: row i's
// additive bias per key (0 read, -1e30 masked). state: rows x (2 + D) floats (max, sum of
// e^(s - max), sum of e^(s - max) v).
template <typename T>
struct Item {
  const float* q[64];
  const uint32_t* qp[64];
  const uint32_t* ql[64];
  bool split;
  bool exact;  // probabilities as two bf16 terms (and a master level's queries: ``split``)
  const float* bias[64];
  int rows;
  const T* k;
  const T* v;
  int j0, j1;
  float* state;
  // GEMM level (a master in chunks, bf16): the item's query rows as one bf16 matrix [rows, D]
  // (then, when ``split``, what their rounding left, [rows, D]), k: the chunk's K^T [D, ld],
  // v: its V [ld, D] (ld: the chunk width), both row-major.
  const bf16* qa = nullptr;
  int ld = 0;
};

// Rows i0.. of one 16-key tile at j: scores = scale * acc + the row's bias (masked lanes left).
template <int R, typename T>
inline void store_scores(const Item<T>& it, int i0, int j, __mmask16 m, const __m512* acc,
                         float scale, float* scores, int lds) {
  for (int i = 0; i < R; ++i) {
    const __m512 b = _mm512_maskz_loadu_ps(m, it.bias[i0 + i] + it.j0 + j);
    _mm512_mask_storeu_ps(scores + (i0 + i) * lds + j, m, _mm512_fmadd_ps(acc[i], _mm512_set1_ps(scale), b));
  }
}

// scores[i][j] = scale * q_i . k_j + bias_i[j]: bf16 pairs through the dot-product instruction
// (fp32 sums), fp32 pairs split and multiplied in fp32.
template <int NC, int R, bool SPLIT>
void score_bf16(const Item<bf16>& it, int i0, float scale, float* scores, int lds) {
  // Few rows (a request's own rows: one query head group): T tiles of keys at once, so R * T
  // products are in flight per load instead of R (the sums per score are the same, in order).
  constexpr int T = R <= 3 ? 4 : (R <= 6 ? 2 : 1);
  constexpr int64_t kTile = 16 * NC * 16;  // elements of one tile of 16 keys
  const int width = it.j1 - it.j0;
  int j = 0;
  if constexpr (T > 1) {
    for (; j + 16 * T <= width; j += 16 * T) {
      __m512 acc[T][R];
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < R; ++i) acc[t][i] = _mm512_setzero_ps();
      const auto* tile = it.k + static_cast<int64_t>((it.j0 + j) / 16) * kTile;
      for (int d2 = 0; d2 < 8 * NC; ++d2) {
        __m512bh q[R], ql[R];
        for (int i = 0; i < R; ++i) {
          q[i] = (__m512bh)_mm512_set1_epi32(it.qp[i0 + i][d2]);
          if (SPLIT) ql[i] = (__m512bh)_mm512_set1_epi32(it.ql[i0 + i][d2]);
        }
        for (int t = 0; t < T; ++t) {
          const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + t * kTile + d2 * 32);
          for (int i = 0; i < R; ++i) {
            acc[t][i] = _mm512_dpbf16_ps(acc[t][i], q[i], k);
            if (SPLIT) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], ql[i], k);
          }
        }
      }
      for (int t = 0; t < T; ++t) store_scores<R>(it, i0, j + 16 * t, 0xFFFF, acc[t], scale, scores, lds);
    }
  }
  for (; j < width; j += 16) {
    const __mmask16 m = lanes(width - j);
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    const auto* tile = it.k + static_cast<int64_t>((it.j0 + j) / 16) * 16 * NC * 16;
    for (int d2 = 0; d2 < 8 * NC; ++d2) {
      const __m512bh k = (__m512bh)_mm512_maskz_loadu_epi32(m, tile + d2 * 32);
      for (int i = 0; i < R; ++i) {
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(it.qp[i0 + i][d2]), k);
        if (SPLIT) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(it.ql[i0 + i][d2]), k);
      }
    }
    store_scores<R>(it, i0, j, m, acc, scale, scores, lds);
  }
}

template <int NC, int R>
void score_tile(const Item<bf16>& it, int i0, float scale, float* scores, int lds) {
  if (it.split)
    score_bf16<NC, R, true>(it, i0, scale, scores, lds);
  else
    score_bf16<NC, R, false>(it, i0, scale, scores, lds);
}

template <int NC, int R>
void score_tile(const Item<float>& it, int i0, float scale, float* scores, int lds) {
  const int width = it.j1 - it.j0;
  for (int j = 0; j < width; j += 16) {
    const __mmask16 m = lanes(width - j);
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    const auto* tile = it.k + static_cast<int64_t>((it.j0 + j) / 16) * 16 * NC * 16;
    for (int d2 = 0; d2 < 8 * NC; ++d2) {
      const float* p = tile + d2 * 32;
      __m512 ka, kb;
      split_pairs(_mm512_maskz_loadu_ps(lanes(2 * (width - j)), p),
                  _mm512_maskz_loadu_ps(lanes(2 * (width - j) - 16), p + 16), ka, kb);
      for (int i = 0; i < R; ++i) {
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(it.q[i0 + i][2 * d2]), ka, acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(it.q[i0 + i][2 * d2 + 1]), kb, acc[i]);
      }
    }
    store_scores<R>(it, i0, j, m, acc, scale, scores, lds);
  }
}

// acc_i += sum_j p_ij v_j over pairs of keys (the probabilities past the last key are 0).
template <int NC, int R, bool EXACT>
void value_tile_bf16(const Item<bf16>& it, int i0, const float* probs, int lds) {
  constexpr int D = 16 * NC;
  const int pairs = (it.j1 - it.j0 + 1) / 2;
  // The probabilities as bf16 (pair (j, j + 1) is then one 32-bit word), and what that rounding
  // left, also in bf16: p = hi + lo to about 2^-16, so the product keeps fp32-like weights.
  const int stride = (pairs + 7) & ~7;  // whole 16-wide conversions
  thread_local std::vector<uint32_t> pp;
  pp.resize(static_cast<size_t>(2 * R) * stride);
  for (int i = 0; i < R; ++i) {
    const float* p = probs + (i0 + i) * lds;
    auto* hi = reinterpret_cast<bf16*>(pp.data() + i * stride);
    auto* lo = reinterpret_cast<bf16*>(pp.data() + (R + i) * stride);
    for (int j = 0; j < 2 * pairs; j += 16) {
      const __m512 x = _mm512_loadu_ps(p + j);
      const __m256bh h = _mm512_cvtneps_pbh(x);
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j), (__m256i)h);
      if (EXACT) _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, back)));
    }
  }
  __m512 acc[R][NC];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int j2 = 0; j2 < pairs; ++j2) {
    const bf16* row = it.v + (static_cast<int64_t>(it.j0 / 2 + j2) * D) * 2;
    __m512bh v[NC];
    for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(row + 32 * c);
    for (int i = 0; i < R; ++i) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pp[i * stride + j2]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], p, v[c]);
      if (!EXACT) continue;
      const __m512bh q = (__m512bh)_mm512_set1_epi32(pp[(R + i) * stride + j2]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], q, v[c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(it.state + (i0 + i) * (2 + D) + 2 + 16 * c, acc[i][c]);
}

template <int NC, int R>
void value_tile(const Item<bf16>& it, int i0, const float* probs, int lds) {
  if (it.exact)
    value_tile_bf16<NC, R, true>(it, i0, probs, lds);
  else
    value_tile_bf16<NC, R, false>(it, i0, probs, lds);
}

template <int NC, int R>
void value_tile(const Item<float>& it, int i0, const float* probs, int lds) {
  constexpr int D = 16 * NC;
  const int pairs = (it.j1 - it.j0 + 1) / 2;
  __m512 acc[R][NC];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int j2 = 0; j2 < pairs; ++j2) {
    const float* row = it.v + (static_cast<int64_t>(it.j0 / 2 + j2) * D) * 2;
    __m512 va[NC], vb[NC];
    for (int c = 0; c < NC; ++c) split_pairs(_mm512_loadu_ps(row + 32 * c), _mm512_loadu_ps(row + 32 * c + 16), va[c], vb[c]);
    for (int i = 0; i < R; ++i) {
      const __m512 pa = _mm512_set1_ps(probs[(i0 + i) * lds + 2 * j2]);
      const __m512 pb = _mm512_set1_ps(probs[(i0 + i) * lds + 2 * j2 + 1]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(pb, vb[c], _mm512_fmadd_ps(pa, va[c], acc[i][c]));
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(it.state + (i0 + i) * (2 + D) + 2 + 16 * c, acc[i][c]);
}

// Each of ``rows`` score rows (``width`` scores, row stride ``lds``, a multiple of 16) becomes
// e^(s - max), zero past ``width``; state row i (stride 2 + D) gets (max, sum).
inline void softmax_rows(float* scores, int rows, int width, int lds, float* state, int D) {
  for (int i = 0; i < rows; ++i) {
    float* s = scores + i * lds;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < width; j += 16) mx = _mm512_mask_max_ps(mx, lanes(width - j), mx, _mm512_loadu_ps(s + j));
    const float top = _mm512_reduce_max_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < width; j += 16) {
      const __mmask16 m = lanes(width - j);
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(top))));
      _mm512_storeu_ps(s + j, e);  // zero past the last key
      sum = _mm512_add_ps(sum, e);
    }
    state[i * (2 + D)] = top;
    state[i * (2 + D) + 1] = _mm512_reduce_add_ps(sum);
  }
}

// fp32 x -> (bf16 hi, bf16 lo) with hi + lo = x to about 2^-16 relative, n values.
inline void split_bf16(const float* x, bf16* hi, bf16* lo, int n) {
  for (int j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    _mm256_mask_storeu_epi16(hi + j, m, (__m256i)h);
    if (lo) _mm256_mask_storeu_epi16(lo + j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
  }
}

// One chunk of a master as two matrix products (torch's cpublas::brgemm on plain row-major
// operands, which torch runs as its bf16 GEMM with fp32 output: oneDNN's matmul, on AMX tiles
// where the CPU has them, AVX-512 BF16 here): scores = Q K^T, softmax in fp32, then
// P V, both with fp32 sums. Operands bf16 does not hold (queries rotated into the master's
// frame, probabilities) enter as two bf16 rows each when ``split`` (a master level always:
// value, then what its rounding left; the halves' products are added in fp32), so the products
// keep fp32 operands to about 2^-16, as the vector loops do: twice the products, one contract.
template <int NC>
void run_gemm_item(const Item<bf16>& it, float scale, std::vector<float>& buf,
                   std::vector<bf16>& probs) {
  constexpr int D = 16 * NC;
  const int rows = it.rows, m = it.split ? 2 * rows : rows;
  const int width = it.j1 - it.j0, even = (width + 1) & ~1, lds = (width + 15) & ~15;
  buf.resize(static_cast<size_t>(m) * lds + static_cast<size_t>(m) * D);
  float* scores = buf.data();
  float* outs = scores + static_cast<size_t>(m) * lds;
  at::native::cpublas::brgemm(m, width, D, D, it.ld, lds, false, it.qa, it.k, scores, false);
  for (int i = 0; i < rows; ++i) {
    float* s = scores + i * lds;
    const float* lo = scores + (rows + i) * lds;
    const float* b = it.bias[i] + it.j0;
    for (int j = 0; j < width; j += 16) {
      const __mmask16 k = lanes(width - j);
      __m512 x = _mm512_maskz_loadu_ps(k, s + j);
      if (it.split) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, lo + j));
      _mm512_mask_storeu_ps(s + j, k, _mm512_fmadd_ps(x, _mm512_set1_ps(scale), _mm512_maskz_loadu_ps(k, b + j)));
    }
  }
  softmax_rows(scores, rows, width, lds, it.state, D);
  probs.assign(static_cast<size_t>(m) * even, bf16(0.f));
  for (int i = 0; i < rows; ++i)
    split_bf16(scores + i * lds, probs.data() + i * even, it.split ? probs.data() + (rows + i) * even : nullptr, width);
  at::native::cpublas::brgemm(m, D, even, even, D, D, false, probs.data(), it.v, outs, false);
  for (int i = 0; i < rows; ++i) {
    float* dst = it.state + i * (2 + D) + 2;
    for (int c = 0; c < NC; ++c) {
      __m512 x = _mm512_loadu_ps(outs + i * D + 16 * c);
      if (it.split) x = _mm512_add_ps(x, _mm512_loadu_ps(outs + (rows + i) * D + 16 * c));
      _mm512_storeu_ps(dst + 16 * c, x);
    }
  }
}

template <typename T, int NC>
void run_item(const Item<T>& it, float scale, std::vector<float>& buf) {
  constexpr int D = 16 * NC;
  const int width = it.j1 - it.j0;
  const int lds = (width + 16) & ~15;  // room for a zero probability past an odd last key
  // every score a later pass reads is written first (softmax zeroes past ``width`` in its tile)
  buf.resize(std::max(buf.size(), static_cast<size_t>(it.rows) * lds));
  float* scores = buf.data();
  for (int i0 = 0; i0 < it.rows; i0 += kRows) {
    switch (std::min(kRows, it.rows - i0)) {
#define KMESH_SCORE(R) case R: score_tile<NC, R>(it, i0, scale, scores, lds); break;
      KMESH_SCORE(1) KMESH_SCORE(2) KMESH_SCORE(3) KMESH_SCORE(4) KMESH_SCORE(5) KMESH_SCORE(6)
      KMESH_SCORE(7) KMESH_SCORE(8) KMESH_SCORE(9) KMESH_SCORE(10) KMESH_SCORE(11) KMESH_SCORE(12)
#undef KMESH_SCORE
    }
  }
  softmax_rows(scores, it.rows, width, lds, it.state, D);
  constexpr int R2 = NC <= 4 ? 4 : 2;
  for (int i0 = 0; i0 < it.rows; i0 += R2) {
    switch (std::min(R2, it.rows - i0)) {
#define KMESH_VALUE(R) case R: value_tile<NC, (R <= R2 ? R : 1)>(it, i0, scores, lds); break;
      KMESH_VALUE(1) KMESH_VALUE(2) KMESH_VALUE(3) KMESH_VALUE(4)
#undef KMESH_VALUE
    }
  }
}

template <typename T, int NC>
void cascade(at::Tensor& out, const at::Tensor& tokens, const at::Tensor& query,
             const at::Tensor& key, const at::Tensor& value, at::Tensor& own_k,
             at::Tensor& own_v, at::Tensor& own_bias, const at::Tensor& own_slots,
             const at::Tensor& cols, at::TensorList master_k, at::TensorList master_v, at::TensorList master_bias,
             at::TensorList rotations, double scale, bool exact) {
  constexpr int D = 16 * NC;
  const int64_t n = tokens.size(0), H = query.size(1), Hkv = own_k.size(1), G = H / Hkv;
  const int64_t C = own_k.size(2) * 16, M = static_cast<int64_t>(master_k.size());
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* col = cols.data_ptr<int64_t>();
  const int64_t* slot = own_slots.data_ptr<int64_t>();
  T* ok = own_k.data_ptr<T>();
  T* ov = own_v.data_ptr<T>();
  float* ob = own_bias.data_ptr<float>();
  const int64_t obs = own_bias.stride(0);
  // This step's key/value join each request's own rows.
  for (int64_t r = 0; r < n; ++r) {
    const T* k = key.data_ptr<T>() + tok[r] * key.stride(0);
    const T* v = value.data_ptr<T>() + tok[r] * value.stride(0);
    const int64_t c = col[r], s = slot[r];
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t d = 0; d < D; ++d) {
        ok[(s * Hkv + h) * D * C + ((c / 16) * (D / 2) + d / 2) * 32 + (c % 16) * 2 + d % 2] = k[h * D + d];
        ov[(s * Hkv + h) * C * D + ((c / 2) * D + d) * 2 + c % 2] = v[h * D + d];
      }
    ob[s * obs + c] = 0.f;
  }
  // Queries in fp32: level 0 as given, level 1 + g rotated into master g's frame (q . R_rg);
  // then as bf16 pairs of dimensions for the dot-product instruction, with their residuals.
  const int64_t rows = (1 + M) * n * H;
  // every element below is written before it is read: no zero fill (this runs once per layer)
  std::unique_ptr<float[]> qf(new float[rows * D]);
  std::unique_ptr<uint32_t[]> qp(new uint32_t[rows * D]);  // pairs: rounded, then residuals
  for (int64_t r = 0; r < n; ++r) {
    const T* q = query.data_ptr<T>() + tok[r] * query.stride(0);
    for (int64_t i = 0; i < H * D; ++i) qf[r * H * D + i] = to_float(q[i]);
  }
  at::parallel_for(0, M * n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gr = begin; gr < end; ++gr) {
      const int64_t g = gr / n, r = gr % n;
      const float* rot = rotations[g].data_ptr<float>() + r * D * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* q = qf.get() + (r * H + h) * D;
        __m512 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d)
          for (int c = 0; c < NC; ++c)
            acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_loadu_ps(rot + d * D + 16 * c), acc[c]);
        float* dst = qf.get() + (((1 + g) * n + r) * H + h) * D;
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + 16 * c, acc[c]);
      }
    }
  });
  // a pair of bf16 (dimension 2i low, 2i + 1 high) is the bf16 array's memory layout
  split_bf16(qf.get(), reinterpret_cast<bf16*>(qp.get()), reinterpret_cast<bf16*>(qp.get() + rows * D / 2),
             static_cast<int>(rows * D));
  // Per master, the requests that read it in this layer (a bias row with a key not masked):
  // the others would only add zero-weight states, at the cost of a full pass over its keys
  // (requests of several families joined by a common short segment read one document each).
  std::vector<std::vector<int64_t>> readers(static_cast<size_t>(M));
  for (int64_t g = 0; g < M; ++g) {
    const float* mb = master_bias[g].data_ptr<float>();
    const int64_t S = master_bias[g].size(1), mbs = master_bias[g].stride(0);
    for (int64_t r = 0; r < n; ++r) {
      const float* b = mb + r * mbs;
      if (std::any_of(b, b + S, [](float x) { return x > kMaskedBelow; })) readers[g].push_back(r);
    }
  }
  // GEMM levels (masters in chunks): per (master, KV head) its readers' query rows as one bf16
  // matrix, then (split) what their rounding left.
  const int64_t G2 = 2 * n * G;
  std::vector<bf16> qa;
  bool any_gemm = false;
  for (int64_t g = 0; g < M; ++g) any_gemm = any_gemm || master_k[g].dim() == 4;
  if (any_gemm) {
    qa.resize(static_cast<size_t>(M * Hkv * G2 * D));
    for (int64_t g = 0; g < M; ++g) {
      const int64_t k = static_cast<int64_t>(readers[g].size());
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t a = 0; a < k; ++a)
          for (int64_t i = 0; i < G; ++i) {
            const int64_t r = readers[g][a];
            bf16* dst = qa.data() + ((g * Hkv + h) * G2 + a * G + i) * D;
            split_bf16(qf.get() + (((1 + g) * n + r) * H + h * G + i) * D, dst, dst + k * G * D, D);
          }
    }
  }
  // Work items: own rows per (request, KV head); each master per (KV head, chunk of keys).
  std::vector<Item<T>> items;
  {
    int64_t count = n * Hkv;  // items are 2 KiB: no regrowth copies
    for (int64_t g = 0; g < M; ++g) {
      const int64_t step = master_k[g].dim() == 4 ? master_k[g].size(3) : kChunk;
      if (!readers[g].empty()) count += Hkv * ((master_bias[g].size(1) + step - 1) / step);
    }
    items.reserve(static_cast<size_t>(count));
  }
  std::vector<int64_t> first_chunk(M + 1, 0);  // item index of master g's first chunk
  auto query_row = [&](int64_t level, int64_t r, int64_t hq, Item<T>& it, int i) {
    const int64_t at = ((level * n + r) * H + hq) * D;
    it.q[i] = qf.get() + at;
    it.qp[i] = qp.get() + at / 2;
    it.ql[i] = qp.get() + rows * D / 2 + at / 2;
    it.split = level > 0 && exact;
    it.exact = exact;
  };
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < Hkv; ++h) {
      Item<T>& it = items.emplace_back();  // zeroed in place: items are 2 KiB
      it.rows = static_cast<int>(G);
      for (int64_t i = 0; i < G; ++i) {
        query_row(0, r, h * G + i, it, static_cast<int>(i));
        it.bias[i] = ob + slot[r] * obs;
      }
      it.k = ok + (slot[r] * Hkv + h) * D * C;
      it.v = ov + (slot[r] * Hkv + h) * C * D;
      it.j0 = 0;
      // up to the slot's last column not masked: a slot's width has headroom past its rows
      int64_t used = C;
      while (used > 0 && ob[slot[r] * obs + used - 1] <= kMaskedBelow) --used;
      it.j1 = static_cast<int>(used);
    }
  for (int64_t g = 0; g < M; ++g) {
    first_chunk[g] = static_cast<int64_t>(items.size());
    const int64_t S = master_bias[g].size(1), S16 = master_k[g].size(1), S2 = master_v[g].size(1);
    const float* mb = master_bias[g].data_ptr<float>();
    const int64_t mbs = master_bias[g].stride(0);
    const bool gemm = master_k[g].dim() == 4;  // [Hkv, chunks, D, width]: chunk j is a GEMM
    const int64_t step = gemm ? master_k[g].size(3) : kChunk;
    const int64_t k = static_cast<int64_t>(readers[g].size());
    for (int64_t h = 0; h < Hkv && k > 0; ++h)
      for (int64_t j0 = 0; j0 < S; j0 += step) {
        Item<T>& it = items.emplace_back();  // zeroed in place: items are 2 KiB
        it.rows = static_cast<int>(k * G);
        for (int64_t a = 0; a < k; ++a)
          for (int64_t i = 0; i < G; ++i) {
            const int64_t r = readers[g][a];
            query_row(1 + g, r, h * G + i, it, static_cast<int>(a * G + i));
            it.bias[a * G + i] = mb + r * mbs;
          }
        it.k = master_k[g].data_ptr<T>() + h * S16 * 16 * D;
        it.v = master_v[g].data_ptr<T>() + h * S2 * D * 2;
        it.j0 = static_cast<int>(j0);
        it.j1 = static_cast<int>(std::min<int64_t>(S, j0 + step));
        if (gemm) {
          const int64_t chunk = h * S16 + j0 / step;  // S16: the chunk count here
          it.k = master_k[g].data_ptr<T>() + chunk * D * step;
          it.v = master_v[g].data_ptr<T>() + chunk * step * D;
          it.ld = static_cast<int>(step);
          it.qa = reinterpret_cast<const bf16*>(qa.data()) + (g * Hkv + h) * G2 * D;
        }
        }
  }
  first_chunk[M] = static_cast<int64_t>(items.size());
  std::vector<int64_t> state_at(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) state_at[i + 1] = state_at[i] + items[i].rows * (2 + D);
  // every state is written by its item (softmax: max and sum; values: the rest) before the merge
  std::unique_ptr<float[]> states(new float[state_at.back()]);
  for (size_t i = 0; i < items.size(); ++i) items[i].state = states.get() + state_at[i];
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  std::exception_ptr failed = nullptr;  // an exception must not leave the parallel region
  std::atomic<bool> stop{false};
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(total, at::get_num_threads())))
  {
    std::vector<float> buf;
    std::vector<bf16> probs;
    try {
      for (int64_t i = next++; i < total && !stop; i = next++) {
        if constexpr (std::is_same_v<T, bf16>) {
          if (items[i].qa != nullptr) {
            run_gemm_item<NC>(items[i], static_cast<float>(scale), buf, probs);
            continue;
          }
        }
        run_item<T, NC>(items[i], static_cast<float>(scale), buf);
      }
    } catch (...) {
#pragma omp critical(kmesh_cascade_failed)
      if (!failed) failed = std::current_exception();
      stop = true;
    }
  }
  if (failed) std::rethrow_exception(failed);
  // Merge per (request, query head): own state, then every chunk of every master it reads.
  std::vector<std::vector<int64_t>> place(static_cast<size_t>(M), std::vector<int64_t>(n, -1));
  for (int64_t g = 0; g < M; ++g)
    for (size_t a = 0; a < readers[g].size(); ++a) place[g][readers[g][a]] = static_cast<int64_t>(a);
  T* o = out.data_ptr<T>();
  // Per (request, query head) on the intra-op threads: vectors of D, the parts' weights e^(max - top).
  at::parallel_for(0, n * H, 8, [&](int64_t begin, int64_t end) {
    std::vector<const float*> parts;
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, hq = rh % H, h = hq / G, i = hq % G;
      parts.assign(1, items[r * Hkv + h].state + i * (2 + D));
      for (int64_t g = 0; g < M; ++g) {
        const int64_t chunks = (first_chunk[g + 1] - first_chunk[g]) / Hkv, a = place[g][r];
        for (int64_t c = 0; c < chunks && a >= 0; ++c)
          parts.push_back(items[first_chunk[g] + h * chunks + c].state + (a * G + i) * (2 + D));
      }
      float top = -INFINITY;
      for (const float* p : parts) top = std::max(top, p[0]);
      float sum = 0.f;
      __m512 acc[NC];
      for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
      for (const float* p : parts) {
        const float w = std::exp(p[0] - top);
        sum += w * p[1];
        const __m512 wv = _mm512_set1_ps(w);
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(p + 2 + 16 * c), acc[c]);
      }
      float res[D];
      const __m512 den = _mm512_set1_ps(sum);
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(res + 16 * c, _mm512_div_ps(acc[c], den));
      T* dst = o + tok[r] * out.stride(0) + hq * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(res[d]);
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "kmesh cascade_decode: ", what); }

}  // namespace

// Shapes (X: float32 or bfloat16, the same for every K/V/query/output tensor; all on CPU):
//   out [T, H, D], query [T, H, D], key/value [T, Hkv, D]: the step's tokens; rows tokens[r]
//     (int64 [n]) are the n cascade requests'.
//   own_k [P, Hkv, C/16, D/2, 16, 2] (keys: tiles of 16 by pairs of dimensions), own_v
//     [P, Hkv, C/2, D, 2] (values, pairs of rows), C a multiple of 16, contiguous; own_bias [P, C]
//     fp32: a pool of P slots of own rows, request r's in slot own_slots[r] (int64 [n], distinct;
//     the other slots are neither read nor written); cols int64 [n]: the own column this step's
//     key/value are written to (and its bias set to 0).
//   per master g: k [Hkv, ceil(S/16), D/2, 16, 2], v [Hkv, ceil(S/2), D, 2] (zero rows past S),
//     contiguous; bias [n, S] fp32; rotation [n, D, D] fp32 (request r's query in g's frame is
//     q . rotation[r]).
// Biases: 0 where the request reads the key, -1e30 where not; any row stride, unit column stride.
// exact (bf16): the operands bf16 does not hold (queries rotated into a master's frame,
// probabilities) enter as two bf16 terms, products as exact as fp32 at about twice the master
// level's products; else as one, rounded once, as vLLM's own bf16 kernels round their operands.
void cascade_decode(at::Tensor out, at::Tensor tokens, at::Tensor query, at::Tensor key,
                    at::Tensor value, at::Tensor own_k, at::Tensor own_v, at::Tensor own_bias,
                    at::Tensor own_slots, at::Tensor cols, at::TensorList master_k, at::TensorList master_v,
                    at::TensorList master_bias, at::TensorList rotations, double scale, bool exact) {
  const auto X = query.scalar_type();
  check(X == at::kFloat || X == at::kBFloat16, "query dtype must be float32 or bfloat16");
  for (const at::Tensor* t : {&out, &key, &value, &own_k, &own_v})
    check(t->scalar_type() == X && t->device().is_cpu(), "out/key/value/own rows: query's dtype, on CPU");
  check(query.dim() == 3 && out.dim() == 3 && key.dim() == 3 && value.dim() == 3, "query/out/key/value are 3-d");
  const int64_t n = tokens.size(0), H = query.size(1), D = query.size(2);
  check(tokens.scalar_type() == at::kLong && cols.scalar_type() == at::kLong && cols.size(0) == n &&
            tokens.is_contiguous() && cols.is_contiguous(), "tokens/cols: contiguous int64 [n]");
  check(own_k.dim() == 6 && own_k.is_contiguous() && own_v.is_contiguous(), "own_k: contiguous [P, Hkv, C/16, D/2, 16, 2]");
  const int64_t P = own_k.size(0), Hkv = own_k.size(1), C = own_k.size(2) * 16;
  check(own_k.sizes() == at::IntArrayRef({P, Hkv, C / 16, D / 2, 16, 2}), "own_k: [P, Hkv, C/16, D/2, 16, 2]");
  check(n >= 1 && Hkv >= 1 && H % Hkv == 0 && n * (H / Hkv) <= 64, "heads: H a multiple of Hkv, n * H / Hkv <= 64");
  check(own_v.sizes() == at::IntArrayRef({P, Hkv, C / 2, D, 2}), "own_v: [P, Hkv, C/2, D, 2]");
  check(own_bias.scalar_type() == at::kFloat && own_bias.dim() == 2 && own_bias.size(0) == P &&
            own_bias.size(1) == C && own_bias.stride(1) == 1, "own_bias: fp32 [P, C], unit column stride");
  check(own_slots.scalar_type() == at::kLong && own_slots.dim() == 1 && own_slots.size(0) == n &&
            own_slots.is_contiguous(), "own_slots: contiguous int64 [n]");
  {
    const int64_t* slot = own_slots.data_ptr<int64_t>();
    std::vector<bool> taken(static_cast<size_t>(P), false);
    for (int64_t r = 0; r < n; ++r) {
      check(slot[r] >= 0 && slot[r] < P && !taken[slot[r]], "own_slots: distinct slots within the pool");
      taken[slot[r]] = true;
    }
  }
  for (const at::Tensor* t : {&out, &query, &key, &value})
    check(t->stride(2) == 1 && t->stride(1) == t->size(2), "query/out/key/value: rows of [heads, D] contiguous");
  check(key.size(1) == Hkv && value.size(1) == Hkv && key.size(2) == D && out.size(1) == H && out.size(2) == D,
        "key/value [T, Hkv, D], out [T, H, D]");
  const int64_t M = static_cast<int64_t>(master_k.size());
  check(master_v.size() == master_k.size() && master_bias.size() == master_k.size() &&
            rotations.size() == master_k.size(), "one v, bias and rotation per master");
  for (int64_t g = 0; g < M; ++g) {
    check(master_k[g].scalar_type() == X && master_v[g].scalar_type() == X, "masters: query's dtype");
    check(master_bias[g].dim() == 2, "master bias: [n, S]");
    const int64_t S = master_bias[g].size(1);
    if (master_k[g].dim() == 4) {  // chunks for the GEMM level
      check(X == at::kBFloat16, "masters in chunks (the GEMM level) are bfloat16");
      const int64_t W = master_k[g].size(3), chunks = master_k[g].size(1);
      check(W >= 2 && W % 2 == 0 && chunks == (S + W - 1) / W, "master chunks: an even width W, ceil(S/W) chunks");
      check(master_k[g].is_contiguous() && master_k[g].sizes() == at::IntArrayRef({Hkv, chunks, D, W}), "master k: contiguous [Hkv, ceil(S/W), D, W]");
      check(master_v[g].is_contiguous() && master_v[g].sizes() == at::IntArrayRef({Hkv, chunks, W, D}), "master v: contiguous [Hkv, ceil(S/W), W, D]");
    } else {
      check(master_k[g].dim() == 5 && master_k[g].is_contiguous() && master_k[g].sizes() == at::IntArrayRef({Hkv, (S + 15) / 16, D / 2, 16, 2}), "master k: contiguous [Hkv, ceil(S/16), D/2, 16, 2]");
      check(master_v[g].is_contiguous() && master_v[g].sizes() == at::IntArrayRef({Hkv, (S + 1) / 2, D, 2}), "master v: contiguous [Hkv, ceil(S/2), D, 2]");
    }
    check(master_bias[g].scalar_type() == at::kFloat && master_bias[g].size(0) == n && master_bias[g].size(1) == S &&
              master_bias[g].stride(1) == 1, "master bias: fp32 [n, S], unit column stride");
    check(rotations[g].scalar_type() == at::kFloat && rotations[g].is_contiguous() &&
              rotations[g].sizes() == at::IntArrayRef({n, D, D}), "rotation: contiguous fp32 [n, D, D]");
  }
  const int64_t T = query.size(0);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* col = cols.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    check(tok[r] >= 0 && tok[r] < T && tok[r] < key.size(0) && tok[r] < value.size(0) && tok[r] < out.size(0) &&
              col[r] >= 0 && col[r] < C, "tokens within the step, cols within the own rows");
  switch (D) {
#define KMESH_CASE(NC)                                                                           \
  case 16 * NC:                                                                                \
    if (X == at::kFloat)                                                                       \
      cascade<float, NC>(out, tokens, query, key, value, own_k, own_v, own_bias, own_slots,    \
                         cols,                                                                 \
                         master_k, master_v, master_bias, rotations, scale, exact);                   \
    else                                                                                       \
      cascade<bf16, NC>(out, tokens, query, key, value, own_k, own_v, own_bias, own_slots,     \
                        cols,                                                                  \
                        master_k, master_v, master_bias, rotations, scale, exact);                    \
    break;
    KMESH_CASE(2) KMESH_CASE(4) KMESH_CASE(8)
#undef KMESH_CASE
    default:
      check(false, "head size must be 32, 64 or 128");
  }
}

TORCH_LIBRARY(kmesh_cpu, m) { m.def("cascade_decode", &cascade_decode); }
