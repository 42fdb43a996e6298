// Re-positioning stored keys into a blend's frame in one pass (kmesh_blend.ops.reposition_keys
// on CPU tensors): the keys, rotated at their stored positions, move by their shifts — the same
// math and the same roundings as the fp32 torch reference (kmesh_blend.ops.reference:
// x*C, then + swap(x)*S, each product and the sum rounded to fp32, then to the output's dtype),
// without its six passes and temporaries per call (≈ 60 µs a call in torch ops for a 192-token
// segment, 30 layers × every segment of a prompt). And drift correction's shift of a segment's
// stale rows, in place (`shift_rows`: the keys' shift rotated to each row's position and added,
// the values' added), the same bits as `shift_rows_reference`; and its estimate (`drift_means`:
// the mean drift of some rows, keys turned back to position 0, in one pass instead of a dozen
// torch ops per layer and segment; summed in double, within 1e-6 of `drift_means_reference`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "kmesh reposition: ", what); }

template <typename In, typename Out>
void rotate_rows(const at::Tensor& k, const at::Tensor& c, const at::Tensor& s, at::Tensor& out) {
  const int64_t n = k.size(0), H = k.size(1), D = k.size(2), half = D / 2;
  const bool shared = c.size(0) == 1;  // one shift for every row: one table row
  const auto* kp = k.data_ptr<In>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  auto* op = out.data_ptr<Out>();
  const auto ks = k.strides(), os = out.strides();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* ci = cp + (shared ? 0 : i * D);
      const float* si = sp + (shared ? 0 : i * D);
      for (int64_t h = 0; h < H; ++h) {
        const In* x = kp + i * ks[0] + h * ks[1];
        Out* y = op + i * os[0] + h * os[1];
        for (int64_t d = 0; d < D; ++d) {
          const float xd = static_cast<float>(x[d * ks[2]]);
          const float xs = static_cast<float>(x[(d < half ? d + half : d - half) * ks[2]]);
          const float a = xd * ci[d];  // rounded on its own (-ffp-contract=off)
          const float b = xs * si[d];
          y[d * os[2]] = static_cast<Out>(a + b);
        }
      }
    }
  });
}

template <typename In>
void dispatch_out(const at::Tensor& k, const at::Tensor& c, const at::Tensor& s, at::Tensor& out) {
  switch (out.scalar_type()) {
    case at::kFloat: return rotate_rows<In, float>(k, c, s, out);
    case at::kBFloat16: return rotate_rows<In, at::BFloat16>(k, c, s, out);
    case at::kHalf: return rotate_rows<In, at::Half>(k, c, s, out);
    default: check(false, "out must be float32, bfloat16 or float16");
  }
}

// Drift correction's shift of a segment's stale rows (kmesh_blend.blend.drift), in place.
template <typename T>
void shift_rows_impl(at::Tensor& k, at::Tensor& v, const at::Tensor& shift_k,
                     const at::Tensor& shift_v, const at::Tensor& cos, const at::Tensor& ssin) {
  const int64_t n = k.size(0), H = k.size(1), D = k.size(2), half = D / 2;
  auto* kp = k.data_ptr<T>();
  auto* vp = v.data_ptr<T>();
  const float* sk = shift_k.data_ptr<float>();
  const float* sv = shift_v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = ssin.data_ptr<float>();
  const auto ks = k.strides(), vs = v.strides();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        T* x = kp + i * ks[0] + h * ks[1];
        T* y = vp + i * vs[0] + h * vs[1];
        const float* s = sk + h * D;
        for (int64_t d = 0; d < D; ++d) {
          const float a = s[d] * cp[i * D + d];  // each product and sum rounded on its own
          const float b = s[d < half ? d + half : d - half] * sp[i * D + d];
          const float turned = a + b;
          x[d * ks[2]] = static_cast<T>(static_cast<float>(x[d * ks[2]]) + turned);
          y[d * vs[2]] = static_cast<T>(static_cast<float>(y[d * vs[2]]) + sv[h * D + d]);
        }
      }
    }
  });
}

