// SwiGLU for the invariant kernels (Llama's, Qwen's, SmolLM's feed-forward): out = silu(g) * u =
// (g * s) * u, where with e = exp_argosy(-|g|) s = (g >= 0 ? 1 : e) / (1 + e) (the sigmoid, exp's
// argument never positive), per value in fp32, on 1, 8 or 16 values with the same operations:
// the same bits on every path. argosy_iq::swiglu (iq_geglu.cpp) applies it to a gate_up tensor;
// kq_linear's swiglu form (iq_packed.cpp) to the gate and up tiles it has just computed.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "iq_exp.h"

namespace argosy_iq {

#define ARGOSY_SWIGLU512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ARGOSY_SWIGLU256 __attribute__((target("avx2,fma,f16c")))

inline float swiglu_scalar(float g, float u) {
  const float e = exp_scalar(-std::fabs(g));
  const float s = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
  return (g * s) * u;
}

ARGOSY_SWIGLU512 inline __m512 swiglu512(__m512 g, __m512 u) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp512(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign)));  // -|g|
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 s = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
  return _mm512_mul_ps(_mm512_mul_ps(g, s), u);
}

ARGOSY_SWIGLU256 inline __m256 swiglu256(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp256(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // -|g|
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 s = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_mul_ps(g, s), u);
}

// argosy_iq::swiglu's work on float32 [rows, 2 * inter] -> [rows, inter] on `path` (iq_geglu.cpp)
void swiglu_rows(const float* gate_up, float* out, int64_t rows, int64_t inter, int64_t path);

}  // namespace argosy_iq
