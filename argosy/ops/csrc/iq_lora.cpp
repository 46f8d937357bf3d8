// LoRA adapters per row of a batch (argosy/models/lora.py): each row t adds its own adapter's
// low-rank product to the base layer's output,
//
//   out[t] = y[t] + scale[t] * (B_k (A_k x[t]))      k = slot[t]
//
// and a row without one (k out of range, or an adapter that does not touch this layer: an empty
// A_k) keeps y[t] bit for bit. In fp32, every sum in a fixed order (16 lanes over the summed
// index, the lanes then added in a fixed tree), each product and sum rounded once (no fma: the
// library is built with -ffp-contract=off): a row's bits never depend on the rows beside it, nor
// on their adapters (the invariance contract), and every CPU path gives the same bits (the paths
// differ only in how wide the registers are that hold the 16 lanes).
// Built with iq_linear.cpp into torch.ops.argosy_iq.
//
// argosy_iq::lora(y [T, out] f32, x [T, in] f32, slot [>= T] int64, scale [>= T] f32,
//                 a: [A_k [R_k, in] f32 or empty], bt: [B_k transposed, [R_k, out] f32 or empty])
//   -> [T, out] f32
// argosy_iq::lora_set(key, slot, a, bt) / lora_clear(key, slot): a projection's adapters, kept here
// by the projection's key; argosy_iq::lora_apply(y, x, slot, scale, key): lora() over them. What the
// compiled decode graph calls: C++ from the graph's C++ wrapper, no Python on the way (a Python op
// there cost ~0.1 ms a call, 96 calls a step on Qwen2.5-0.5B: 20% of a step of 8 rows).
//
// B (A x) sums over the rank in a fixed order per output, r = 0, 1, ..., vectorised across the
// outputs (B transposed: a rank's column of B contiguous); A x is a dot product of length `in`.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "iq_common.h"

namespace {

constexpr int kLanes = 16;

// sum_i p[i] * q[i], i in [0, n): lane l sums the terms i = l mod 16 in order, then the lanes
// fold pairwise (l + 8, then + 4, + 2, + 1). The same statement for every target: the compiler
// vectorizes over the lanes, which are independent, so the order of every addition is this one.
#define ARGOSY_LORA_DOT                                              \
  float acc[kLanes] = {};                                            \
  int64_t i = 0;                                                     \
  for (; i + kLanes <= n; i += kLanes)                               \
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + p[i + l] * q[i + l]; \
  for (int l = 0; i + l < n; ++l) acc[l] = acc[l] + p[i + l] * q[i + l];     \
  for (int w = kLanes / 2; w >= 1; w /= 2)                           \
    for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];        \
  return acc[0];

__attribute__((target("avx512f,avx2,fma"))) float dot512(const float* p, const float* q, int64_t n) {
  ARGOSY_LORA_DOT
}
__attribute__((target("avx2,fma"))) float dot256(const float* p, const float* q, int64_t n) { ARGOSY_LORA_DOT }
float dot_plain(const float* p, const float* q, int64_t n) { ARGOSY_LORA_DOT }

float dot(int64_t path, const float* p, const float* q, int64_t n) {
  if (path >= argosy_iq::kAvx512) return dot512(p, q, n);
  if (path == argosy_iq::kAvx2) return dot256(p, q, n);
  return dot_plain(p, q, n);
}

// o[c] += s * sum_r bt[r][c] h[r] for c in [0, width): the rank summed in order per output
#define ARGOSY_LORA_EXPAND                                                       \
  for (int64_t c = 0; c < width; ++c) acc[c] = bt[c] * h[0];                   \
  for (int64_t q = 1; q < rank; ++q) {                                         \
    const float* col = bt + q * stride;                                        \
    const float hq = h[q];                                                     \
    for (int64_t c = 0; c < width; ++c) acc[c] = acc[c] + col[c] * hq;         \
  }                                                                            \
  for (int64_t c = 0; c < width; ++c) o[c] = o[c] + s * acc[c];

