// Invariant quantized linear layers: the same bits for a row whatever else is in the batch.
//
// argosy_iq::q4_linear(x, codes, scales, mins, out_features, out_float32): GGUF Q4_0/Q4_1
//   weights, w[n, k] = d[n, g] * q[n, k] + m[n, g] for the group g = k / 32 (the file's own
//   codes, scales and minimums; Q4_0 is m = -8 d).
// argosy_iq::q8_linear(x, codes, scales, mins, out_features, out_float32): int8 codes,
//   w[n, k] = s[n, k / G] * q[n, k] (+ m[n, k / 32] when mins are given), G = 32 or 16
//   (K / scales.size(1)). Every GGUF block format whose weights are an int8 code
//   times a scale plus a minimum, per 32 or 16 weights, holds its values here exactly:
//     Q8_0: q, s = d                     Q5_0: q - 16, s = d       Q5_1: q, s = d, m
//     Q4_K, Q5_K: q, s = d * sc, m = -dmin * mn (per 32)   Q6_K: q - 32, s = d * sc (per 16)
//   (the products d * sc and dmin * mn are exact in float32, as the gguf package computes them),
//   and an output head of any float weight is quantized so (Q8_0-style, per 32).
//
// The arithmetic, defined once and followed exactly by every path (scalar reference, AVX2 + FMA,
// AVX-512 VNNI):
//   1. Each row of x (bf16 or fp32) is quantized per group of 32 k, as llama.cpp's Q8_0:
//      a = max |x|, dx = a / 127, xq = round-half-even(x * (127 / a)) in [-127, 127] (all 0 when
//      a = 0); sq = the sum of xq, and ux = dx * float(sq) (the quantized group's sum). A scalar
//      routine and an AVX-512 one with the same operations (so the same bits); it depends on
//      the row alone.
//   2. Per row, output and group: the integer dot product of xq with the codes (exact: int32);
//      Q4 centres its codes, dot - 8 * sq = xq . (q - 8). (VNNI multiplies unsigned by signed
//      bytes: the Q8 path feeds it the codes biased to unsigned, q + 128, and starts each sum
//      from -128 times the sum of xq over the weight group: the same integer.)
//   3. Per row and output, the groups in k order, in fp32 with fused multiply-adds:
//        Q4: acc = fma(d * dx, float(dot - 8 sq), acc); acc = fma(fma(8, d, m), ux, acc)
//            (d q + m = d (q - 8) + (m + 8 d); Q4_0's m + 8 d is 0)
//        Q8: per weight group h of the x group (one for G = 32, two for G = 16, in k order):
//            acc = fma(s_h * dx, float(dot_h), acc); then, with mins (one per 32 k):
//            acc = fma(m, ux, acc)
//      then rounded to bf16 (round-half-even) unless out_float32.
//      So a group contributes the weights times the quantized x, sum over k of w_k * dx * xq_k
//      (up to fp32 rounding), and its error is sum w_k * (dx * xq_k - x_k), as llama.cpp's. (The
//      exact sum of x in the (m + 8 d) term instead, sum (w_k - m - 8 d) * (dx * xq_k - x_k),
//      weighs the error by the weights' distance from the block's middle, not from 0: a block
//      with one outlier has most of its weights far from its middle, and bench/quality.py's KL
//      to the fp32 reference was 12% higher.)
// The fine form (the `fine` argument of q4_linear, q8_linear and kq_linear; iq_rows.h): step 1
// quantizes x to a 15-bit code c = round-half-even(x * (127 / a) * 128), dx = a / 127 / 128, sq
// and ux c's; step 2's dot is c . q, computed from c's two bytes (c = 128 hi + lo) as
// 128 * (hi . q) + (lo . q) in int32; step 3 is unchanged. x's rounding error is 1/128 of the
// 8-bit form's, for twice the integer products: the output head and q/k/v take it
// (models/quantize.py FINE_LAYERS).
// Nothing is summed across threads or across k blocks in a different order: threads split the
// outputs (tiles of 16), never k; rows are blocked for speed, but each output element is the
// same chain of operations for any number of rows. So a token's logits are bit-identical
// whatever batch it runs in and however its prompt was split, on every path of this file.
//
// Layouts (built by argosy/ops/quantized_linear.py), 16 outputs to a tile t:
//   Q4 codes uint8 [N/16, K/32, 4, 16, 4]: [t, g, c, i, b] = q[16t+i, 32g+8c+b] | q[16t+i, 32g+8c+4+b] << 4
//   Q4 scales, mins float16 [N/16, K/32, 16] (the file's own fp16 values)
//   Q8 codes int8 [N/16, K/4, 16, 4]: [t, j, i, b] = q[16t+i, 4j+b]
//   Q8 scales [N/16, K/G, 16], mins [N/16, K/32, 16]: float16 where every value is one (Q8_0,
//     Q5_0, Q5_1: the file's own fp16 values, half the bytes), else float32 (the K-quants'
//     d * sc); both converted exactly. Codes of -128 are refused: the AVX2 path moves x's sign
//     onto the codes
// so one 64-byte load holds 4 consecutive k of 16 outputs: the byte dot-product instructions
// (vpdpbusd; vpmaddubsw + vpmaddwd on AVX2) sum them per 32-bit lane, one lane per output.
//
// Built without -ffast-math and with -ffp-contract=off (argosy/ops/native.py): the compiler may
// not reorder or fuse the float operations above. Paths are chosen at run time by CPU features.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "iq_common.h"
#include "iq_rows.h"

namespace {

using namespace argosy_iq;


// -- 2 and 3, scalar: the reference ----------------------------------------------------------

void q4_scalar(const QuantizedRows& xr, int64_t rows, int64_t groups, const uint8_t* codes, const uint16_t* scales,
               const uint16_t* mins, int64_t t0, int64_t t1, const Output& out) {
  const int64_t k = groups * kGroup;
  float acc[kTile];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = r * k;
      std::fill(acc, acc + kTile, 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = codes + (t * groups + g) * 256;
        for (int64_t i = 0; i < kTile; ++i) {
          int32_t dot = 0;
          for (int64_t c = 0; c < 4; ++c)
            for (int64_t b = 0; b < 4; ++b) {
              const uint8_t byte = block[c * 64 + i * 4 + b];
              dot += static_cast<int32_t>(byte & 0x0f) * xr.code(row + g * kGroup + 8 * c + b);
              dot += static_cast<int32_t>(byte >> 4) * xr.code(row + g * kGroup + 8 * c + 4 + b);
            }
          const float d = half_to_float(scales[(t * groups + g) * kTile + i]);
          const float m = half_to_float(mins[(t * groups + g) * kTile + i]);
          const float dd = d * xr.dx[r * groups + g];
          const int32_t centred = dot - 8 * xr.sq[r * groups + g];
          acc[i] = std::fma(dd, static_cast<float>(centred), acc[i]);
          acc[i] = std::fma(std::fma(8.0f, d, m), xr.ux[r * groups + g], acc[i]);
        }
      }
      out.put(r, t * kTile, acc, kTile);
    }
  }
}

