// exp for the invariant kernels: one statement in +, -, * and round-to-nearest (no fma), on 1, 8 or
// 16 values at a time with the same operations, so every path gives the same bits. For x <= 0
// (attention's s - max, GeGLU's -2|u|); below -87 it is exp(-87).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace argosy_iq {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f;
// exp's polynomial in r, highest power first (the scalar, AVX-512 and AVX2 statements share it)
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kC2 = -2.12194440e-4f;

inline float exp_scalar(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kC1;
  r = r - n * kC2;
  float p = kExpPoly[0];
  p = p * r + kExpPoly[1];
  p = p * r + kExpPoly[2];
  p = p * r + kExpPoly[3];
  p = p * r + kExpPoly[4];
  p = p * r + kExpPoly[5];
  p = p * (r * r) + r;
  p = p + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

#define ARGOSY_EXP512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ARGOSY_EXP256 __attribute__((target("avx2,fma,f16c")))

ARGOSY_EXP512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(kC1)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(kC2)));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpPoly[1]));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpPoly[2]));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpPoly[3]));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpPoly[4]));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpPoly[5]));
  p = _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

ARGOSY_EXP256 inline __m256 exp256(__m256 x) {  // exp512's operations, 8 lanes
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kC1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(kC2)));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[1]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[2]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[3]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[4]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[5]));
  p = _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace argosy_iq
