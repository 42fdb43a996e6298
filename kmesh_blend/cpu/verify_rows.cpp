// Verifying a reader's paged rows against a master in one pass (kmesh_blend.vllm.decode_plan):
// row j passes when its value equals the master's bit for bit and its key equals the master's
// key rotated by one shift (RoPE, fp32) within one rounding of the cache dtype. The same test as
// the plain-torch one (decode_plan._same_bits, _close) without its gathers and temporaries:
// arming a reader was ≈ 1 ms per layer for 1,024 rows in torch ops, most of it copies.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

namespace {

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// k / v: the cache's views [blocks, Hkv, bs, D] (any strides); slots [S]; master k / v [S, Hkv, D]
// contiguous; cos / signed_sin [D] fp32 (the shift's rotation: out = x cos + swap(x) sin).
template <typename C, typename M>
void verify(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, const at::Tensor& mk,
            const at::Tensor& mv, const at::Tensor& cos, const at::Tensor& sin, double atol, double rtol,
            at::Tensor& out) {
  const int64_t S = slots.size(0), H = mk.size(1), D = mk.size(2), bs = k.size(2), half = D / 2;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const C* kp = k.data_ptr<C>();
  const C* vp = v.data_ptr<C>();
  const M* mkp = mk.data_ptr<M>();
  const M* mvp = mv.data_ptr<M>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  bool* ok = out.data_ptr<bool>();
  const auto ks = k.strides(), vs = v.strides();
  const float a = static_cast<float>(atol), r = static_cast<float>(rtol);
  at::parallel_for(0, S, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t block = slot[j] / bs, t = slot[j] % bs;
      bool pass = true;
      for (int64_t h = 0; h < H && pass; ++h) {
        const C* krow = kp + block * ks[0] + h * ks[1] + t * ks[2];
        const C* vrow = vp + block * vs[0] + h * vs[1] + t * vs[2];
        const M* mkrow = mkp + (j * H + h) * D;
        const M* mvrow = mvp + (j * H + h) * D;
        for (int64_t d = 0; d < D && pass; ++d) {
          pass = same_bits(vrow[d * vs[3]], static_cast<C>(as_float(mvrow[d])));
          const float x = as_float(mkrow[d]), swapped = as_float(mkrow[d < half ? d + half : d - half]);
          float want = x * c[d];
          want += swapped * s[d];
          const C got = krow[d * ks[3]];
          if (pass && !same_bits(got, static_cast<C>(want)))
            pass = std::fabs(as_float(got) - want) <= a + r * std::fabs(want);
        }
      }
      ok[j] = pass;
    }
  });
}

// The common case in vector code: bf16 cache and master, values contiguous per row, D a multiple
// of 32 (each 16-lane group's rotation partner is one group): per row and head, V compared as
// bytes, K's D elements picked out of the cache once (vLLM's CPU cache holds K transposed per
// block), the master key rotated 16 lanes at a time (separate products and sum, as torch's
// rotate rounds them) and rounded to bf16; lanes that differ are measured against the tolerance.
void verify_bf16(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, const at::Tensor& mk,
                 const at::Tensor& mv, const at::Tensor& cos, const at::Tensor& sin, double atol, double rtol,
                 at::Tensor& out) {
  using bf16 = c10::BFloat16;
  const int64_t S = slots.size(0), H = mk.size(1), D = mk.size(2), bs = k.size(2), half = D / 2;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<bf16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<bf16>());
  const auto* mkp = reinterpret_cast<const uint16_t*>(mk.data_ptr<bf16>());
  const auto* mvp = reinterpret_cast<const uint16_t*>(mv.data_ptr<bf16>());
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  bool* ok = out.data_ptr<bool>();
  const auto ks = k.strides(), vs = v.strides();
  const __m512 a = _mm512_set1_ps(static_cast<float>(atol)), r = _mm512_set1_ps(static_cast<float>(rtol));
  auto widen = [](__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); };
  at::parallel_for(0, S, 64, [&](int64_t j0, int64_t j1) {
    alignas(64) uint16_t got[128];
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t block = slot[j] / bs, t = slot[j] % bs;
      bool pass = true;
      for (int64_t h = 0; h < H && pass; ++h) {
        const uint16_t* vrow = vp + block * vs[0] + h * vs[1] + t * vs[2];
        const uint16_t* mkrow = mkp + (j * H + h) * D;
        pass = std::memcmp(vrow, mvp + (j * H + h) * D, static_cast<size_t>(D) * 2) == 0;
        const uint16_t* krow = kp + block * ks[0] + h * ks[1] + t * ks[2];
        for (int64_t d = 0; d < D && pass; ++d) got[d] = krow[d * ks[3]];
        for (int64_t d = 0; d < D && pass; d += 16) {
          const int64_t e = d < half ? d + half : d - half;
          const __m512 x = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mkrow + d)));
          const __m512 sw = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mkrow + e)));
          const __m512 want = _mm512_add_ps(_mm512_mul_ps(x, _mm512_loadu_ps(c + d)), _mm512_mul_ps(sw, _mm512_loadu_ps(s + d)));
          const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(want);
          const __m256i have = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(got + d));
          const __mmask16 same = _mm256_cmpeq_epi16_mask(rounded, have);
          if (same == 0xFFFF) continue;
          const __m512 diff = _mm512_abs_ps(_mm512_sub_ps(widen(have), want));
          const __m512 bound = _mm512_fmadd_ps(r, _mm512_abs_ps(want), a);
          pass = static_cast<__mmask16>(same | _mm512_cmp_ps_mask(diff, bound, _CMP_LE_OQ)) == 0xFFFF;
        }
      }
      ok[j] = pass;
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "kmesh verify_rows: ", what); }

}  // namespace