// the Q8 weight: codes, per weight group its scale and (or nullptr) minimum (float32 or float16); H weight
// groups (of 32 / H) to a group of x
template <typename S>
struct Q8Weight {
  const int8_t* codes;
  const S* scales;
  const S* mins;  // nullptr: none
  int64_t h;
  int8_t bias = 0;  // AVX2: the codes + bias are 0 ... span (q8_avx2_biased_rows)
  int64_t n16 = 0;  // AVX2: 4-byte steps an int16 sum holds at that span; 0: the sign path
};

// the codes' range [lo, hi] -> (bias, n16) for the AVX2 path: n16 * span <= 129, in 8, 4, 2 steps
inline std::pair<int8_t, int64_t> avx2_bias(int64_t lo, int64_t hi) {
  const int64_t span = hi - lo;
  for (int64_t n : {8, 4, 2})
    if (n * span <= 129) return {static_cast<int8_t>(-lo), n};
  return {0, 0};
}

inline float scale_value(float s) { return s; }
inline float scale_value(uint16_t s) { return half_to_float(s); }

template <typename S>
void q8_scalar(const QuantizedRows& xr, int64_t rows, int64_t groups, const Q8Weight<S>& w, int64_t t0, int64_t t1,
               const Output& out) {
  const int64_t k = groups * kGroup, quads = 8 / w.h;
  float acc[kTile];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc, acc + kTile, 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < kTile; ++i) {
          for (int64_t h = 0; h < w.h; ++h) {
            int32_t dot = 0;
            for (int64_t j = 8 * g + quads * h; j < 8 * g + quads * (h + 1); ++j)
              for (int64_t b = 0; b < 4; ++b)
                dot += static_cast<int32_t>(w.codes[((t * (k / 4) + j) * kTile + i) * 4 + b]) * xr.code(r * k + 4 * j + b);
            const int64_t wg = (t * groups * w.h + g * w.h + h) * kTile + i;
            acc[i] = std::fma(scale_value(w.scales[wg]) * xr.dx[r * groups + g], static_cast<float>(dot), acc[i]);
          }
          if (w.mins != nullptr)
            acc[i] = std::fma(scale_value(w.mins[(t * groups + g) * kTile + i]), xr.ux[r * groups + g], acc[i]);
        }
      }
      out.put(r, t * kTile, acc, kTile);
    }
  }
}

// -- AVX2 + FMA: 8 outputs a vector, a tile is two --------------------------------------------

#define ARGOSY_AVX2 __attribute__((target("avx2,fma,f16c")))

ARGOSY_AVX2 inline __m256i avx2_dot4(__m256i u8, __m256i s8) {  // per lane: 4 u8 x s8, |sum| < 2^15 each pair
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1));
}

// the fine form's dot: 128 * (codes . hi) + (codes . lo)
ARGOSY_AVX2 inline __m256i fine_dot_256(__m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_slli_epi32(hi, kFineShift), lo);
}

ARGOSY_AVX2 inline __m256i broadcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// xlo: the fine form's lo bytes (Fine), laid out as xq
template <int R, bool Fine>
ARGOSY_AVX2 void q4_avx2_rows(const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx, const float* ux,
                              const int32_t* sq, int64_t groups, const uint8_t* codes, const uint16_t* scales,
                              const uint16_t* mins, float* res) {
  // res: R rows x 16 outputs. A group's 8 byte products per lane pair (codes 0..15, |x| <= 127:
  // each pair sum within 2 * 15 * 127) are summed in int16 (8 of them: <= 30480 < 2^15), then
  // widened once: the same integer dot as one widening per product
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = codes + g * 256;
    __m256i sum16[R][2], sum16_lo[R][2];  // (the fine form's lo: |lo| <= 64, within the same bound)
    for (int r = 0; r < R; ++r) sum16[r][0] = sum16[r][1] = sum16_lo[r][0] = sum16_lo[r][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i xl[R], xh[R];
      for (int r = 0; r < R; ++r) {
        xl[r] = broadcast4_256(xq + r * k + g * kGroup + 8 * c);
        xh[r] = broadcast4_256(xq + r * k + g * kGroup + 8 * c + 4);
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(w, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int r = 0; r < R; ++r) {
          sum16[r][h] = _mm256_add_epi16(sum16[r][h], _mm256_maddubs_epi16(lo, xl[r]));
          sum16[r][h] = _mm256_add_epi16(sum16[r][h], _mm256_maddubs_epi16(hi, xh[r]));
          if constexpr (Fine) {
            const int8_t* p = xlo + r * k + g * kGroup + 8 * c;
            sum16_lo[r][h] = _mm256_add_epi16(sum16_lo[r][h], _mm256_maddubs_epi16(lo, broadcast4_256(p)));
            sum16_lo[r][h] = _mm256_add_epi16(sum16_lo[r][h], _mm256_maddubs_epi16(hi, broadcast4_256(p + 4)));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kTile + 8 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g * kTile + 8 * h)));
      const __m256 c = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), d, m);
      for (int r = 0; r < R; ++r) {
        __m256i dot = _mm256_madd_epi16(sum16[r][h], ones);
        if constexpr (Fine) dot = fine_dot_256(dot, _mm256_madd_epi16(sum16_lo[r][h], ones));
        const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
        const __m256i centred = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * sq[r * groups + g]));
        acc[r][h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(centred), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(ux[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(res + r * kTile, acc[r][0]);
    _mm256_storeu_ps(res + r * kTile + 8, acc[r][1]);
  }
}

ARGOSY_AVX2 inline __m256 load8_scales(const float* p) { return _mm256_loadu_ps(p); }
ARGOSY_AVX2 inline __m256 load8_scales(const uint16_t* p) {  // exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// step 3 of a weight group, R rows x 16 outputs: acc += (s * dx) * float(dot), s its 16 scales
template <int R, typename S>
ARGOSY_AVX2 inline void avx2_add_dots(__m256 (&acc)[R][2], const __m256i (&dot)[R][2], const S* scales,
                                      const float* dx, int64_t groups, int64_t g) {
  for (int h = 0; h < 2; ++h) {
    const __m256 d = load8_scales(scales + 8 * h);
    for (int r = 0; r < R; ++r) {
      const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
      acc[r][h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot[r][h]), acc[r][h]);
    }
  }
}

// and, where the format has them, acc += m * ux per group of 32, m its 16 minimums
template <int R, typename S>
ARGOSY_AVX2 inline void avx2_add_mins(__m256 (&acc)[R][2], const S* mins, const float* ux, int64_t groups, int64_t g) {
  for (int h = 0; h < 2; ++h) {
    const __m256 m = load8_scales(mins + 8 * h);
    for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(ux[r * groups + g]), acc[r][h]);
  }
}

