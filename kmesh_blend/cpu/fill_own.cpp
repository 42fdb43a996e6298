// Filling a cascade request's slot of own rows from the paged cache in one pass
// (kmesh_blend.vllm.cascade_buffers.OwnPool.place): per layer, the rows at the given slots copied
// into the kernel's tiles (keys: 16 keys by pairs of dimensions; values: pairs of keys), without
// the gathers, concatenations and layout copies of the torch ops (≈ 15 ms per request over 30
// layers in torch ops, most of it per-op cost; the rows themselves are a few hundred KiB).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "kmesh fill_own: ", what); }

// W: an integer type of the element's width (bits are copied, never converted).
template <typename W>
void fill_layer(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor& own_k,
                at::Tensor& own_v, int64_t slot) {
  const int64_t R = slots.size(0), H = k.size(1), bs = k.size(2), D = k.size(3);
  const int64_t C = own_k.size(2) * 16;
  const int64_t* at = slots.data_ptr<int64_t>();
  const auto* kp = static_cast<const W*>(k.data_ptr());
  const auto* vp = static_cast<const W*>(v.data_ptr());
  W* ok = static_cast<W*>(own_k.data_ptr()) + slot * H * D * C;
  W* ov = static_cast<W*>(own_v.data_ptr()) + slot * H * C * D;
  const auto ks = k.strides(), vs = v.strides();
  for (int64_t j = 0; j < R; ++j) {
    const int64_t block = at[j] / bs, t = at[j] % bs;
    for (int64_t h = 0; h < H; ++h) {
      const W* krow = kp + block * ks[0] + h * ks[1] + t * ks[2];
      const W* vrow = vp + block * vs[0] + h * vs[1] + t * vs[2];
      W* kt = ok + h * D * C + (j / 16) * D * 16 + (j % 16) * 2;  // tile j/16, key j%16
      W* vt = ov + h * C * D + (j / 2) * D * 2 + j % 2;          // pair j/2, key j%2
      for (int64_t d = 0; d < D; ++d) {
        kt[(d / 2) * 32 + d % 2] = krow[d * ks[3]];
        vt[d * 2] = vrow[d * vs[3]];
      }
    }
  }
}

}  // namespace

// Per layer l: rows at slots[l] (int64 [R_l], within the cache) of the paged cache's views
// k_views[l] / v_views[l] [blocks, Hkv, bs, D] (any strides) become columns 0..R_l-1 of slot
// ``slot`` of the pool's own_k[l] [P, Hkv, C/16, D/2, 16, 2] and own_v[l] [P, Hkv, C/2, D, 2]
// (contiguous, the cache's dtype: bits copied; R_l <= C). Other columns and slots untouched.
void fill_own(at::TensorList k_views, at::TensorList v_views, at::TensorList slots, at::TensorList own_k,
              at::TensorList own_v, int64_t slot) {
  const size_t L = k_views.size();
  check(v_views.size() == L && slots.size() == L && own_k.size() == L && own_v.size() == L,
        "one k/v view, slot list and pool tensor pair per layer");
  for (size_t l = 0; l < L; ++l) {
    const at::Tensor &k = k_views[l], &v = v_views[l], &s = slots[l], &pk = own_k[l], &pv = own_v[l];
    check(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "k/v views: [blocks, Hkv, bs, D]");
    const int64_t H = k.size(1), D = k.size(3);
    check(k.scalar_type() == v.scalar_type() && pk.scalar_type() == k.scalar_type() &&
              pv.scalar_type() == k.scalar_type() && k.element_size() <= 4 && k.element_size() >= 2,
          "views and pool: one dtype of 2 or 4 bytes");
    check(pk.dim() == 6 && pk.is_contiguous() && pv.is_contiguous() && pk.size(1) == H &&
              pk.sizes() == at::IntArrayRef({pk.size(0), H, pk.size(2), D / 2, 16, 2}) && D % 2 == 0,
          "own_k: contiguous [P, Hkv, C/16, D/2, 16, 2]");
    const int64_t P = pk.size(0), C = pk.size(2) * 16;
    check(pv.sizes() == at::IntArrayRef({P, H, C / 2, D, 2}), "own_v: contiguous [P, Hkv, C/2, D, 2]");
    check(slot >= 0 && slot < P, "slot within the pool");
    check(s.scalar_type() == at::kLong && s.dim() == 1 && s.is_contiguous() && s.size(0) <= C,
          "slots: contiguous int64 [R], R <= the pool's columns");
    const int64_t cells = k.size(0) * k.size(2);
    const int64_t* at = s.data_ptr<int64_t>();
    for (int64_t j = 0; j < s.size(0); ++j) check(at[j] >= 0 && at[j] < cells, "slots within the cache");
  }
  at::parallel_for(0, static_cast<int64_t>(L), 1, [&](int64_t l0, int64_t l1) {
    for (int64_t l = l0; l < l1; ++l) {
      at::Tensor pk = own_k[l], pv = own_v[l];
      if (k_views[l].element_size() == 2)
        fill_layer<uint16_t>(k_views[l], v_views[l], slots[l], pk, pv, slot);
      else
        fill_layer<uint32_t>(k_views[l], v_views[l], slots[l], pk, pv, slot);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(kmesh_cpu, m) { m.def("fill_own", &fill_own); }