__attribute__((target("avx512f,avx2,fma"))) void expand512(const float* bt, int64_t stride, const float* h,
                                                         int64_t rank, float s, float* o, float* acc,
                                                         int64_t width) {
  ARGOSY_LORA_EXPAND
}
__attribute__((target("avx2,fma"))) void expand256(const float* bt, int64_t stride, const float* h, int64_t rank,
                                                 float s, float* o, float* acc, int64_t width) {
  ARGOSY_LORA_EXPAND
}
void expand_plain(const float* bt, int64_t stride, const float* h, int64_t rank, float s, float* o, float* acc,
                  int64_t width) {
  ARGOSY_LORA_EXPAND
}

void expand(int64_t path, const float* bt, int64_t stride, const float* h, int64_t rank, float s, float* o,
            float* acc, int64_t width) {
  if (path >= argosy_iq::kAvx512)
    expand512(bt, stride, h, rank, s, o, acc, width);
  else if (path == argosy_iq::kAvx2)
    expand256(bt, stride, h, rank, s, o, acc, width);
  else
    expand_plain(bt, stride, h, rank, s, o, acc, width);
}

// adds each row's product into `out` (contiguous [T, out] float32) in place
void lora_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& slot, const at::Tensor& scale,
               at::TensorList a, at::TensorList b) {
  const at::Tensor& y = out;
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora: y [T, out] and x [T, in]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat, "lora: y and x must be float32");
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.dim() == 1 && slot.size(0) >= y.size(0),
              "lora: slot must be int64 with a value for each row");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) >= y.size(0),
              "lora: scale must be float32 with a value for each row");
  TORCH_CHECK(a.size() == b.size(), "lora: one B for each A");
  const int64_t t = y.size(0), out_features = y.size(1), in_features = x.size(1);
  const at::Tensor xc = x.contiguous(), slots = slot.contiguous(), scales = scale.contiguous();
  TORCH_CHECK(out.is_contiguous(), "lora: y must be contiguous");
  const int64_t num_adapters = static_cast<int64_t>(a.size());
  std::vector<const float*> a_ptr(num_adapters, nullptr), b_ptr(num_adapters, nullptr);
  std::vector<int64_t> rank(num_adapters, 0);
  for (int64_t k = 0; k < num_adapters; ++k) {
    if (a[k].numel() == 0) continue;
    TORCH_CHECK(a[k].scalar_type() == at::kFloat && a[k].dim() == 2 && a[k].size(1) == in_features &&
                    a[k].is_contiguous(),
                "lora: A must be contiguous float32 [rank, in]");
    TORCH_CHECK(b[k].scalar_type() == at::kFloat && b[k].dim() == 2 && b[k].size(1) == out_features &&
                    b[k].size(0) == a[k].size(0) && b[k].is_contiguous(),
                "lora: B must be given transposed, contiguous float32 [rank, out]");
    a_ptr[k] = a[k].data_ptr<float>();
    b_ptr[k] = b[k].data_ptr<float>();
    rank[k] = a[k].size(0);
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* scp = scales.data_ptr<float>();
  // the rows that take an adapter, and where each one's A x starts in `h`
  std::vector<int64_t> rows, h_at;
  int64_t h_size = 0;
  for (int64_t r = 0; r < t; ++r) {
    const int64_t k = sp[r];
    if (k < 0 || k >= num_adapters || a_ptr[k] == nullptr) continue;
    rows.push_back(r);
    h_at.push_back(h_size);
    h_size += rank[k];
  }
  if (rows.empty()) return;
  std::vector<float> h(h_size);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t path = argosy_iq::current_path();
  const int64_t n = static_cast<int64_t>(rows.size());
  // h = A_k x[t], one dot product of length `in` per (row, rank) pair
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = rows[j], k = sp[r];
      for (int64_t q = 0; q < rank[k]; ++q)
        h[h_at[j] + q] = dot(path, xp + r * in_features, a_ptr[k] + q * in_features, in_features);
    }
  });
  // out[t] = y[t] + scale[t] * (B_k h): per output c, acc = B[c,0] h0, then + B[c,r] h_r in order
  const int64_t chunk = 512;
  const int64_t chunks = (out_features + chunk - 1) / chunk;
  at::parallel_for(0, n * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(chunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item / chunks, r = rows[j], k = sp[r];
      const int64_t lo = (item % chunks) * chunk, width = std::min(out_features, lo + chunk) - lo;
      expand(path, b_ptr[k] + lo, out_features, h.data() + h_at[j], rank[k], scp[r], op + r * out_features + lo,
             acc.data(), width);
    }
  });
}