// xlo: the fine form's lo bytes (Fine), the same layout as xq
template <int R, int H, bool Mins, typename S, bool Fine>
ARGOSY_AVX2 void q8_avx2_rows(const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx, const float* ux,
                              int64_t groups, const int8_t* codes, const S* scales, const S* mins, float* res) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int hg = 0; hg < H; ++hg) {
      __m256i dot[R][2], dot_lo[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = dot_lo[r][0] = dot_lo[r][1] = _mm256_setzero_si256();
      for (int64_t j = 8 * g + (8 / H) * hg; j < 8 * g + (8 / H) * (hg + 1); ++j) {
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + h * 32));
          for (int r = 0; r < R; ++r) {
            const __m256i xs = broadcast4_256(xq + r * k + 4 * j);
            // |x| unsigned, x's sign moved onto w: products and pair sums stay within int16
            dot[r][h] = _mm256_add_epi32(dot[r][h], avx2_dot4(_mm256_abs_epi8(xs), _mm256_sign_epi8(w, xs)));
            if constexpr (Fine) {
              const __m256i xl = broadcast4_256(xlo + r * k + 4 * j);
              dot_lo[r][h] = _mm256_add_epi32(dot_lo[r][h], avx2_dot4(_mm256_abs_epi8(xl), _mm256_sign_epi8(w, xl)));
            }
          }
        }
      }
      if constexpr (Fine)
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) dot[r][h] = fine_dot_256(dot[r][h], dot_lo[r][h]);
      avx2_add_dots<R>(acc, dot, scales + (g * H + hg) * kTile, dx, groups, g);
    }
    if constexpr (Mins) avx2_add_mins<R>(acc, mins + g * kTile, ux, groups, g);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(res + r * kTile + 8 * h, acc[r][h]);
}

// Codes of a narrow range (every block format but Q8_0: Q4_K 0..15, Q5_0 -16..15, Q5_1 and
// Q5_K 0..31, Q6_K -32..31), biased by B to unsigned u = q + B <= span: a byte product pair
// u * x within 2 * span * 127, so N pairs (N * span <= 129) sum in int16 below 2^15 and are
// widened once, without moving x's sign onto every code. start (per row and weight group,
// -B times the sum of xq over it) takes the bias back out: the same integer dot as above.
template <int R, int H, bool Mins, typename S, int N, bool Fine>
ARGOSY_AVX2 void q8_avx2_biased_rows(const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx,
                                     const float* ux, const int32_t* start, int64_t groups, const int8_t* codes,
                                     const S* scales, const S* mins, float* res, int8_t bias) {
  constexpr int J = 8 / H;  // 4-byte steps of k to a weight group
  static_assert(J % N == 0, "the int16 sums cover whole weight groups");
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i biasv = _mm256_set1_epi8(bias);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    for (int hg = 0; hg < H; ++hg) {
      // the start goes into the last sum (the fine form's lo): 128 hi + lo + start
      __m256i dot[R][2], dot_lo[R][2];
      for (int r = 0; r < R; ++r) {
        const __m256i s0 = _mm256_set1_epi32(start[(r * groups + g) * H + hg]);
        dot[r][0] = dot[r][1] = Fine ? _mm256_setzero_si256() : s0;
        dot_lo[r][0] = dot_lo[r][1] = s0;
      }
      const int64_t j0 = 8 * g + J * hg;
      for (int jb = 0; jb < J; jb += N) {
        __m256i sum16[R][2], sum16_lo[R][2];
        for (int r = 0; r < R; ++r)
          sum16[r][0] = sum16[r][1] = sum16_lo[r][0] = sum16_lo[r][1] = _mm256_setzero_si256();
        for (int jj = 0; jj < N; ++jj) {
          const int64_t j = j0 + jb + jj;
          for (int h = 0; h < 2; ++h) {
            const __m256i w =
                _mm256_add_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + h * 32)), biasv);
            for (int r = 0; r < R; ++r) {
              sum16[r][h] = _mm256_add_epi16(sum16[r][h], _mm256_maddubs_epi16(w, broadcast4_256(xq + r * k + 4 * j)));
              if constexpr (Fine)
                sum16_lo[r][h] =
                    _mm256_add_epi16(sum16_lo[r][h], _mm256_maddubs_epi16(w, broadcast4_256(xlo + r * k + 4 * j)));
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) {
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(sum16[r][h], ones));
            if constexpr (Fine) dot_lo[r][h] = _mm256_add_epi32(dot_lo[r][h], _mm256_madd_epi16(sum16_lo[r][h], ones));
          }
      }
      if constexpr (Fine)
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) dot[r][h] = fine_dot_256(dot[r][h], dot_lo[r][h]);
      avx2_add_dots<R>(acc, dot, scales + (g * H + hg) * kTile, dx, groups, g);
    }
    if constexpr (Mins) avx2_add_mins<R>(acc, mins + g * kTile, ux, groups, g);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(res + r * kTile + 8 * h, acc[r][h]);
}

// the AVX2 rows of one weight form: the biased int16 sums where the codes' range allows (n: the
// 4-byte steps an int16 sum may hold, 0 for none), else x's sign moved onto the codes
template <int R, int H, bool Mins, typename S, bool Fine>
ARGOSY_AVX2 void q8_avx2_any(int n, int8_t bias, const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx,
                             const float* ux, const int32_t* start, int64_t groups, const int8_t* codes,
                             const S* scales, const S* mins, float* res) {
  if constexpr (R == 4) {  // two rows at a time: their int16 and int32 sums stay in registers
    q8_avx2_any<2, H, Mins, S, Fine>(n, bias, xq, xlo, k, dx, ux, start, groups, codes, scales, mins, res);
    q8_avx2_any<2, H, Mins, S, Fine>(n, bias, xq + 2 * k, Fine ? xlo + 2 * k : nullptr, k, dx + 2 * groups,
                                     ux + 2 * groups, start == nullptr ? nullptr : start + 2 * groups * H, groups,
                                     codes, scales, mins, res + 2 * kTile);
    return;
  }
  if constexpr (H == 1) {
    if (n >= 8)
      return q8_avx2_biased_rows<R, H, Mins, S, 8, Fine>(xq, xlo, k, dx, ux, start, groups, codes, scales, mins, res,
                                                          bias);
  }
  if (n >= 4)
    return q8_avx2_biased_rows<R, H, Mins, S, 4, Fine>(xq, xlo, k, dx, ux, start, groups, codes, scales, mins, res,
                                                        bias);
  if (n >= 2)
    return q8_avx2_biased_rows<R, H, Mins, S, 2, Fine>(xq, xlo, k, dx, ux, start, groups, codes, scales, mins, res,
                                                        bias);
  q8_avx2_rows<R, H, Mins, S, Fine>(xq, xlo, k, dx, ux, groups, codes, scales, mins, res);
}