// Drift correction's estimate: the mean over some rows of fresh − stored, keys turned back.
template <typename T>
void drift_means_impl(const at::Tensor& fk, const at::Tensor& sk, const at::Tensor& fv,
                      const at::Tensor& sv, const at::Tensor& cos, const at::Tensor& ssin,
                      const at::Tensor& rows, at::Tensor& mean_k, at::Tensor& mean_v) {
  const int64_t m = rows.size(0), H = fk.size(1), D = fk.size(2), half = D / 2;
  const int64_t* at = rows.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = ssin.data_ptr<float>();
  float* mk = mean_k.data_ptr<float>();
  float* mv = mean_v.data_ptr<float>();
  const auto fks = fk.strides(), sks = sk.strides(), fvs = fv.strides(), svs = sv.strides();
  const auto* fkp = fk.data_ptr<T>();
  const auto* skp = sk.data_ptr<T>();
  const auto* fvp = fv.data_ptr<T>();
  const auto* svp = sv.data_ptr<T>();
  std::vector<double> acc_k(H * D, 0.0), acc_v(H * D, 0.0);  // exact enough in any row order
  for (int64_t j = 0; j < m; ++j) {
    const int64_t i = at[j];
    for (int64_t h = 0; h < H; ++h) {
      const T* a = fkp + i * fks[0] + h * fks[1];
      const T* b = skp + i * sks[0] + h * sks[1];
      const T* c = fvp + i * fvs[0] + h * fvs[1];
      const T* e = svp + i * svs[0] + h * svs[1];
      for (int64_t d = 0; d < D; ++d) {
        const int64_t w = d < half ? d + half : d - half;
        const float dd = static_cast<float>(a[d * fks[2]]) - static_cast<float>(b[d * sks[2]]);
        const float dw = static_cast<float>(a[w * fks[2]]) - static_cast<float>(b[w * sks[2]]);
        const float turned = dd * cp[i * D + d] + dw * sp[i * D + d];
        acc_k[h * D + d] += turned;
        acc_v[h * D + d] += static_cast<float>(c[d * fvs[2]]) - static_cast<float>(e[d * svs[2]]);
      }
    }
  }
  for (int64_t x = 0; x < H * D; ++x) {
    mk[x] = static_cast<float>(acc_k[x] / static_cast<double>(m));
    mv[x] = static_cast<float>(acc_v[x] / static_cast<double>(m));
  }
}

}  // namespace

// fresh_k / stored_k / fresh_v / stored_v: [n, Hkv, D] (one float dtype, any strides), keys
// rotated at the rows' positions; cos / signed_sin: [n, D] float32 contiguous, the rotation back
// to position 0; rows: [m] int64 (m >= 1) into n. Returns (mean_k, mean_v), each [Hkv, D]
// float32: the mean over ``rows`` of fresh − stored, keys turned back (summed in double).
std::tuple<at::Tensor, at::Tensor> drift_means(const at::Tensor& fresh_k, const at::Tensor& stored_k,
                                               const at::Tensor& fresh_v, const at::Tensor& stored_v,
                                               const at::Tensor& cos, const at::Tensor& signed_sin,
                                               const at::Tensor& rows) {
  for (const auto* t : {&stored_k, &fresh_v, &stored_v}) {
    check(t->sizes() == fresh_k.sizes() && t->scalar_type() == fresh_k.scalar_type(),
          "fresh and stored rows must be [n, Hkv, D] alike");
  }
  check(fresh_k.device().is_cpu() && fresh_k.dim() == 3, "rows must be [n, Hkv, D] on the CPU");
  check(fresh_k.size(2) % 2 == 0, "D must be even");
  check(cos.scalar_type() == at::kFloat && signed_sin.scalar_type() == at::kFloat &&
            cos.is_contiguous() && signed_sin.is_contiguous() && cos.dim() == 2 &&
            cos.size(0) == fresh_k.size(0) && cos.size(1) == fresh_k.size(2) &&
            signed_sin.sizes() == cos.sizes(),
        "tables must be contiguous float32 [n, D]");
  check(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
            rows.size(0) >= 1,
        "rows must be a non-empty contiguous int64 vector");
  const int64_t n = fresh_k.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j) check(r[j] >= 0 && r[j] < n, "rows out of range");
  auto opts = fresh_k.options().dtype(at::kFloat);
  at::Tensor mean_k = at::empty({fresh_k.size(1), fresh_k.size(2)}, opts);
  at::Tensor mean_v = at::empty({fresh_k.size(1), fresh_k.size(2)}, opts);
  switch (fresh_k.scalar_type()) {
    case at::kFloat:
      drift_means_impl<float>(fresh_k, stored_k, fresh_v, stored_v, cos, signed_sin, rows, mean_k,
                              mean_v);
      break;
    case at::kBFloat16:
      drift_means_impl<at::BFloat16>(fresh_k, stored_k, fresh_v, stored_v, cos, signed_sin, rows,
                                     mean_k, mean_v);
      break;
    case at::kHalf:
      drift_means_impl<at::Half>(fresh_k, stored_k, fresh_v, stored_v, cos, signed_sin, rows,
                                 mean_k, mean_v);
      break;
    default: check(false, "rows must be float32, bfloat16 or float16");
  }
  return {mean_k, mean_v};
}