// Which of S rows passes, bool [S]: k_view / v_view [blocks, Hkv, bs, D] the paged cache's
// views (float32 or bfloat16, any strides), slots int64 [S], master_k / master_v [S, Hkv, D]
// contiguous (float32 or bfloat16), cos / signed_sin fp32 [D], (atol, rtol) as decode_plan's.
at::Tensor verify_rows(at::Tensor k_view, at::Tensor v_view, at::Tensor slots, at::Tensor master_k,
                       at::Tensor master_v, at::Tensor cos, at::Tensor signed_sin, double atol, double rtol) {
  const auto C = k_view.scalar_type(), M = master_k.scalar_type();
  check(C == v_view.scalar_type() && (C == at::kFloat || C == at::kBFloat16), "k_view/v_view: one dtype, float32 or bfloat16");
  check(M == master_v.scalar_type() && (M == at::kFloat || M == at::kBFloat16), "master_k/master_v: one dtype, float32 or bfloat16");
  check(k_view.dim() == 4 && v_view.dim() == 4 && k_view.sizes() == v_view.sizes(), "k_view/v_view: [blocks, Hkv, bs, D]");
  check(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots: contiguous int64 [S]");
  const int64_t S = slots.size(0), H = k_view.size(1), D = k_view.size(3);
  check(master_k.is_contiguous() && master_v.is_contiguous() && master_k.sizes() == at::IntArrayRef({S, H, D}) &&
            master_v.sizes() == master_k.sizes(), "master_k/master_v: contiguous [S, Hkv, D]");
  check(D % 2 == 0 && cos.scalar_type() == at::kFloat && signed_sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
            signed_sin.is_contiguous() && cos.numel() == D && signed_sin.numel() == D, "cos/signed_sin: contiguous fp32 [D], D even");
  const int64_t cells = k_view.size(0) * k_view.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < S; ++j) check(slot[j] >= 0 && slot[j] < cells, "slots within the cache");
  at::Tensor out = at::empty({S}, at::kBool);
  if (C == at::kFloat && M == at::kFloat) verify<float, float>(k_view, v_view, slots, master_k, master_v, cos, signed_sin, atol, rtol, out);
  if (C == at::kFloat && M == at::kBFloat16) verify<float, c10::BFloat16>(k_view, v_view, slots, master_k, master_v, cos, signed_sin, atol, rtol, out);
  if (C == at::kBFloat16 && M == at::kFloat) verify<c10::BFloat16, float>(k_view, v_view, slots, master_k, master_v, cos, signed_sin, atol, rtol, out);
  if (C == at::kBFloat16 && M == at::kBFloat16 && v_view.stride(3) == 1 && D % 32 == 0 && D <= 128)
    verify_bf16(k_view, v_view, slots, master_k, master_v, cos, signed_sin, atol, rtol, out);
  else if (C == at::kBFloat16 && M == at::kBFloat16) verify<c10::BFloat16, c10::BFloat16>(k_view, v_view, slots, master_k, master_v, cos, signed_sin, atol, rtol, out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(kmesh_cpu, m) { m.def("verify_rows", &verify_rows); }