// -- AVX-512 VNNI: 16 outputs a vector ---------------------------------------------------------

#define ARGOSY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

ARGOSY_AVX512 inline __m512i fine_dot_512(__m512i hi, __m512i lo) {  // 128 * (codes . hi) + (codes . lo)
  return _mm512_add_epi32(_mm512_slli_epi32(hi, kFineShift), lo);
}

ARGOSY_AVX512 inline __m512i broadcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows x T tiles at once (T tiles are consecutive in the layout)
template <int R, int T, bool Fine>
ARGOSY_AVX512 void q4_avx512_block(const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx, const float* ux,
                                   const int32_t* sq, int64_t groups, const uint8_t* codes, const uint16_t* scales,
                                   const uint16_t* mins, float* res) {  // res: R rows x T*16 outputs
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  const int64_t tile_bytes = groups * 256, tile_scales = groups * kTile;
  for (int64_t g = 0; g < groups; ++g) {
    // each starts from -8 sq: the sum is then xq . (q - 8), exactly (the fine form: 128 hi + lo)
    __m512i dot[R][T], dot_lo[R][T];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(-8 * sq[r * groups + g]);
      for (int t = 0; t < T; ++t) {
        dot[r][t] = Fine ? _mm512_setzero_si512() : start;
        dot_lo[r][t] = start;
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i xl[R], xh[R];
      for (int r = 0; r < R; ++r) {
        xl[r] = broadcast4_512(xq + r * k + g * kGroup + 8 * c);
        xh[r] = broadcast4_512(xq + r * k + g * kGroup + 8 * c + 4);
      }
      for (int t = 0; t < T; ++t) {
        const __m512i w = _mm512_loadu_si512(codes + t * tile_bytes + g * 256 + c * 64);
        const __m512i lo = _mm512_and_si512(w, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        for (int r = 0; r < R; ++r) {
          dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo, xl[r]);
          dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi, xh[r]);
          if constexpr (Fine) {
            const int8_t* p = xlo + r * k + g * kGroup + 8 * c;
            dot_lo[r][t] = _mm512_dpbusd_epi32(dot_lo[r][t], lo, broadcast4_512(p));
            dot_lo[r][t] = _mm512_dpbusd_epi32(dot_lo[r][t], hi, broadcast4_512(p + 4));
          }
        }
      }
    }
    if constexpr (Fine)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) dot[r][t] = fine_dot_512(dot[r][t], dot_lo[r][t]);
    for (int t = 0; t < T; ++t) {
      const __m512 d =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + t * tile_scales + g * kTile)));
      const __m512 m =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + t * tile_scales + g * kTile)));
      const __m512 c = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d, m);
      for (int r = 0; r < R; ++r) {
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
        acc[r][t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot[r][t]), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(c, _mm512_set1_ps(ux[r * groups + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(res + (r * T + t) * kTile, acc[r][t]);
}

// Many rows (prefill and batched decode without AMX): a tile's codes unpacked once into bytes
// ([groups, 4 lines c, lo / hi, 64 bytes]: q4_avx512_block's `lo` and `hi` vectors), its scales
// as floats and 8 d + m as q4_avx512_block computes it, then R rows x T tiles read them with plain
// loads, x's bytes broadcast once for the T tiles; rows in passes whose x fits L2. Same integer
// sums, the same fp32 steps in the same order: the same bits.
// From 32 rows: SmolLM2's layer 0 (2 threads) at 16 rows lost (gate/up 0.168 vs 0.127 ms: the
// unpacking is not repaid over so few rows), at 32 it wins or ties (gate/up 0.190 vs 0.209 ms, down
// 0.126 vs 0.124), at 512 gate/up 3.32 -> 2.51 ms, down 2.04 -> 1.48, qkv 1.62 -> 1.40
constexpr int64_t kQ4Avx512TileMinRows = 32;
constexpr int64_t kQ4PassBytes = int64_t{1} << 20;
constexpr int64_t kQ4PassMinRows = 128;

ARGOSY_AVX512 void q4_avx512_unpack(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins,
                                    int64_t groups, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  float* d_out = reinterpret_cast<float*>(out + groups * 512);
  float* c_out = d_out + groups * kTile;
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(codes + g * 256 + c * 64);
      _mm512_store_si512(out + g * 512 + c * 128, _mm512_and_si512(w, low));
      _mm512_store_si512(out + g * 512 + c * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kTile)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * kTile)));
    _mm512_store_ps(d_out + g * kTile, d);
    _mm512_store_ps(c_out + g * kTile, _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d, m));
  }
}