at::Tensor lora(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slot, const at::Tensor& scale,
                at::TensorList a, at::TensorList b) {
  at::Tensor out = y.contiguous().clone();
  lora_into(out, x, slot, scale, a, b);
  return out;
}

// key -> per slot (A, B transposed), empty tensors where a slot's adapter does not touch it
struct Adapters {
  std::vector<at::Tensor> a, bt;
};
std::mutex registry_lock;
std::unordered_map<int64_t, Adapters>& registry() {
  static std::unordered_map<int64_t, Adapters> table;
  return table;
}

void lora_set(int64_t key, int64_t slot, const at::Tensor& a, const at::Tensor& bt) {
  TORCH_CHECK(slot >= 0, "lora_set: a slot is >= 0");
  std::lock_guard<std::mutex> guard(registry_lock);
  Adapters& held = registry()[key];
  while (static_cast<int64_t>(held.a.size()) <= slot) {
    held.a.push_back(at::empty({0}, at::kFloat));
    held.bt.push_back(at::empty({0}, at::kFloat));
  }
  held.a[slot] = a.contiguous();
  held.bt[slot] = bt.contiguous();
}

void lora_clear(int64_t key, int64_t slot) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry().find(key);
  if (found == registry().end()) return;
  if (slot < 0) {  // the projection is gone: all its slots
    registry().erase(found);
    return;
  }
  if (slot < static_cast<int64_t>(found->second.a.size())) {
    found->second.a[slot] = at::empty({0}, at::kFloat);
    found->second.bt[slot] = at::empty({0}, at::kFloat);
  }
}

Adapters adapters_of(int64_t key) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry().find(key);
  return found != registry().end() ? found->second : Adapters{};  // tensors by reference count
}

at::Tensor lora_apply(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slot, const at::Tensor& scale,
                      int64_t key) {
  const Adapters held = adapters_of(key);
  return lora(y, x, slot, scale, held.a, held.bt);
}

// in place: what the compiled graph runs (its projection's output is used by nothing else, so
// no copy of it is made for a step whose rows are all the base's)
void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& slot, const at::Tensor& scale, int64_t key) {
  const Adapters held = adapters_of(key);
  lora_into(y, x, slot, scale, held.a, held.bt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(argosy_iq, m) {
  m.def("lora(Tensor y, Tensor x, Tensor slot, Tensor scale, Tensor[] a, Tensor[] b) -> Tensor");
  m.def("lora_apply(Tensor y, Tensor x, Tensor slot, Tensor scale, int key) -> Tensor");
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor slot, Tensor scale, int key) -> ()");
  m.def("lora_set(int key, int slot, Tensor a, Tensor bt) -> ()");
  m.def("lora_clear(int key, int slot) -> ()");
}

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) {
  m.impl("lora", &lora);
  m.impl("lora_apply", &lora_apply);
  m.impl("lora_apply_", &lora_apply_);
}

TORCH_LIBRARY_IMPL(argosy_iq, CompositeExplicitAutograd, m) {
  m.impl("lora_set", &lora_set);
  m.impl("lora_clear", &lora_clear);
}