// k / v: [n, Hkv, D] (in place; float32, bfloat16 or float16 alike; any strides); shift_k /
// shift_v: [Hkv, D] float32 contiguous, the keys' shift unrotated; cos / signed_sin: [n, D]
// float32 contiguous, the rotation to each row's position (cos, (−sin, sin)).
// k[i, h, d] = round(k + (shift_k[h, d]·cos[i, d] + shift_k[h, swap(d)]·signed_sin[i, d]));
// v[i, h, d] = round(v + shift_v[h, d]).
void shift_rows(at::Tensor k, at::Tensor v, const at::Tensor& shift_k, const at::Tensor& shift_v,
                const at::Tensor& cos, const at::Tensor& signed_sin) {
  check(k.device().is_cpu() && v.device().is_cpu(), "tensors must be on the CPU");
  check(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [n, Hkv, D] alike");
  check(k.scalar_type() == v.scalar_type(), "k and v must have one dtype");
  check(k.size(2) % 2 == 0, "D must be even");
  for (const auto* t : {&shift_k, &shift_v, &cos, &signed_sin}) {
    check(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2,
          "shifts and tables must be contiguous float32 matrices");
  }
  check(shift_k.size(0) == k.size(1) && shift_k.size(1) == k.size(2) &&
            shift_v.sizes() == shift_k.sizes(),
        "shifts must be [Hkv, D]");
  check(cos.size(0) == k.size(0) && cos.size(1) == k.size(2) && signed_sin.sizes() == cos.sizes(),
        "tables must be [n, D]");
  if (k.numel() == 0) return;
  switch (k.scalar_type()) {
    case at::kFloat: return shift_rows_impl<float>(k, v, shift_k, shift_v, cos, signed_sin);
    case at::kBFloat16: return shift_rows_impl<at::BFloat16>(k, v, shift_k, shift_v, cos, signed_sin);
    case at::kHalf: return shift_rows_impl<at::Half>(k, v, shift_k, shift_v, cos, signed_sin);
    default: check(false, "k must be float32, bfloat16 or float16");
  }
}

// k: [n, Hkv, D] (float32, bfloat16 or float16; any strides), rotated at old positions;
// c / s: [n or 1, 1, D] float32 contiguous, the signed tables C = (cos, cos), S = (−sin, sin);
// out: [n, Hkv, D] on the CPU (any of the three dtypes, any strides; may be a frame's slice).
// out[i, h, d] = round(k[i, h, d]·C[i, d] + k[i, h, swap(d)]·S[i, d]), swap(d) = d ± D/2.
void reposition(const at::Tensor& k, const at::Tensor& c, const at::Tensor& s, at::Tensor out) {
  check(k.device().is_cpu() && out.device().is_cpu(), "tensors must be on the CPU");
  check(k.dim() == 3 && out.sizes() == k.sizes(), "k and out must be [n, Hkv, D] alike");
  check(k.size(2) % 2 == 0, "D must be even");
  check(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat, "tables must be float32");
  check(c.is_contiguous() && s.is_contiguous() && c.sizes() == s.sizes(), "tables must match");
  check(c.dim() == 3 && c.size(1) == 1 && c.size(2) == k.size(2), "tables must be [n|1, 1, D]");
  check(c.size(0) == k.size(0) || c.size(0) == 1, "tables must have n rows or one");
  if (k.numel() == 0) return;
  switch (k.scalar_type()) {
    case at::kFloat: return dispatch_out<float>(k, c, s, out);
    case at::kBFloat16: return dispatch_out<at::BFloat16>(k, c, s, out);
    case at::kHalf: return dispatch_out<at::Half>(k, c, s, out);
    default: check(false, "k must be float32, bfloat16 or float16");
  }
}

TORCH_LIBRARY_FRAGMENT(kmesh_cpu, m) {
  m.def("reposition", &reposition);
  m.def("shift_rows", &shift_rows);
  m.def("drift_means", &drift_means);
}