template <int R, int T, bool Fine>
ARGOSY_AVX512 void q4_avx512_tile(const uint8_t* unpacked, int64_t bytes, const int8_t* xq, const int8_t* xlo,
                                  int64_t k, const float* dx, const float* ux, const int32_t* sq, int64_t groups,
                                  float* res) {
  const float* scales = reinterpret_cast<const float*>(unpacked + groups * 512);
  const float* cs = scales + groups * kTile;
  const int64_t fbytes = bytes / 4;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R][T], dot_lo[R][T];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(-8 * sq[r * groups + g]);
      for (int t = 0; t < T; ++t) {
        dot[r][t] = Fine ? _mm512_setzero_si512() : start;
        if constexpr (Fine) dot_lo[r][t] = start;
      }
    }
    const uint8_t* ug = unpacked + g * 512;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i lo[T], hi[T];
      for (int t = 0; t < T; ++t) {
        lo[t] = _mm512_load_si512(ug + t * bytes + c * 128);
        hi[t] = _mm512_load_si512(ug + t * bytes + c * 128 + 64);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xl = broadcast4_512(xq + r * k + g * kGroup + 8 * c);
        const __m512i xh = broadcast4_512(xq + r * k + g * kGroup + 8 * c + 4);
        for (int t = 0; t < T; ++t) {
          dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo[t], xl);
          dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi[t], xh);
        }
        if constexpr (Fine) {
          const int8_t* p = xlo + r * k + g * kGroup + 8 * c;
          const __m512i ll = broadcast4_512(p), lh = broadcast4_512(p + 4);
          for (int t = 0; t < T; ++t) {
            dot_lo[r][t] = _mm512_dpbusd_epi32(dot_lo[r][t], lo[t], ll);
            dot_lo[r][t] = _mm512_dpbusd_epi32(dot_lo[r][t], hi[t], lh);
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 d = _mm512_load_ps(scales + t * fbytes + g * kTile);
      const __m512 c = _mm512_load_ps(cs + t * fbytes + g * kTile);
      for (int r = 0; r < R; ++r) {
        const __m512i dt = Fine ? fine_dot_512(dot[r][t], dot_lo[r][t]) : dot[r][t];
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
        acc[r][t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dt), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(c, _mm512_set1_ps(ux[r * groups + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(res + (r * T + t) * kTile, acc[r][t]);
}

ARGOSY_AVX512 inline __m512 load16_scales(const float* p) { return _mm512_loadu_ps(p); }
ARGOSY_AVX512 inline __m512 load16_scales(const uint16_t* p) {  // exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R rows x T tiles; start: per row and weight group, -128 times the sum of xq over the group
template <int R, int T, int H, bool Mins, typename S, bool Fine>
ARGOSY_AVX512 void q8_avx512_block(const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx, const float* ux,
                                   const int32_t* start, int64_t groups, const int8_t* codes, const S* scales,
                                   const S* mins, float* res, bool prefetch) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t tile_bytes = k * kTile, tile_groups = groups * H * kTile, tile_mins = groups * kTile;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < groups; ++g) {
    for (int hg = 0; hg < H; ++hg) {
      // (q + 128) . x - 128 * sum(x) = q . x, exactly (the fine form: the start in lo's sum)
      __m512i dot[R][T], dot_lo[R][T];
      for (int r = 0; r < R; ++r) {
        const __m512i s0 = _mm512_set1_epi32(start[r * groups * H + g * H + hg]);
        for (int t = 0; t < T; ++t) {
          dot[r][t] = Fine ? _mm512_setzero_si512() : s0;
          dot_lo[r][t] = s0;
        }
      }
#pragma GCC unroll 8
      for (int64_t j = 8 * g + (8 / H) * hg; j < 8 * g + (8 / H) * (hg + 1); ++j) {
        __m512i xs[R];
        for (int r = 0; r < R; ++r) xs[r] = broadcast4_512(xq + r * k + 4 * j);
        for (int t = 0; t < T; ++t) {
          const int8_t* line = codes + t * tile_bytes + j * 64;
          // the next tile block's same line (a thread's blocks are consecutive): its memory read
          // overlaps this block's arithmetic, which the hardware prefetcher alone does not keep up
          if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(line + T * tile_bytes), _MM_HINT_T1);
          const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(line), bias);
          for (int r = 0; r < R; ++r) {
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], w, xs[r]);
            if constexpr (Fine) dot_lo[r][t] = _mm512_dpbusd_epi32(dot_lo[r][t], w, broadcast4_512(xlo + r * k + 4 * j));
          }
        }
      }
      if constexpr (Fine)
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < T; ++t) dot[r][t] = fine_dot_512(dot[r][t], dot_lo[r][t]);
      for (int t = 0; t < T; ++t) {
        const __m512 d = load16_scales(scales + t * tile_groups + (g * H + hg) * kTile);
        for (int r = 0; r < R; ++r) {
          const __m512 dot_f = _mm512_cvtepi32_ps(dot[r][t]);
          acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g])), dot_f, acc[r][t]);
        }
      }
    }
    if constexpr (Mins) {
      for (int t = 0; t < T; ++t) {
        const __m512 m = load16_scales(mins + t * tile_mins + g * kTile);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(ux[r * groups + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(res + (r * T + t) * kTile, acc[r][t]);
}

// -- AMX-INT8: Q4 steps of many rows ----------------------------------------------------------
//
// Per 16 rows x 16 outputs x one group: one tile dot product (x signed, codes unsigned: the same
// integer sums as the byte dot products above), then the same fp32 combination as the VNNI path,
// 16 rows' accumulators in registers across the groups. A tile's codes are unpacked once for all
// row blocks.


constexpr int64_t kAmxMinRows = 16;  // fewer rows: the VNNI path is faster (SmolLM2 at 8 rows: down 38 vs 53 us, gate/up 54 vs 62)

ARGOSY_AMX inline void amx_configure() {
  AmxConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 64;  // C: 16 rows x 16 int32
  cfg.rows[1] = 16, cfg.colsb[1] = 32;  // A: 16 rows x one group of x (32 int8)
  cfg.rows[2] = 8, cfg.colsb[2] = 64;   // B: 8 quads of k x 16 outputs x 4 codes
  cfg.rows[3] = 16, cfg.colsb[3] = 32;  // the fine form: A of its lo bytes, C of their sums
  cfg.rows[4] = 16, cfg.colsb[4] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see ldtilecfg read it
  _tile_loadconfig(&cfg);
}

// a tile's codes -> B tiles [G][8 rows][64 bytes]: row 2c the low nibbles of chunk c (k = 8c..8c+3),
// row 2c + 1 the high ones (k = 8c+4..8c+7)
ARGOSY_AMX inline void amx_unpack_q4(const uint8_t* codes, int64_t groups, uint8_t* b) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < groups; ++g)
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(codes + g * 256 + c * 64);
      _mm512_store_si512(b + g * 512 + (2 * c) * 64, _mm512_and_si512(w, low));
      _mm512_store_si512(b + g * 512 + (2 * c + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
    }
}

// tiles [t0, t1) x every row; xp: x's codes padded to a multiple of 16 rows (xlp: the fine
// form's lo bytes so)
template <bool Fine>
ARGOSY_AMX void q4_amx(const QuantizedRows& xr, const int8_t* xp, const int8_t* xlp, int64_t rows, int64_t groups,
                       const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, int64_t t0, int64_t t1,
                       const Output& out) {
  const int64_t k = groups * kGroup;
  std::vector<uint8_t> storage(static_cast<size_t>(groups * 512 + 64));
  uint8_t* b = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t dots[16 * 16];
  alignas(64) int32_t dots_lo[16 * 16];
  alignas(64) float res[16 * 16];
  amx_configure();
  for (int64_t t = t0; t < t1; ++t) {
    amx_unpack_q4(codes + t * groups * 256, groups, b);
    ARGOSY_MEMORY_BARRIER();
    const uint16_t* sc = scales + t * groups * kTile;
    const uint16_t* mn = mins + t * groups * kTile;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t nr = std::min<int64_t>(16, rows - r0);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        _tile_zero(0);
        _tile_loadd(1, xp + r0 * k + g * kGroup, k);
        _tile_loadd(2, b + g * 512, 64);
        _tile_dpbsud(0, 1, 2);
        if constexpr (Fine) {  // both products issued before either is stored
          _tile_zero(4);
          _tile_loadd(3, xlp + r0 * k + g * kGroup, k);
          _tile_dpbsud(4, 3, 2);
        }
        _tile_stored(0, dots, 64);
        if constexpr (Fine) _tile_stored(4, dots_lo, 64);
        ARGOSY_MEMORY_BARRIER();
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * kTile)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * kTile)));
        const __m512 c = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d, m);
        const float* dx = xr.dx.data() + r0 * groups + g;
        const float* ux = xr.ux.data() + r0 * groups + g;
        const int32_t* sq = xr.sq.data() + r0 * groups + g;
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          if (r >= nr) break;
          const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups]));
          __m512i dot = _mm512_load_si512(dots + 16 * r);
          if constexpr (Fine) dot = fine_dot_512(dot, _mm512_load_si512(dots_lo + 16 * r));
          const __m512i centred = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * sq[r * groups]));
          acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(centred), acc[r]);
          acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(ux[r * groups]), acc[r]);
        }
      }
      put_tile_rows(out, r0, nr, t * kTile, acc, res);
    }
  }
  _mm_sfence();  // the streamed stores are weakly ordered: done before the threads join
  _tile_release();
}

