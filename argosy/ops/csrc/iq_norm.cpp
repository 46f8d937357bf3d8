// Invariant RMSNorm: the same bits for a row whatever else is in the call, on every path; the
// invariant mode's eager step (RMSNorm.native in argosy/models/llama.py). Built with iq_linear.cpp
// into torch.ops.argosy_iq.
//
// argosy_iq::rms_norm(x [T, D] or [T, H, D] fp32, weight [D] fp32, eps, offset) -> x's shape, fp32,
// contiguous; x's rows of D values contiguous, its tokens any stride apart (q or k of a fused
// projection's output, read in place), per row of D:
//   s = the sum of x_i * x_i in float64 (each square exact), in one fixed order: lane l of 8
//       adds the squares of i = l, l + 8, l + 16, ... in turn, then the lanes add as
//       ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))
//   r = 1 / sqrt(float(s / D) + eps)       (fp32: sqrt and the division each rounded once)
//   out_i = (x_i * r) * (offset + w_i)     (Gemma: offset 1, its (1 + w); Llama: 0)
// As the Python statement (argosy/models/llama.py, float64_mean), which the compiled decode graph
// keeps (inductor fuses it with the residual add) and whose float64 sum inductor orders its own
// way: the float32 result differs about once in 10^8 norms. Here it is one order, in one pass
// instead of a chain of eager ops (float64 copies of every row) in the eager prefill.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "iq_common.h"

namespace {

using namespace argosy_iq;

inline double combine8(const double* s) { return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7])); }

double squares_scalar(const float* x, int64_t d) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) s[l] = s[l] + static_cast<double>(x[i + l]) * static_cast<double>(x[i + l]);
  for (int l = 0; i + l < d; ++l) s[l] = s[l] + static_cast<double>(x[i + l]) * static_cast<double>(x[i + l]);
  return combine8(s);
}

#define ARGOSY_NORM512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ARGOSY_NORM256 __attribute__((target("avx2,fma,f16c")))

// the same sums: a square is exact in float64, so fma(x, x, s) rounds s + x * x once, as the
// scalar statement does
ARGOSY_NORM512 double squares512(const float* x, int64_t d) {
  __m512d acc = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    acc = _mm512_fmadd_pd(v, v, acc);
  }
  alignas(64) double s[8];
  _mm512_store_pd(s, acc);
  for (int l = 0; i + l < d; ++l) s[l] = s[l] + static_cast<double>(x[i + l]) * static_cast<double>(x[i + l]);
  return combine8(s);
}

ARGOSY_NORM256 double squares256(const float* x, int64_t d) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    lo = _mm256_fmadd_pd(a, a, lo);
    hi = _mm256_fmadd_pd(b, b, hi);
  }
  alignas(32) double s[8];
  _mm256_store_pd(s, lo);
  _mm256_store_pd(s + 4, hi);
  for (int l = 0; i + l < d; ++l) s[l] = s[l] + static_cast<double>(x[i + l]) * static_cast<double>(x[i + l]);
  return combine8(s);
}

ARGOSY_NORM512 void scale512(const float* x, const float* w, float offset, float r, float* out, int64_t d) {
  int64_t i = 0;
  const __m512 rv = _mm512_set1_ps(r), off = _mm512_set1_ps(offset);
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv),
                                            _mm512_add_ps(off, _mm512_loadu_ps(w + i))));
  for (; i < d; ++i) out[i] = (x[i] * r) * (offset + w[i]);
}

ARGOSY_NORM256 void scale256(const float* x, const float* w, float offset, float r, float* out, int64_t d) {
  int64_t i = 0;
  const __m256 rv = _mm256_set1_ps(r), off = _mm256_set1_ps(offset);
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv),
                                            _mm256_add_ps(off, _mm256_loadu_ps(w + i))));
  for (; i < d; ++i) out[i] = (x[i] * r) * (offset + w[i]);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.scalar_type() == at::kFloat && x.stride(-1) == 1 &&
                  (x.dim() == 2 || x.stride(1) == x.size(2)),
              "rms_norm: x must be float32 [tokens, dim] or [tokens, heads, dim], each token's values contiguous");
  const int64_t d = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1, rows = x.size(0) * heads;
  const int64_t token_stride = x.stride(0), path = current_path();
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "rms_norm: weight must be a contiguous float32 [dim] tensor");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (rows == 0 || d == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + (r / heads) * token_stride + (r % heads) * d;
      const double s = path >= kAvx512 ? squares512(row, d) : path == kAvx2 ? squares256(row, d) : squares_scalar(row, d);
      const float inv = 1.0f / std::sqrt(static_cast<float>(s / static_cast<double>(d)) + e);
      if (path >= kAvx512)
        scale512(row, wp, off, inv, op + r * d, d);
      else if (path == kAvx2)
        scale256(row, wp, off, inv, op + r * d, d);
      else
        for (int64_t i = 0; i < d; ++i) op[r * d + i] = (row[i] * inv) * (off + wp[i]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(argosy_iq, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor"); }

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) { m.impl("rms_norm", &rms_norm); }
