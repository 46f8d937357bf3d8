// RoPE (rotate-half layout) for the eager steps: out = x * cos + rotate_half(x) * sin per value,
// rotate_half(x) = (-x[D/2:], x[:D/2]), in fp32 with the products and the sum each rounded once
// (no fma): the operations aten and inductor's generated code perform, so the same bits as the
// compiled decode graph's (which keeps the Python statement, argosy/models/llama.py apply_rope)
// in one pass instead of aten's five (a negation, a concatenation, two products and a sum).
// Built with iq_linear.cpp into torch.ops.argosy_iq.
//
// argosy_iq::rope(x [T, H, D] fp32, cos [T, D] fp32, sin [T, D] fp32) -> [T, H, D] fp32, contiguous;
// each token's H x D values (and its D of cos and sin) contiguous, tokens any stride apart (a
// slice of a fused projection's output, one half of Gemma's two tables, read in place)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "iq_common.h"

namespace {

// one (token, head) row; the same statement for every target (the compiler vectorizes the loops
// with the target's registers; the operations and their rounding stay the same)
#define ARGOSY_ROPE_ROW                                                                   \
  for (int64_t i = 0; i < half; ++i) {                                                    \
    const float a = xr[i] * c[i];                                                         \
    const float b = -xr[i + half] * s[i];                                                 \
    o[i] = a + b;                                                                         \
  }                                                                                       \
  for (int64_t i = half; i < d; ++i) {                                                    \
    const float a = xr[i] * c[i];                                                         \
    const float b = xr[i - half] * s[i];                                                  \
    o[i] = a + b;                                                                         \
  }

__attribute__((target("avx512f,avx2,fma"))) void row512(const float* xr, const float* c, const float* s, float* o,
                                                      int64_t half, int64_t d) {
  ARGOSY_ROPE_ROW
}
__attribute__((target("avx2,fma"))) void row256(const float* xr, const float* c, const float* s, float* o,
                                              int64_t half, int64_t d) {
  ARGOSY_ROPE_ROW
}
void row_plain(const float* xr, const float* c, const float* s, float* o, int64_t half, int64_t d) {
  ARGOSY_ROPE_ROW
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(2) % 2 == 0 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "rope: x must be a float32 [tokens, heads, dim] tensor with an even dim, each token's values "
              "contiguous");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2, x_stride = x.stride(0);
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->dim() == 2 && table->size(0) == t && table->size(1) == d && table->stride(1) == 1 &&
                    table->scalar_type() == at::kFloat,
                "rope: cos and sin must be float32 [tokens, dim], each token's values contiguous");
  const int64_t c_stride = cos.stride(0), s_stride = sin.stride(0);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t path = argosy_iq::current_path();
  at::parallel_for(0, t * heads, std::max<int64_t>(1, 8192 / d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = xp + (row / heads) * x_stride + (row % heads) * d;
      const float* c = cp + (row / heads) * c_stride;
      const float* s = sp + (row / heads) * s_stride;
      float* o = op + row * d;
      if (path >= argosy_iq::kAvx512)
        row512(xr, c, s, o, half, d);
      else if (path == argosy_iq::kAvx2)
        row256(xr, c, s, o, half, d);
      else
        row_plain(xr, c, s, o, half, d);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(argosy_iq, m) { m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) { m.impl("rope", &rope); }