template <bool Fine>
void q4_run(const LinearCall& call, int64_t tiles, int64_t groups, const uint8_t* cp, const uint16_t* sp,
            const uint16_t* mp);

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t out_features, bool out_float32, bool fine) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 5 && codes.size(2) == 4 && codes.size(3) == 16 &&
                  codes.size(4) == 4 && codes.is_contiguous(),
              "q4_linear: codes must be contiguous uint8 [N/16, K/32, 4, 16, 4]");
  const int64_t tiles = codes.size(0), groups = codes.size(1), k = groups * kGroup;
  TORCH_CHECK(tiles * kTile == out_features, "q4_linear: codes hold ", tiles * kTile, " outputs, not ", out_features);
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                    t->size(1) == groups && t->size(2) == kTile,
                "q4_linear: scales and mins must be contiguous float16 [N/16, K/32, 16]");
  const LinearCall call(x, k, groups, out_features, out_float32, "q4_linear", fine);
  if (call.rows == 0) return call.out;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  if (fine)
    q4_run<true>(call, tiles, groups, cp, sp, mp);
  else
    q4_run<false>(call, tiles, groups, cp, sp, mp);
  return call.out;
}

template <bool Fine>
void q4_run(const LinearCall& call, int64_t tiles, int64_t groups, const uint8_t* cp, const uint16_t* sp,
            const uint16_t* mp) {
  const int64_t rows = call.rows, path = call.path, k = groups * kGroup;
  const QuantizedRows& xr = call.xr;
  const Output& o = call.o;
  if (path == kScalar) {
    for_tile_blocks(tiles, 1, [&](int64_t t0, int64_t t1) { q4_scalar(xr, rows, groups, cp, sp, mp, t0, t1, o); });
    return;
  }
  if (path == kAmx && rows >= kAmxMinRows) {
    const int64_t padded_rows = (rows + 15) / 16 * 16;
    std::vector<int8_t> xp(static_cast<size_t>(padded_rows * k), 0), xlp;
    std::memcpy(xp.data(), xr.q.data(), xr.q.size());
    if constexpr (Fine) {
      xlp.assign(xp.size(), 0);
      std::memcpy(xlp.data(), xr.lo.data(), xr.lo.size());
    }
    const int64_t grain = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      q4_amx<Fine>(xr, xp.data(), xlp.data(), rows, groups, cp, sp, mp, t0, t1, o);
    });
    return;
  }
  if (path >= kAvx512 && rows >= kQ4Avx512TileMinRows) {
    const int64_t pass = std::max<int64_t>(kQ4PassMinRows, kQ4PassBytes / (k * (Fine ? 2 : 1)));
    for (int64_t p0 = 0; p0 < rows; p0 += pass) {
      const int64_t p1 = std::min(rows, p0 + pass);
      for_tile_blocks(tiles, tiles % 2 == 0 ? 2 : 1, [&](int64_t t0, int64_t t1) {
        const int64_t bytes = groups * (512 + 2 * kTile * 4);  // a tile's bytes, its d and 8 d + m
        std::unique_ptr<uint8_t[], void (*)(void*)> buffer(
            static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(bytes * (t1 - t0)))), std::free);
        for (int64_t t = t0; t < t1; ++t)
          q4_avx512_unpack(cp + t * groups * 256, sp + t * groups * kTile, mp + t * groups * kTile, groups,
                           buffer.get() + (t - t0) * bytes);
        constexpr int RB = Fine ? 3 : 6;
        float res[RB * 2 * kTile];
        const int64_t width = (t1 - t0) * kTile;
        auto block = [&](int64_t r0, auto rows_constant) {
          constexpr int R = decltype(rows_constant)::value;
          const RowsAt xb = rows_at(xr, r0, k, groups);
          if (t1 - t0 == 2)
            q4_avx512_tile<R, 2, Fine>(buffer.get(), bytes, xb.q, xb.lo, k, xb.dx, xb.ux, xb.sq, groups, res);
          else
            q4_avx512_tile<R, 1, Fine>(buffer.get(), bytes, xb.q, xb.lo, k, xb.dx, xb.ux, xb.sq, groups, res);
          for (int r = 0; r < R; ++r) put_row_streamed(o, r0 + r, t0 * kTile, res + r * width, width);
        };
        for_rows_in_blocks_of<RB>(p0, p1, block);
        _mm_sfence();  // the streamed stores done before the threads join
      });
    }
    return;
  }
  const int64_t tiles_per_block = (path >= kAvx512 && tiles % 2 == 0) ? 2 : 1;
  for_tile_blocks(tiles, tiles_per_block, [&](int64_t t0, int64_t t1) {
    float res[kRowBlock * 2 * kTile];
    const int64_t width = (t1 - t0) * kTile;
    for_row_blocks(rows, [&](int64_t r0, auto rows_constant) {
      constexpr int R = decltype(rows_constant)::value;
      const RowsAt xb = rows_at(xr, r0, k, groups);
      const uint8_t* c = cp + t0 * groups * 256;
      const uint16_t* s = sp + t0 * groups * kTile;
      const uint16_t* m = mp + t0 * groups * kTile;
      if (path >= kAvx512 && t1 - t0 == 2)
        q4_avx512_block<R, 2, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, xb.sq, groups, c, s, m, res);
      else if (path >= kAvx512)
        q4_avx512_block<R, 1, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, xb.sq, groups, c, s, m, res);
      else
        q4_avx2_rows<R, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, xb.sq, groups, c, s, m, res);
      for (int r = 0; r < R; ++r) o.put(r0 + r, t0 * kTile, res + r * width, width);
    });
  });
}

// the vector paths of q8_linear, one weight form (H weight groups to a group of x, mins or not,
// scales float32 or float16); start: the AVX-512 path's per row and weight group -128 * sum(xq)
template <int H, bool Mins, typename S, bool Fine>
void q8_vector(const QuantizedRows& xr, const Written<int32_t>& start, int64_t rows, int64_t groups,
               int64_t tiles, int64_t path, const Q8Weight<S>& wt, const Output& o) {
  const int n16 = static_cast<int>(wt.n16);
  const int64_t k = groups * kGroup;
  const int64_t tiles_per_block = (path >= kAvx512 && tiles % 2 == 0) ? 2 : 1;
  for_tile_blocks(tiles, tiles_per_block, [&](int64_t t0, int64_t t1) {
    float res[kWideRowBlock * 2 * kTile];
    const int64_t width = (t1 - t0) * kTile;
    int64_t done = 0;
    // a decode step's few rows (AVX-512): eight rows a tile, each tile's codes read from memory
    // once per eight rows and the next tile's prefetched meanwhile (Gemma 3's 262k-row head at 8
    // rows ~11 -> ~7.5 ms, at 32 rows 34 -> 29 ms); many rows keep the 4 x 2-tile blocks, whose
    // codes stay in cache
    if (path >= kAvx512 && rows <= kWideMaxRows) {
      for (; done + kWideRowBlock <= rows; done += kWideRowBlock) {
        for (int64_t t = t0; t < t1; ++t) {
          q8_avx512_block<kWideRowBlock, 1, H, Mins, S, Fine>(
              xr.q.data() + done * k, Fine ? xr.lo.data() + done * k : nullptr, k, xr.dx.data() + done * groups,
              xr.ux.data() + done * groups,
              start.data() + done * groups * H, groups, wt.codes + t * k * kTile, wt.scales + t * groups * H * kTile,
              Mins ? wt.mins + t * groups * kTile : nullptr, res, done == 0);
          for (int r = 0; r < kWideRowBlock; ++r) o.put(done + r, t * kTile, res + r * kTile, kTile);
        }
      }
    }
    for_row_blocks(rows - done, [&](int64_t r_rest, auto rows_constant) {
      constexpr int R = decltype(rows_constant)::value;
      const int64_t r0 = done + r_rest;
      const RowsAt xb = rows_at(xr, r0, k, groups);
      const int8_t* c = wt.codes + t0 * k * kTile;
      const S* s = wt.scales + t0 * groups * H * kTile;
      const S* m = Mins ? wt.mins + t0 * groups * kTile : nullptr;
      if (path >= kAvx512) {
        const int32_t* st = start.data() + r0 * groups * H;
        if (t1 - t0 == 2)
          q8_avx512_block<R, 2, H, Mins, S, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, st, groups, c, s, m, res, r0 == 0);
        else
          q8_avx512_block<R, 1, H, Mins, S, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, st, groups, c, s, m, res, r0 == 0);
      } else {
        const int32_t* st = start.empty() ? nullptr : start.data() + r0 * groups * H;
        q8_avx2_any<R, H, Mins, S, Fine>(n16, wt.bias, xb.q, xb.lo, k, xb.dx, xb.ux, st, groups, c, s, m, res);
      }
      for (int r = 0; r < R; ++r) o.put(r0 + r, t0 * kTile, res + r * width, width);
    });
  });
}

// -- AMX-INT8: q8 steps of 16 rows or more ------------------------------------------------------
//
// The codes' layout is already a B tile's: a weight group of 32 k is 8 rows of 64 bytes (4
// consecutive k of 16 outputs), loaded in place. Signed codes times signed x (tdpbssd) give the
// integer dot q . xq itself (no bias, no start); then the same fp32 steps as the vector paths:
// the same bits. (The fine form: a second A tile of x's lo bytes, 128 hi + lo.)

constexpr int64_t kQ8AmxMinRows = 16;

template <int H>
ARGOSY_AMX inline void q8_amx_configure() {
  AmxConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 64;      // C: 16 rows x 16 int32
  cfg.rows[1] = 16, cfg.colsb[1] = 32 / H;  // A: 16 rows x one weight group of x
  cfg.rows[2] = 8 / H, cfg.colsb[2] = 64;   // B: its 8 / H quads of k
  cfg.rows[3] = 16, cfg.colsb[3] = 32 / H;  // the fine form's lo bytes, and their sums
  cfg.rows[4] = 16, cfg.colsb[4] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see ldtilecfg read it
  _tile_loadconfig(&cfg);
}

ARGOSY_AMX inline __m512 amx_scales16(const float* p) { return _mm512_loadu_ps(p); }
ARGOSY_AMX inline __m512 amx_scales16(const uint16_t* p) {  // exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// tiles [t0, t1) x every row; xp (xlp): x's codes (lo bytes) padded to a multiple of 16 rows
template <int H, bool Mins, typename S, bool Fine>
ARGOSY_AMX void q8_amx(const QuantizedRows& xr, const int8_t* xp, const int8_t* xlp, int64_t rows, int64_t groups,
                       const Q8Weight<S>& wt, int64_t t0, int64_t t1, const Output& out) {
  const int64_t k = groups * kGroup;
  alignas(64) int32_t dots[16 * 16];
  alignas(64) int32_t dots_lo[16 * 16];
  alignas(64) float res[16 * 16];
  q8_amx_configure<H>();
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* codes = wt.codes + t * k * kTile;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t nr = std::min<int64_t>(16, rows - r0);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const float* dx = xr.dx.data() + r0 * groups + g;
        for (int hg = 0; hg < H; ++hg) {
          const int64_t at = r0 * k + g * kGroup + hg * (kGroup / H);
          _tile_zero(0);
          _tile_loadd(1, xp + at, k);
          _tile_loadd(2, codes + (g * 8 + hg * (8 / H)) * 64, 64);
          _tile_dpbssd(0, 1, 2);
          if constexpr (Fine) {  // both products issued before either is stored
            _tile_zero(4);
            _tile_loadd(3, xlp + at, k);
            _tile_dpbssd(4, 3, 2);
          }
          _tile_stored(0, dots, 64);
          if constexpr (Fine) _tile_stored(4, dots_lo, 64);
          ARGOSY_MEMORY_BARRIER();
          const __m512 sc = amx_scales16(wt.scales + ((t * groups + g) * H + hg) * kTile);
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            if (r >= nr) break;
            __m512i dot = _mm512_load_si512(dots + 16 * r);
            if constexpr (Fine)
              dot = _mm512_add_epi32(_mm512_slli_epi32(dot, kFineShift), _mm512_load_si512(dots_lo + 16 * r));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(dx[r * groups])), _mm512_cvtepi32_ps(dot), acc[r]);
          }
        }
        if constexpr (Mins) {
          const __m512 m = amx_scales16(wt.mins + (t * groups + g) * kTile);
          const float* ux = xr.ux.data() + r0 * groups + g;
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            if (r >= nr) break;
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ux[r * groups]), acc[r]);
          }
        }
      }
      put_tile_rows(out, r0, nr, t * kTile, acc, res);
    }
  }
  _mm_sfence();  // the streamed stores are weakly ordered: done before the threads join
  _tile_release();
}

template <int H, bool Mins, typename S, bool Fine>
void q8_amx_run(const QuantizedRows& xr, int64_t rows, int64_t groups, int64_t tiles, const Q8Weight<S>& wt,
                const Output& o) {
  const int64_t k = groups * kGroup, padded_rows = (rows + 15) / 16 * 16;
  std::vector<int8_t> xp(static_cast<size_t>(padded_rows * k), 0), xlp;
  std::memcpy(xp.data(), xr.q.data(), xr.q.size());
  if constexpr (Fine) {
    xlp.assign(xp.size(), 0);
    std::memcpy(xlp.data(), xr.lo.data(), xr.lo.size());
  }
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    q8_amx<H, Mins, S, Fine>(xr, xp.data(), xlp.data(), rows, groups, wt, t0, t1, o);
  });
}

template <bool Fine, typename S>
void q8_forms(const QuantizedRows& xr, const Written<int32_t>& start, int64_t rows, int64_t groups, int64_t tiles,
              int64_t path, const Q8Weight<S>& wt, const Output& o, bool mins) {
  if (path == kAmx && rows >= kQ8AmxMinRows) {
    if (wt.h == 2 && mins)
      q8_amx_run<2, true, S, Fine>(xr, rows, groups, tiles, wt, o);
    else if (wt.h == 2)
      q8_amx_run<2, false, S, Fine>(xr, rows, groups, tiles, wt, o);
    else if (mins)
      q8_amx_run<1, true, S, Fine>(xr, rows, groups, tiles, wt, o);
    else
      q8_amx_run<1, false, S, Fine>(xr, rows, groups, tiles, wt, o);
    return;
  }
  if (wt.h == 2 && mins)
    q8_vector<2, true, S, Fine>(xr, start, rows, groups, tiles, path, wt, o);
  else if (wt.h == 2)
    q8_vector<2, false, S, Fine>(xr, start, rows, groups, tiles, path, wt, o);
  else if (mins)
    q8_vector<1, true, S, Fine>(xr, start, rows, groups, tiles, path, wt, o);
  else
    q8_vector<1, false, S, Fine>(xr, start, rows, groups, tiles, path, wt, o);
}

template <typename S>
void q8_run(const LinearCall& call, int64_t groups, int64_t tiles, const Q8Weight<S>& wt) {
  const int64_t rows = call.rows, path = call.path, h = wt.h;
  const QuantizedRows& xr = call.xr;
  const Output& o = call.o;
  if (path == kScalar) {
    for_tile_blocks(tiles, 1, [&](int64_t t0, int64_t t1) { q8_scalar(xr, rows, groups, wt, t0, t1, o); });
    return;
  }
  // the integer sums' starting values, per row and weight group: -(the codes' bias) times the
  // sum of xq over the group (AVX-512: the codes + 128; AVX2: + wt.bias where the range allows)
  const int32_t bias = path >= kAvx512 ? 128 : wt.n16 > 0 ? wt.bias : 0;
  Written<int32_t> start;
  if (path >= kAvx512 || wt.n16 > 0) start = code_starts(xr, rows, groups, h, bias, path >= kAvx512);
  const bool mins = wt.mins != nullptr;
  if (xr.fine())
    q8_forms<true, S>(xr, start, rows, groups, tiles, path, wt, o, mins);
  else
    q8_forms<false, S>(xr, start, rows, groups, tiles, path, wt, o, mins);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t out_features, bool out_float32, int64_t code_lo,
                     int64_t code_hi, bool fine) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4 && codes.size(2) == 16 && codes.size(3) == 4 &&
                  codes.is_contiguous(),
              "q8_linear: codes must be contiguous int8 [N/16, K/4, 16, 4]");
  const int64_t tiles = codes.size(0), k = codes.size(1) * 4;
  TORCH_CHECK(k % kGroup == 0, "q8_linear: in_features must be a multiple of 32");
  const int64_t groups = k / kGroup;
  TORCH_CHECK(tiles * kTile == out_features, "q8_linear: codes hold ", tiles * kTile, " outputs, not ", out_features);
  TORCH_CHECK(scales.dim() == 3 && (scales.size(1) == groups || scales.size(1) == 2 * groups),
              "q8_linear: scales must be [N/16, K/32 or K/16, 16]");
  const int64_t h = scales.size(1) / groups;
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() && scales.size(0) == tiles &&
                  scales.size(2) == kTile,
              "q8_linear: scales must be contiguous float32 or float16 [N/16, K/G, 16]");
  const bool has_mins = mins.has_value() && mins->defined();
  if (has_mins)
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() && mins->dim() == 3 &&
                    mins->size(0) == tiles && mins->size(1) == groups && mins->size(2) == kTile,
                "q8_linear: mins must be contiguous [N/16, K/32, 16], of the scales' dtype");
  TORCH_CHECK(-127 <= code_lo && code_lo <= code_hi && code_hi <= 127,
              "q8_linear: code_lo and code_hi must bound the codes within [-127, 127]");
  const LinearCall call(x, k, groups, out_features, out_float32, "q8_linear", fine);
  if (call.rows == 0) return call.out;
  const auto [bias, n16] = avx2_bias(code_lo, code_hi);
  if (half) {
    const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    const auto* mp = has_mins ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
    q8_run<uint16_t>(call, groups, tiles, Q8Weight<uint16_t>{codes.data_ptr<int8_t>(), sp, mp, h, bias, n16});
  } else {
    const float* mp = has_mins ? mins->data_ptr<float>() : nullptr;
    q8_run<float>(call, groups, tiles,
                  Q8Weight<float>{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), mp, h, bias, n16});
  }
  return call.out;
}


// the path the next calls take: "auto" (the best this CPU has), "scalar", "avx2", "avx512-vnni";
// returns the one in force. A path the CPU lacks is refused.
std::string set_path(const std::string& name) {
  int64_t path = kAuto;
  if (name == "scalar") path = kScalar;
  else if (name == "avx2") path = kAvx2;
  else if (name == "avx512-vnni") path = kAvx512;
  else if (name == "amx-int8") path = kAmx;
  else TORCH_CHECK(name == "auto", "set_path: unknown path ", name);
  TORCH_CHECK(path != kAvx2 || has_avx2(), "set_path: this CPU has no AVX2 + FMA + F16C");
  TORCH_CHECK(path != kAvx512 || has_avx512(), "set_path: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(path != kAmx || has_amx(), "set_path: this CPU has no AMX-INT8 (or the kernel refused it)");
  forced_path().store(path);
  return path_name(current_path());
}

std::vector<std::string> paths() {
  std::vector<std::string> names{"scalar"};
  if (has_avx2()) names.emplace_back("avx2");
  if (has_avx512()) names.emplace_back("avx512-vnni");
  if (has_amx()) names.emplace_back("amx-int8");
  return names;
}

std::string path() { return path_name(current_path()); }

}  // namespace

TORCH_LIBRARY(argosy_iq, m) {
  m.def(
      "q4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int out_features, bool out_float32, "
      "bool fine=False) -> Tensor");
  m.def(
      "q8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int out_features, "
      "bool out_float32, int code_lo, int code_hi, bool fine=False) -> Tensor");
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "Tensor block_ids, Tensor mask, int block_size) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.def("set_path(str name) -> str");
  m.def("paths() -> str[]");
  m.def("path() -> str");
}

TORCH_LIBRARY_IMPL(argosy_iq, CompositeExplicitAutograd, m) {
  m.impl("set_path", &set_path);
  m.impl("paths", &paths);
  m.impl("path", &path);
}

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}
