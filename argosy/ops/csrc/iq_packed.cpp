// Invariant linear layers on codes held at the file's bits: GGUF Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1
// weights in memory as 4, 5 or 6 bits a weight plus their own scales, unpacked in registers.
//
// argosy_iq::kq_linear(x, nib, high, scales, scale_d, mins, min_d, bits, bias, out_features,
//                      out_float32)
//   w[n, k] = s[n, k / G] * (u[n, k] - bias) (+ m[n, k / 32]), G = 32 or 16, where the unsigned
//   code u = q + bias is in [0, 2^bits): its low 4 bits in `nib`, its bits 4.. in `high`.
//   The scales are either float16 (Q5_0, Q5_1: the file's d and m) or a K-quant's own form, an
//   integer per weight group times a float16 per 256 weights: s = d * sc (Q4_K, Q5_K: sc 0..63;
//   Q6_K: int8), and the K-quants' minimums m = -(dmin * mn), products exact in float32, as the
//   gguf package computes them. Paths: scalar (the reference), AVX2, AVX-512 VNNI, and AMX-INT8
//   tile dot products for steps of 16 rows or more (prefill, batched decode).
// kq_linear(..., fine=False, swiglu=False, add=None): swiglu (a gate_up projection, N a multiple
//   of 32, float32 out): [M, N/2], the SwiGLU of outputs n and n + N/2 (iq_swiglu.h), the bits
//   argosy_iq::swiglu gives on the plain output; the AMX and VNNI tile kernels compute each
//   gate tile beside its up tile and store only the SwiGLU (no [M, N] tensor written). add
//   (float32 [N], a float32 output, not with swiglu): added to every row as it is stored, the
//   bits of adding it after (a layer's bias).
//
// The arithmetic is q8_linear's (iq_linear.cpp), step for step: the rows quantized per 32 as
// there (iq_rows.h), the same integer dot per row, output and weight group (u . xq, started from
// -bias times the sum of xq over the weight group: exactly q . xq), the same fp32 fused
// multiply-adds in the same order. So a layer gives the bits q8_linear gives on the same codes
// and scales as int8 (tests/unit/test_packed_codes.py holds every path to that and to the scalar
// reference), while a decode step reads 4.6 (Q4_K), 5.5 (Q5_K, Q5_0) or 6.6 (Q6_K) bits a
// weight instead of 8 plus a float32 scale.
//
// Layouts (argosy/ops/packed_codes.py), 16 outputs to a tile t, G32 = K / 32 groups:
//   nib uint8 [N/16, G32, 4, 16, 4]: byte [t, g, c, i, b] = lo4(u[16t+i, 32g+8c+b]) |
//     lo4(u[16t+i, 32g+8c+4+b]) << 4 (iq_linear's Q4 layout: line e = 2c + half of a group holds
//     k = 32g + 4e + b in lane 4i + b, as q8_linear's layout does)
//   high uint8 [N/16, G32, (bits - 4) * 64]: bits 5: byte [t, g, L] bit e = bit 4 of line e's
//     code in lane L; bits 6: byte [t, g, p, L] bits 2j, 2j+1 = bits 4, 5 of line 4p + j's code
//   scales [N/16, K/G, 16] float16, or uint8 / int8 with scale_d float16 [N/16, K/256, 16];
//   mins [N/16, G32, 16] in the same form (uint8 with min_d), or none.


#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <memory>
#include <vector>

#include "iq_common.h"
#include "iq_rows.h"
#include "iq_swiglu.h"

namespace {

using namespace argosy_iq;

enum ScaleKind : int { kHalfScales = 0, kSuperU8 = 1, kSuperI8 = 2 };
template <int Kind>
constexpr int64_t kScaleBytes = Kind == kHalfScales ? 2 : 1;  // a scale's (or minimum's) bytes

// one per-tile array of scales (or minimums): [T, per_tile / 16, 16], with, for a super form,
// d float16 [T, supers, 16] (one per 256 weights: per_super weight groups)
struct ScaleRef {
  const void* values = nullptr;
  const uint16_t* d = nullptr;
  int64_t groups = 0;     // weight groups a row
  int64_t supers = 0;     // 256-weight blocks a row
  int super_shift = 0;  // log2 of the weight groups a 256-weight block (8 or 16: a shift, not a division)
  bool negate = false;    // the K-quants' minimums: -(dmin * mn)
};

struct PackedW {
  const uint8_t* nib;
  const uint8_t* high;  // nullptr for 4 bits
  int64_t groups;       // groups of 32 a row
  ScaleRef s, m;
  int32_t bias;
};

template <int Kind>
inline float scale_at(const ScaleRef& s, int64_t t, int64_t wg, int64_t i) {
  const int64_t at = (t * s.groups + wg) * kTile + i;
  if constexpr (Kind == kHalfScales) {
    return half_to_float(static_cast<const uint16_t*>(s.values)[at]);
  } else {
    const float d = half_to_float(s.d[(t * s.supers + (wg >> s.super_shift)) * kTile + i]);
    const float sc = Kind == kSuperU8 ? static_cast<float>(static_cast<const uint8_t*>(s.values)[at])
                                      : static_cast<float>(static_cast<const int8_t*>(s.values)[at]);
    const float v = d * sc;  // exact: an 11-bit significand times an 8-bit integer
    return s.negate ? -v : v;
  }
}

template <int Bits>
inline int32_t code_at(const PackedW& w, int64_t t, int64_t g, int64_t e, int64_t lane) {
  const uint8_t byte = w.nib[((t * w.groups + g) * 4 + e / 2) * 64 + lane];
  int32_t u = (e & 1 ? byte >> 4 : byte) & 0x0f;
  if constexpr (Bits == 5) u |= ((w.high[(t * w.groups + g) * 64 + lane] >> e) & 1) << 4;
  if constexpr (Bits == 6) u |= ((w.high[(t * w.groups + g) * 128 + (e / 4) * 64 + lane] >> (2 * (e % 4))) & 3) << 4;
  return u - w.bias;
}

// -- scalar: the reference ---------------------------------------------------------------------

template <int Bits, int H, bool Mins, int Kind>
void kq_scalar(const QuantizedRows& xr, int64_t rows, const PackedW& w, int64_t t0, int64_t t1, const Output& out) {
  const int64_t groups = w.groups, k = groups * kGroup, lines = 8 / H;
  float acc[kTile];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc, acc + kTile, 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < kTile; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            int32_t dot = 0;
            for (int64_t e = lines * h; e < lines * (h + 1); ++e)
              for (int64_t b = 0; b < 4; ++b)
                dot += code_at<Bits>(w, t, g, e, 4 * i + b) * xr.code(r * k + g * kGroup + 4 * e + b);
            const float s = scale_at<Kind>(w.s, t, g * H + h, i);
            acc[i] = std::fma(s * xr.dx[r * groups + g], static_cast<float>(dot), acc[i]);
          }
          if constexpr (Mins) acc[i] = std::fma(scale_at<Kind>(w.m, t, g, i), xr.ux[r * groups + g], acc[i]);
        }
      }
      out.put(r, t * kTile, acc, kTile);
    }
  }
}

// -- AVX2 + FMA: 8 outputs a vector, a tile is two halves --------------------------------------

#define ARGOSY_KQ_AVX2 __attribute__((target("avx2,fma,f16c")))

// line e of group g, outputs 8h .. 8h + 7: the unsigned codes u (32 bytes)
template <int Bits>
ARGOSY_KQ_AVX2 inline __m256i codes_256(const PackedW& w, int64_t t, int64_t g, int e, int h) {
  const int64_t tg = t * w.groups + g;
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.nib + (tg * 4 + e / 2) * 64 + h * 32));
  if (e & 1) v = _mm256_srli_epi16(v, 4);
  v = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
  if constexpr (Bits > 4) {
    const int plane = Bits == 5 ? 0 : e / 4, shift = Bits == 5 ? e : 2 * (e % 4);
    const __m256i hv = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(w.high + tg * (Bits - 4) * 64 + plane * 64 + h * 32));
    // a 16-bit shift then a byte mask: each byte's own bits (nothing crosses the mask)
    const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(shift)),
                                          _mm256_set1_epi8(Bits == 5 ? 0x01 : 0x03));
    v = _mm256_or_si256(v, _mm256_slli_epi16(bits, 4));
  }
  return v;
}

template <int Kind>
ARGOSY_KQ_AVX2 inline __m256 scales_8(const ScaleRef& s, int64_t t, int64_t wg, int h) {
  const int64_t at = (t * s.groups + wg) * kTile + 8 * h;
  if constexpr (Kind == kHalfScales) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s.values) + at)));
  } else {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(s.d + (t * s.supers + (wg >> s.super_shift)) * kTile + 8 * h)));
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.values) + at));
    const __m256 sc = _mm256_cvtepi32_ps(Kind == kSuperU8 ? _mm256_cvtepu8_epi32(raw) : _mm256_cvtepi8_epi32(raw));
    const __m256 v = _mm256_mul_ps(d, sc);
    return s.negate ? _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), _mm256_set1_epi32(INT32_MIN))) : v;
  }
}

// R rows x one tile. Byte products of u (<= 2^bits - 1) and x summed N steps in int16 (N * span
// <= 129: below 2^15), widened once, from start (-bias times the sum of xq over the weight group)
ARGOSY_KQ_AVX2 inline __m256i broadcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// xlo: the fine form's lo bytes (Fine; iq_rows.h), laid out as xq. The start goes into the last
// sum: 128 (u . hi) + (u . lo) + start
template <int R, int Bits, int H, bool Mins, int Kind, bool Fine>
ARGOSY_KQ_AVX2 void kq_avx2_rows(const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx, const float* ux,
                                 const int32_t* start, const PackedW& w, int64_t t, float* res) {
  constexpr int J = 8 / H, N = Bits == 4 ? 8 : Bits == 5 ? 4 : 2;
  static_assert(J % N == 0, "the int16 sums cover whole weight groups");
  const int64_t groups = w.groups;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    for (int hg = 0; hg < H; ++hg) {
      __m256i dot[R][2], dot_lo[R][2];
      for (int r = 0; r < R; ++r) {
        const __m256i s0 = _mm256_set1_epi32(start[(r * groups + g) * H + hg]);
        dot[r][0] = dot[r][1] = Fine ? _mm256_setzero_si256() : s0;
        dot_lo[r][0] = dot_lo[r][1] = s0;
      }
      for (int jb = 0; jb < J; jb += N) {
        __m256i sum16[R][2], sum16_lo[R][2];
        for (int r = 0; r < R; ++r)
          sum16[r][0] = sum16[r][1] = sum16_lo[r][0] = sum16_lo[r][1] = _mm256_setzero_si256();
        for (int jj = 0; jj < N; ++jj) {
          const int e = J * hg + jb + jj;
          for (int h = 0; h < 2; ++h) {
            const __m256i u = codes_256<Bits>(w, t, g, e, h);
            for (int r = 0; r < R; ++r) {
              const int64_t at = r * k + g * kGroup + 4 * e;
              sum16[r][h] = _mm256_add_epi16(sum16[r][h], _mm256_maddubs_epi16(u, broadcast4_256(xq + at)));
              if constexpr (Fine)
                sum16_lo[r][h] = _mm256_add_epi16(sum16_lo[r][h], _mm256_maddubs_epi16(u, broadcast4_256(xlo + at)));
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
          for (int h = 0; h < 2; ++h)
            dot[r][h] = _mm256_add_epi32(_mm256_slli_epi32(dot[r][h], kFineShift), dot_lo[r][h]);
      for (int h = 0; h < 2; ++h) {
        const __m256 s = scales_8<Kind>(w.s, t, g * H + hg, h);
        for (int r = 0; r < R; ++r) {
          const __m256 dd = _mm256_mul_ps(s, _mm256_set1_ps(dx[r * groups + g]));
          acc[r][h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot[r][h]), acc[r][h]);
        }
      }
    }
    if constexpr (Mins) {
      for (int h = 0; h < 2; ++h) {
        const __m256 m = scales_8<Kind>(w.m, t, g, h);
        for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(ux[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(res + r * kTile + 8 * h, acc[r][h]);
}

// Many rows (prefill): a tile's codes unpacked once into `codes` ([groups, 8 lines, 2 halves, 32
// bytes], codes_256's vectors), then a few rows at a time read them from L1/L2: no unpacking per
// row block, and the fine form's two planes one after the other. Same integer sums, the same fp32
// steps in the same order. Rows a block: what keeps the int16 sums, the int32 dots and the fp32
// accumulators in 16 registers (3 rows of a 4-bit form's one-pass dots; 2 otherwise: measured,
// 3 rows ~1.3x the speed of 4, which spill). One thread, 512 rows (Zen 3): Q4_K 8960 x 1536
// 53 -> 78 GMAC/s, its fine form 31 -> 39, Q6_K 1536 x 8960 28.5 -> 59. Below 32 rows (a
// decode step's batch) the per-row-block unpacking above read as fast or faster (4 rows, Q4_K
// 0.51 vs 0.70 ms; this VM's timings swing 1.5x run to run).
constexpr int64_t kKqAvx2TileMinRows = 32;

template <int Bits, int H, bool Fine>
constexpr int kq_avx2_tile_rows() {
  return !Fine ? 3 : 2;
}

// codes as above; scales [groups * H, 16] and mins [groups, 16] as floats (scales_8's values)
template <int Bits, int H, bool Mins, int Kind>
ARGOSY_KQ_AVX2 void kq_avx2_unpack(const PackedW& w, int64_t t, uint8_t* codes, float* scales, float* mins) {
  for (int64_t g = 0; g < w.groups; ++g) {
    for (int e = 0; e < 8; ++e)
      for (int h = 0; h < 2; ++h)
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + (g * 8 + e) * 64 + h * 32), codes_256<Bits>(w, t, g, e, h));
    for (int h = 0; h < 2; ++h) {
      for (int hg = 0; hg < H; ++hg)
        _mm256_store_ps(scales + (g * H + hg) * kTile + 8 * h, scales_8<Kind>(w.s, t, g * H + hg, h));
      if constexpr (Mins) _mm256_store_ps(mins + g * kTile + 8 * h, scales_8<Kind>(w.m, t, g, h));
    }
  }
}

template <int R, int Bits, int H, bool Mins, int Kind, bool Fine>
ARGOSY_KQ_AVX2 void kq_avx2_tile(const uint8_t* codes, const float* scales, const float* mins, const int8_t* xq,
                                 const int8_t* xlo, int64_t k, const float* dx, const float* ux, const int32_t* start,
                                 int64_t groups, float* res) {
  constexpr int J = 8 / H, N = Bits == 4 ? 8 : Bits == 5 ? 4 : 2;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* cg = codes + g * 512;
    for (int hg = 0; hg < H; ++hg) {
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int plane = 0; plane < (Fine ? 2 : 1); ++plane) {
        const int8_t* xs = plane == 0 ? xq : xlo;
        if (plane == 1)
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_slli_epi32(dot[r][h], kFineShift);
        for (int jb = 0; jb < J; jb += N) {
          __m256i sum16[R][2];
          for (int r = 0; r < R; ++r) sum16[r][0] = sum16[r][1] = _mm256_setzero_si256();
          // a loop, not unrolled: unrolled, GCC computed every product first and summed them in
          // a tree (spilling them), at half the speed
#pragma GCC unroll 1
          for (int jj = 0; jj < N; ++jj) {
            const int e = J * hg + jb + jj;
            const __m256i u0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(cg + e * 64));
            const __m256i u1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(cg + e * 64 + 32));
            for (int r = 0; r < R; ++r) {
              const __m256i xb = broadcast4_256(xs + r * k + g * kGroup + 4 * e);
              sum16[r][0] = _mm256_add_epi16(sum16[r][0], _mm256_maddubs_epi16(u0, xb));
              sum16[r][1] = _mm256_add_epi16(sum16[r][1], _mm256_maddubs_epi16(u1, xb));
            }
          }
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(sum16[r][h], ones));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_load_ps(scales + (g * H + hg) * kTile + 8 * h);
        for (int r = 0; r < R; ++r) {
          const __m256i d = _mm256_add_epi32(dot[r][h], _mm256_set1_epi32(start[(r * groups + g) * H + hg]));
          const __m256 dd = _mm256_mul_ps(s, _mm256_set1_ps(dx[r * groups + g]));
          acc[r][h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(d), acc[r][h]);
        }
      }
    }
    if constexpr (Mins) {
      for (int h = 0; h < 2; ++h) {
        const __m256 m = _mm256_load_ps(mins + g * kTile + 8 * h);
        for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(ux[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(res + r * kTile + 8 * h, acc[r][h]);
}

// -- AVX-512 VNNI: 16 outputs a vector --------------------------------------------------------

#define ARGOSY_KQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

template <int Bits>
ARGOSY_KQ_AVX512 inline __m512i codes_512(const PackedW& w, int64_t t, int64_t g, int e) {
  const int64_t tg = t * w.groups + g;
  __m512i v = _mm512_loadu_si512(w.nib + (tg * 4 + e / 2) * 64);
  if (e & 1) v = _mm512_srli_epi16(v, 4);
  v = _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
  if constexpr (Bits > 4) {
    const int plane = Bits == 5 ? 0 : e / 4, shift = Bits == 5 ? e : 2 * (e % 4);
    const __m512i hv = _mm512_loadu_si512(w.high + tg * (Bits - 4) * 64 + plane * 64);
    const __m512i bits = _mm512_and_si512(_mm512_srl_epi16(hv, _mm_cvtsi32_si128(shift)),
                                          _mm512_set1_epi8(Bits == 5 ? 0x01 : 0x03));
    v = _mm512_or_si512(v, _mm512_slli_epi16(bits, 4));
  }
  return v;
}

template <int Kind>
ARGOSY_KQ_AVX512 inline __m512 scales_16(const ScaleRef& s, int64_t t, int64_t wg) {
  const int64_t at = (t * s.groups + wg) * kTile;
  if constexpr (Kind == kHalfScales) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(s.values) + at)));
  } else {
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.d + (t * s.supers + (wg >> s.super_shift)) * kTile)));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.values) + at));
    const __m512 sc = _mm512_cvtepi32_ps(Kind == kSuperU8 ? _mm512_cvtepu8_epi32(raw) : _mm512_cvtepi8_epi32(raw));
    const __m512 v = _mm512_mul_ps(d, sc);
    return s.negate ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)))
                    : v;
  }
}

// R rows x T tiles from tile t0 (consecutive); start: per row and weight group
ARGOSY_KQ_AVX512 inline __m512i broadcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

ARGOSY_KQ_AVX512 inline __m512i fine_dot_512(__m512i hi, __m512i lo) {  // 128 * (u . hi) + (u . lo)
  return _mm512_add_epi32(_mm512_slli_epi32(hi, kFineShift), lo);
}

template <int R, int T, int Bits, int H, bool Mins, int Kind, bool Fine>
ARGOSY_KQ_AVX512 void kq_avx512_block(const int8_t* xq, const int8_t* xlo, int64_t k, const float* dx,
                                      const float* ux, const int32_t* start, const PackedW& w, int64_t t0, float* res,
                                      bool prefetch) {
  const int64_t groups = w.groups;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (prefetch) {  // the next tile block's group: its memory read overlaps this block's arithmetic
      for (int t = 0; t < T; ++t) {
        const int64_t tn = t0 + T + t;
        const int64_t tg = tn * groups + g;
        for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(w.nib + tg * 256 + c * 64), _MM_HINT_T1);
        for (int p = 0; p < Bits - 4; ++p)
          _mm_prefetch(reinterpret_cast<const char*>(w.high + tg * (Bits - 4) * 64 + p * 64), _MM_HINT_T1);
        // its scales' and minimums' lines too (16 a weight group and tile, one or two bytes each):
        // left to the hardware's prefetcher beside the codes' streams, the 1.5B's one-row step on
        // an AVX-512 EPYC (Zen 4) ran 5% slower, the fine-form Q6_K head 8-28%
        constexpr int64_t kBytes = kScaleBytes<Kind>;
        if (((g * H * kBytes) & 3) == 0)
          _mm_prefetch(static_cast<const char*>(w.s.values) + (tn * w.s.groups + g * H) * kTile * kBytes, _MM_HINT_T1);
        if (Mins && ((g * kBytes) & 3) == 0)
          _mm_prefetch(static_cast<const char*>(w.m.values) + (tn * w.m.groups + g) * kTile * kBytes, _MM_HINT_T1);
      }
    }
#pragma GCC unroll 2
    for (int hg = 0; hg < H; ++hg) {
      __m512i dot[R][T], dot_lo[R][T];
      for (int r = 0; r < R; ++r) {
        const __m512i s0 = _mm512_set1_epi32(start[(r * groups + g) * H + hg]);
        for (int t = 0; t < T; ++t) {
          dot[r][t] = Fine ? _mm512_setzero_si512() : s0;
          dot_lo[r][t] = s0;
        }
      }
#pragma GCC unroll 8
      for (int jj = 0; jj < 8 / H; ++jj) {
        const int e = (8 / H) * hg + jj;
        __m512i xs[R];
        for (int r = 0; r < R; ++r) xs[r] = broadcast4_512(xq + r * k + g * kGroup + 4 * e);
        for (int t = 0; t < T; ++t) {
          const __m512i u = codes_512<Bits>(w, t0 + t, g, e);
          for (int r = 0; r < R; ++r) {
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], u, xs[r]);
            if constexpr (Fine)
              dot_lo[r][t] = _mm512_dpbusd_epi32(dot_lo[r][t], u, broadcast4_512(xlo + r * k + g * kGroup + 4 * e));
          }
        }
      }
      if constexpr (Fine)
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < T; ++t) dot[r][t] = fine_dot_512(dot[r][t], dot_lo[r][t]);
      for (int t = 0; t < T; ++t) {
        const __m512 s = scales_16<Kind>(w.s, t0 + t, g * H + hg);
        for (int r = 0; r < R; ++r) {
          const __m512 dot_f = _mm512_cvtepi32_ps(dot[r][t]);
          acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(dx[r * groups + g])), dot_f, acc[r][t]);
        }
      }
    }
    if constexpr (Mins) {
      for (int t = 0; t < T; ++t) {
        const __m512 m = scales_16<Kind>(w.m, t0 + t, g);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(ux[r * groups + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(res + (r * T + t) * kTile, acc[r][t]);
}

// Many rows (prefill without AMX): as the AVX2 path, a tile's codes unpacked once (codes_512's
// vectors, [groups, 8 lines, 64 bytes]) and its scales and mins as floats, then R rows at a time
// read them with plain loads, x's four bytes broadcast inside the dot product: the vector units do
// the dot products and the fp32 steps, no unpacking per row block (the codes' unpacking and the
// scales' conversion were ~30% of the vector work at 4 rows x 2 tiles). Rows in passes whose x
// stays in L2, as the AMX path does. Same integer sums, the same fp32 steps in the same order: the
// same bits.
// From 16 rows: Qwen2.5-Coder-1.5B's layer 0, 2 threads, at 16 / 32 rows, gate/up 1.49 -> 1.44 /
// 2.94 -> 2.55 ms, down (Q6_K) 1.17 -> 1.00 / 2.31 -> 1.61 ms against the 8-row blocks above
constexpr int64_t kKqAvx512TileMinRows = 16;

template <int Bits, int H, bool Mins, int Kind>
ARGOSY_KQ_AVX512 void kq_avx512_unpack(const PackedW& w, int64_t t, uint8_t* codes, float* scales, float* mins) {
  for (int64_t g = 0; g < w.groups; ++g) {
    for (int e = 0; e < 8; ++e) _mm512_store_si512(codes + (g * 8 + e) * 64, codes_512<Bits>(w, t, g, e));
    for (int hg = 0; hg < H; ++hg) _mm512_store_ps(scales + (g * H + hg) * kTile, scales_16<Kind>(w.s, t, g * H + hg));
    if constexpr (Mins) _mm512_store_ps(mins + g * kTile, scales_16<Kind>(w.m, t, g));
  }
}

// A zero by the zeroing idiom (eliminated at rename: no port) in a register of its own. Left to
// itself the compiler keeps one zero register and copies it to each accumulator a weight group, a
// copy taking a slot of the ports the dot products run on (Q4_K, 1,000 rows x 1,536 -> 2,048, one
// thread: 44-46 -> 46-49% of vpdpbusd's peak). (The codes with a bias start from a broadcast of
// their start, copied per tile: broadcasting from memory per tile instead was slower, Q6_K 35 ->
// 32%.)
ARGOSY_KQ_AVX512 inline __m512i fresh_zero_512() {
  __m512i z;
  asm volatile("vpxord %0, %0, %0" : "=v"(z));
  return z;
}

// The next tile block's packed bytes (codes, high bits, scales, minimums) read ahead into L2 while
// this block's rows are computed. The tile paths read a block's packed bytes only when they unpack
// it, all at once, so at a few dozen rows (a batched decode step) the memory read and the
// arithmetic took turns: 32 rows through the 1.5B's gate/up ran at 2.82 ms a call with the weights
// coming from memory and 2.50 ms from cache. The lines are spread over the rows' blocks and, in
// each, over its weight groups, a few at a time, rather than asked for at once.
struct TileReadAhead {
  static constexpr int kMaxSpans = 12;
  const char* at[kMaxSpans] = {};
  int64_t lines[kMaxSpans] = {};
  int spans = 0;
  int64_t total = 0;  // lines

  void add(const void* p, int64_t bytes) {
    if (bytes <= 0 || spans == kMaxSpans) return;
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
    const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
    at[spans] = reinterpret_cast<const char*>(first);
    lines[spans] = static_cast<int64_t>((end - first + 63) / 64);
    total += lines[spans++];
  }

  template <int Bits, bool Mins, int Kind>
  void add_tile(const PackedW& w, int64_t t) {
    add(w.nib + t * w.groups * 256, w.groups * 256);
    if constexpr (Bits > 4) add(w.high + t * w.groups * (Bits - 4) * 64, w.groups * (Bits - 4) * 64);
    add_scales<Kind>(w.s, t);
    if constexpr (Mins) add_scales<Kind>(w.m, t);
  }

  template <int Kind>
  void add_scales(const ScaleRef& s, int64_t t) {
    constexpr int64_t size = kScaleBytes<Kind>;
    add(static_cast<const char*>(s.values) + t * s.groups * kTile * size, s.groups * kTile * size);
    if constexpr (Kind != kHalfScales) add(s.d + t * s.supers * kTile, s.supers * kTile * 2);
  }
};

// lines [from, to) of a TileReadAhead, `issue`d a few at a time; an empty one issues nothing
struct ReadAheadCursor {
  const TileReadAhead* r = nullptr;
  int span = 0;
  int64_t line = 0, left = 0, per_step = 0;

  ReadAheadCursor() = default;
  ReadAheadCursor(const TileReadAhead& ahead, int64_t from, int64_t to, int64_t steps)
      : r(&ahead), left(std::max<int64_t>(0, to - from)), per_step((left + steps - 1) / std::max<int64_t>(1, steps)) {
    while (span < ahead.spans && from >= ahead.lines[span]) from -= ahead.lines[span++];
    line = from;
  }

  // the share of rows [r0, r1) of a pass over rows [first, last): its lines in proportion
  static ReadAheadCursor rows_share(const TileReadAhead& ahead, int64_t r0, int64_t r1, int64_t first, int64_t last,
                                    int64_t steps) {
    return {ahead, ahead.total * (r0 - first) / (last - first), ahead.total * (r1 - first) / (last - first), steps};
  }

  inline void issue() {
    for (int64_t n = std::min(per_step, left); n > 0; --n) {
      _mm_prefetch(r->at[span] + line * 64, _MM_HINT_T1);
      --left;
      if (++line == r->lines[span]) ++span, line = 0;
    }
  }
};

// R rows x T consecutive tiles (each tile's unpacked codes, scales and mins `bytes` apart): x's
// four bytes a row broadcast once for the T tiles' dot products
template <int R, int T, int Bits, int H, bool Mins, int Kind, bool Fine, bool ZeroStart>
ARGOSY_KQ_AVX512 void kq_avx512_tile(const uint8_t* codes, int64_t bytes, const int8_t* xq, const int8_t* xlo,
                                     int64_t k, const float* dx, const float* ux, const int32_t* start,
                                     int64_t groups, float* res, ReadAheadCursor& ahead) {
  const float* scales = reinterpret_cast<const float*>(codes + groups * 512);
  const float* mins = scales + groups * H * kTile;
  const int64_t fbytes = bytes / 4;  // the same distance in floats
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* cg = codes + g * 512;
    ahead.issue();
#pragma GCC unroll 2
    for (int hg = 0; hg < H; ++hg) {
      __m512i dot[R][T], dot_lo[R][T];
      for (int r = 0; r < R; ++r) {
        if constexpr (ZeroStart && !Fine) {
          for (int t = 0; t < T; ++t) dot[r][t] = fresh_zero_512();
          continue;
        }
        const __m512i s0 = _mm512_set1_epi32(start[(r * groups + g) * H + hg]);
        for (int t = 0; t < T; ++t) {
          dot[r][t] = Fine ? _mm512_setzero_si512() : s0;
          if constexpr (Fine) dot_lo[r][t] = s0;
        }
      }
#pragma GCC unroll 8
      for (int jj = 0; jj < 8 / H; ++jj) {
        const int e = (8 / H) * hg + jj;
        __m512i u[T];
        for (int t = 0; t < T; ++t) u[t] = _mm512_load_si512(cg + t * bytes + e * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i xs = broadcast4_512(xq + r * k + g * kGroup + 4 * e);
          for (int t = 0; t < T; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], u[t], xs);
          if constexpr (Fine) {
            const __m512i xl = broadcast4_512(xlo + r * k + g * kGroup + 4 * e);
            for (int t = 0; t < T; ++t) dot_lo[r][t] = _mm512_dpbusd_epi32(dot_lo[r][t], u[t], xl);
          }
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m512 s = _mm512_load_ps(scales + t * fbytes + (g * H + hg) * kTile);
        for (int r = 0; r < R; ++r) {
          const __m512i d = Fine ? fine_dot_512(dot[r][t], dot_lo[r][t]) : dot[r][t];
          acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(dx[r * groups + g])), _mm512_cvtepi32_ps(d),
                                      acc[r][t]);
        }
      }
    }
    if constexpr (Mins) {
      for (int t = 0; t < T; ++t) {
        const __m512 m = _mm512_load_ps(mins + t * fbytes + g * kTile);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(ux[r * groups + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(res + (r * T + t) * kTile, acc[r][t]);
}

// the swiglu form's outputs: SwiGLU of a gate value and the up value computed beside it (the
// statement of argosy_iq::swiglu, iq_swiglu.h: the bits swiglu gives on the two outputs), by
// non-temporal stores where the output allows (the caller then calls _mm_sfence). R rows of a
// gate tile and its up tile side by side in res ([R, 2, 16]), 16 outputs at column col
ARGOSY_KQ_AVX512 void put_swiglu_rows(const Output& o, int64_t r0, int R, int64_t col, const float* res) {
  const bool stream = o.streamable();
  for (int r = 0; r < R; ++r) {
    const __m512 v = swiglu512(_mm512_load_ps(res + 32 * r), _mm512_load_ps(res + 32 * r + 16));
    float* to = o.f + (r0 + r) * o.ld + col;
    if (stream)
      _mm512_stream_ps(to, v);
    else
      _mm512_storeu_ps(to, v);
  }
}

// -- AMX-INT8: steps of many rows -------------------------------------------------------------
//
// A tile's codes are unpacked once into B tiles as signed codes q = u - bias (line e of group g
// is B row e: lane 4i + b holds k = 4e + b of output i, the layout a tile dot product reads), then
// per 16 rows and weight group one tile dot product (x signed, q signed: the integer q . xq, which
// the other paths reach as u . xq + start), then the same fp32 steps as the paths above: the
// same bits. Software-pipelined: the tile products of the next weight group are issued (into the
// other of two buffers and C tiles) before this group's fp32 steps, so the tile unit and the
// vector units work at once; each tile's scales are read once; x's codes sit in tile order and its
// scales per 16 rows so a row's is a fixed offset. One thread, 512 rows, the same bits as before:
// Q4_K 8960 x 1536 40.7 -> 25.7 ms, its fine form 66.8 -> 41.9, Q6_K 1536 x 8960 64.4 -> 41.4.

// the bytes of x's codes a pass over the tiles takes (see kq_run_form), and the fewest rows a pass
// (a tile's codes are unpacked once a pass: 280 KB of them a tile of Qwen2.5-1.5B's down projection)
constexpr int64_t kKqAmxPassBytes = int64_t{1} << 20;
constexpr int64_t kKqAmxPassMinRows = 128;
constexpr int64_t kKqAmxMinRows = 12;  // fewer rows: the VNNI path is faster (Q4_K at 8 rows 0.59 vs 0.71 ms)

// C: 16 rows x 16 int32; A: 16 rows x one weight group of x (32 / H bytes); B: its 8 / H lines
// (the fine form: A 3 its lo bytes, C 4 their sums)
template <int H, bool Fine>
ARGOSY_AMX inline void kq_amx_configure() {
  AmxConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 64;
  cfg.rows[1] = 16, cfg.colsb[1] = 32 / H;
  cfg.rows[2] = 8 / H, cfg.colsb[2] = 64;
  cfg.rows[3] = 16, cfg.colsb[3] = 32 / H;
  cfg.rows[4] = 16, cfg.colsb[4] = 64;
  // odd steps: C 5 (A 6, B 7; the fine form: C 5 and 6, A and B shared), so a step's products
  // need not wait for the last step's stores
  cfg.rows[5] = 16, cfg.colsb[5] = 64;
  cfg.rows[6] = 16, cfg.colsb[6] = Fine ? 64 : 32 / H;
  if constexpr (!Fine) cfg.rows[7] = 8 / H, cfg.colsb[7] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see ldtilecfg read it
  _tile_loadconfig(&cfg);
}

// step i's tile products (weight group i / H, its part i % H) for the 16 rows at x offset `at`
// (the tile intrinsics take literal registers: one body a register set)
#define ARGOSY_KQ_AMX_ISSUE(C, A, B, C_LO)                  \
  if constexpr (Part != 2) {                                \
    _tile_zero(C);                                          \
    _tile_loadd(A, xp + x_at, kGroup);                      \
    _tile_loadd(B, b + g * 512 + hg * (8 / H) * 64, 64);    \
    _tile_dpbssd(C, A, B);                                  \
    if constexpr (Fine) { /* both products before a store */ \
      _tile_zero(C_LO);                                     \
      _tile_loadd(3, xlp + x_at, kGroup);                   \
      _tile_dpbssd(C_LO, 3, B);                             \
    }                                                       \
  }                                                         \
  if constexpr (Part != 1) {                                \
    _tile_stored(C, dots, 64);                              \
    if constexpr (Fine) _tile_stored(C_LO, dots_lo, 64);    \
  }

// Part 0: the products and their store; 1: the products only; 2: the store only. The loop issues
// step i + 1's products, then step i's fp32 steps, then step i + 1's store: a tile store holds
// back the loads after it until it is done, so a store issued before the fp32 steps kept them
// waiting for the products (probes, one thread, 512 rows of the 1.5B's gate/up: the fp32 steps
// alone 34.7 ms, the tile work alone 23.2, both 48.4: they hardly overlapped). A/B, one thread,
// 1,000 rows, four runs: the Q4_K and Q6_K down projections 94-97.5 -> 89-92 ms; gate/up within
// the noise (118-137 ms either way). A store issued before the fp32 steps of the step before it
// (a third C tile) was slower: 78 ms against 57.
template <int Part, int H, bool Fine, bool Odd>
ARGOSY_AMX inline void kq_amx_issue(const int8_t* xp, const int8_t* xlp, const uint8_t* b, int64_t at, int64_t k,
                                    int64_t i, int32_t* dots, int32_t* dots_lo) {
  const int64_t g = i / H, hg = i % H, x_at = at + g * 16 * kGroup + hg * (kGroup / H);
  if constexpr (!Odd) {
    ARGOSY_KQ_AMX_ISSUE(0, 1, 2, 4)
  } else if constexpr (Fine) {
    ARGOSY_KQ_AMX_ISSUE(5, 1, 2, 6)
  } else {
    ARGOSY_KQ_AMX_ISSUE(5, 6, 7, 4)
  }
}
#undef ARGOSY_KQ_AMX_ISSUE

template <int Part, int H, bool Fine>
ARGOSY_AMX inline void kq_amx_issue(const int8_t* xp, const int8_t* xlp, const uint8_t* b, int64_t at, int64_t k,
                                    int64_t i, int32_t (*dots)[256], int32_t (*dots_lo)[256]) {
  if (i & 1)
    kq_amx_issue<Part, H, Fine, true>(xp, xlp, b, at, k, i, dots[1], dots_lo[1]);
  else
    kq_amx_issue<Part, H, Fine, false>(xp, xlp, b, at, k, i, dots[0], dots_lo[0]);
}

// the AMX kernel's 16-row block in the swiglu form: the gate tile's rows in gate ([16, 16]), the
// up tile's in acc, nr of them real
ARGOSY_AMX inline void put_swiglu_tile_rows(const Output& out, int64_t r0, int64_t nr, int64_t col, const float* gate,
                                            const __m512* acc) {
  const bool stream = out.streamable();
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    if (r >= nr) break;
    const __m512 v = swiglu512(_mm512_load_ps(gate + 16 * r), acc[r]);
    float* to = out.f + (r0 + r) * out.ld + col;
    if (stream)
      _mm512_stream_ps(to, v);
    else
      _mm512_storeu_ps(to, v);
  }
}

// tiles [t0, t1) x every row; xp: x's codes padded to a multiple of 16 rows (xlp: the fine
// form's lo bytes so); dxt, uxt: x's scales and sums per 16-row block, weight group and row
// ([rows / 16, groups, 16], zero past the last row: padded rows add exact zeros). The swiglu
// form (half: the gate's tiles, else 0): tile t is the gate's, t + half the up's, and a 16-row
// block's SwiGLU of the two is stored at tile t's place
template <int Bits, int H, bool Mins, int Kind, bool Fine>
ARGOSY_AMX void kq_amx(const int8_t* xp, const int8_t* xlp, const float* dxt, const float* uxt, int64_t row0,
                       int64_t rows, const PackedW& w, int64_t t0, int64_t t1, const Output& out, int64_t half,
                       bool read_ahead) {
  const int64_t groups = w.groups, k = groups * kGroup, steps = groups * H;
  const int parts = half > 0 ? 2 : 1;
  // a tile's signed codes, then its scales per step and its mins per group as 16 floats each
  const int64_t part_bytes = groups * 512 + (steps + groups) * 64;
  std::vector<uint8_t> storage(static_cast<size_t>(parts * part_bytes + 64));
  uint8_t* const first = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t dots[2][16 * 16];
  alignas(64) int32_t dots_lo[2][16 * 16];
  alignas(64) float res[16 * 16];
  alignas(64) float gate[16 * 16];
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(w.bias));
  kq_amx_configure<H, Fine>();
  for (int64_t t = t0; t < t1; ++t) {
    for (int part = 0; part < parts; ++part) {
      const int64_t tile = t + part * half;
      uint8_t* b = first + part * part_bytes;
      float* scales = reinterpret_cast<float*>(b + groups * 512);
      float* mins = scales + steps * kTile;
      for (int64_t g = 0; g < groups; ++g) {
        for (int e = 0; e < 8; ++e)
          _mm512_store_si512(b + g * 512 + e * 64, _mm512_sub_epi8(codes_512<Bits>(w, tile, g, e), bias));
        if constexpr (Mins) _mm512_store_ps(mins + g * kTile, scales_16<Kind>(w.m, tile, g));
      }
      for (int64_t i = 0; i < steps; ++i) _mm512_store_ps(scales + i * kTile, scales_16<Kind>(w.s, tile, i));
    }
    ARGOSY_MEMORY_BARRIER();
    TileReadAhead next;  // the next tile (and its up tile) read ahead over the row blocks
    if (read_ahead && t + 1 < t1) {
      next.add_tile<Bits, Mins, Kind>(w, t + 1);
      if (parts == 2) next.add_tile<Bits, Mins, Kind>(w, t + 1 + half);
    }
    for (int64_t r0 = row0; r0 < rows; r0 += 16) {
      const int64_t nr = std::min<int64_t>(16, rows - r0);
      ReadAheadCursor ahead = ReadAheadCursor::rows_share(next, r0, std::min(rows, r0 + 16), row0, rows, steps * parts);
      const float* dx_block = dxt + r0 * groups;
      const float* ux_block = uxt + r0 * groups;
      __m512 acc[16];
      for (int part = 0; part < parts; ++part) {
        const uint8_t* b = first + part * part_bytes;
        const float* scales = reinterpret_cast<const float*>(b + groups * 512);
        const float* mins = scales + steps * kTile;
        if (part == 1) {  // the gate tile's rows, done
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) _mm512_store_ps(gate + 16 * r, acc[r]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        kq_amx_issue<0, H, Fine>(xp, xlp, b, r0 * k, k, 0, dots, dots_lo);
        for (int64_t i = 0; i < steps; ++i) {
          ahead.issue();
          if (i + 1 < steps) kq_amx_issue<1, H, Fine>(xp, xlp, b, r0 * k, k, i + 1, dots, dots_lo);
          ARGOSY_MEMORY_BARRIER();
          const int64_t g = i / H;
          const float* dx = dx_block + g * kTile;
          const int32_t* d = dots[i & 1];
          const int32_t* d_lo = dots_lo[i & 1];
          const __m512 s = _mm512_load_ps(scales + i * kTile);
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            __m512i dot = _mm512_load_si512(d + 16 * r);
            if constexpr (Fine)
              dot = _mm512_add_epi32(_mm512_slli_epi32(dot, kFineShift), _mm512_load_si512(d_lo + 16 * r));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(dx[r])), _mm512_cvtepi32_ps(dot), acc[r]);
          }
          if constexpr (Mins) {
            if (i % H == H - 1) {
              const __m512 m = _mm512_load_ps(mins + g * kTile);
              const float* ux = ux_block + g * kTile;
#pragma GCC unroll 16
              for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ux[r]), acc[r]);
            }
          }
          ARGOSY_MEMORY_BARRIER();
          if (i + 1 < steps) kq_amx_issue<2, H, Fine>(xp, xlp, b, r0 * k, k, i + 1, dots, dots_lo);
        }
      }
      if (parts == 2)
        put_swiglu_tile_rows(out, r0, nr, t * kTile, gate, acc);
      else
        put_tile_rows(out, r0, nr, t * kTile, acc, res);
    }
  }
  _mm_sfence();  // the streamed stores are weakly ordered: done before the threads join
  _tile_release();
}

// -- driving ----------------------------------------------------------------------------------

// the kernels that store a tile's rows at once, which take kq_linear's swiglu form: AMX from
// kKqAmxMinRows rows, AVX-512 VNNI's tiles from kKqAvx512TileMinRows (kq_run_form's choice)
inline bool kq_stores_tile_rows(int64_t path, int64_t rows) {
  return path == kAmx ? rows >= kKqAmxMinRows : path == kAvx512 && rows >= kKqAvx512TileMinRows;
}

template <int Bits, int H, bool Mins, int Kind, bool Fine>
void kq_run_form(const LinearCall& call, int64_t tiles, const PackedW& w) {
  const int64_t rows = call.rows, path = call.path, groups = w.groups, k = groups * kGroup;
  const QuantizedRows& xr = call.xr;
  const Output& o = call.o;
  TORCH_CHECK(!call.swiglu || kq_stores_tile_rows(path, rows), "kq_linear: the swiglu form on a path without it");
  if (path == kScalar) {
    for_tile_blocks(tiles, 1, [&](int64_t t0, int64_t t1) { kq_scalar<Bits, H, Mins, Kind>(xr, rows, w, t0, t1, o); });
    return;
  }
  if (path == kAmx && rows >= kKqAmxMinRows) {
    const int64_t padded_rows = (rows + 15) / 16 * 16;
    // x's codes in tile order: [rows / 16, groups, 16 rows, 32 codes] (an A tile's rows in 8 whole
    // cache lines, not 16 halves), and its scales and sums [rows / 16, groups, 16]; zero past the
    // last row
    const size_t codes = static_cast<size_t>(padded_rows * k), scales = static_cast<size_t>(padded_rows * groups);
    std::unique_ptr<int8_t[]> xp(new int8_t[codes]), xlp(Fine ? new int8_t[codes] : nullptr);
    std::unique_ptr<float[]> dxt(new float[scales]), uxt(new float[scales]);
    at::parallel_for(0, padded_rows / 16, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t r = b0 * 16; r < b1 * 16; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const size_t at = static_cast<size_t>((r / 16 * groups + g) * 16 + r % 16);
          const size_t from = static_cast<size_t>(r * k + g * kGroup), from_g = static_cast<size_t>(r * groups + g);
          const bool real = r < rows;
          if (real) std::memcpy(xp.get() + at * kGroup, xr.q.data() + from, kGroup);
          else std::memset(xp.get() + at * kGroup, 0, kGroup);
          if constexpr (Fine) {
            if (real) std::memcpy(xlp.get() + at * kGroup, xr.lo.data() + from, kGroup);
            else std::memset(xlp.get() + at * kGroup, 0, kGroup);
          }
          dxt[at] = real ? xr.dx[from_g] : 0.0f;
          uxt[at] = real && Mins ? xr.ux[from_g] : 0.0f;
        }
    });
    // rows a pass over the tiles: x's codes of a pass stay in L2 (a tile's codes are unpacked once
    // a pass). At 1,000 rows x came from L3 for every tile: Qwen2.5-Coder-1.5B's prefill ran at
    // 227 tok/s in 1,024-token chunks and 300 in 256-token ones.
    const int64_t x_bytes = k * (Fine ? 2 : 1);
    const int64_t pass = std::max<int64_t>(kKqAmxPassMinRows, kKqAmxPassBytes / x_bytes / 16 * 16);
    const int64_t half = call.swiglu ? tiles / 2 : 0, blocks = call.swiglu ? half : tiles;
    const int64_t grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
    for (int64_t p0 = 0; p0 < rows; p0 += pass) {
      const int64_t p1 = std::min(rows, p0 + pass);
      at::parallel_for(0, blocks, grain, [&](int64_t t0, int64_t t1) {
        kq_amx<Bits, H, Mins, Kind, Fine>(xp.get(), xlp.get(), dxt.get(), uxt.get(), p0, p1, w, t0, t1, o, half,
                                          p0 == 0 && p1 == rows);
      });
    }
    return;
  }
  // per row and weight group: -bias times the sum of xq over it (u . xq + start = q . xq)
  // (one weight group to a group of x: the quantization's sum of the group's codes)
  const Written<int32_t> start = code_starts(xr, rows, groups, H, w.bias, path >= kAvx512);
  if (path == kAvx2 && rows >= kKqAvx2TileMinRows) {
    for_tile_blocks(tiles, 1, [&](int64_t t0, int64_t t1) {
      // a tile's codes (512 bytes a weight group), then its scales and mins as floats
      const size_t bytes = static_cast<size_t>(groups * (512 + (H + 1) * kTile * 4));
      std::unique_ptr<uint8_t[], void (*)(void*)> buffer(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)), std::free);
      uint8_t* codes = buffer.get();
      float* scales = reinterpret_cast<float*>(codes + groups * 512);
      float* mins = scales + groups * H * kTile;
      float res[kRowBlock * kTile];
      for (int64_t t = t0; t < t1; ++t) {
        kq_avx2_unpack<Bits, H, Mins, Kind>(w, t, codes, scales, mins);
        constexpr int RB = kq_avx2_tile_rows<Bits, H, Fine>();
        auto block = [&](int64_t r0, auto rows_constant) {
          constexpr int R = decltype(rows_constant)::value;
          kq_avx2_tile<R, Bits, H, Mins, Kind, Fine>(codes, scales, mins, xr.q.data() + r0 * k,
                                                     Fine ? xr.lo.data() + r0 * k : nullptr, k, xr.dx.data() + r0 * groups,
                                                     xr.ux.data() + r0 * groups, start.data() + r0 * groups * H, groups,
                                                     res);
          for (int r = 0; r < R; ++r) o.put(r0 + r, t * kTile, res + r * kTile, kTile);
        };
        int64_t r0 = 0;
        for (; r0 + RB <= rows; r0 += RB) block(r0, std::integral_constant<int, RB>{});
        if (RB == 3 && r0 + 2 <= rows) block(r0, std::integral_constant<int, 2>{}), r0 += 2;
        for (; r0 < rows; ++r0) block(r0, std::integral_constant<int, 1>{});
      }
    });
    return;
  }
  if (path >= kAvx512 && rows >= kKqAvx512TileMinRows) {
    // rows a pass: their x (both planes of the fine form) within ~1 MB of L2
    const int64_t pass = std::max<int64_t>(kKqAmxPassMinRows, kKqAmxPassBytes / (k * (Fine ? 2 : 1)));
    // the swiglu form: the gate's tile t and the up's tile t + half together
    const int64_t half = call.swiglu ? tiles / 2 : 0;
    for (int64_t p0 = 0; p0 < rows; p0 += pass) {
      const int64_t p1 = std::min(rows, p0 + pass);
      const int64_t per_block = call.swiglu || tiles % 2 != 0 ? 1 : 2;
      for_tile_blocks(call.swiglu ? half : tiles, per_block, [&](int64_t t0, int64_t t1) {
        const int64_t count = call.swiglu ? 2 : t1 - t0;  // tiles in the buffer
        // each tile's codes (512 bytes a weight group), then its scales and mins as floats
        const int64_t bytes = groups * (512 + (H + 1) * kTile * 4);
        std::unique_ptr<uint8_t[], void (*)(void*)> buffer(
            static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(bytes * count))), std::free);
        uint8_t* codes = buffer.get();
        for (int64_t j = 0; j < count; ++j) {
          uint8_t* at = codes + j * bytes;
          float* scales = reinterpret_cast<float*>(at + groups * 512);
          kq_avx512_unpack<Bits, H, Mins, Kind>(w, call.swiglu ? t0 + j * half : t0 + j, at, scales,
                                                scales + groups * H * kTile);
        }
        constexpr int RB = Fine ? 4 : 6;
        alignas(64) float res[RB * 2 * kTile];
        const int64_t width = count * kTile;
        // the next block's tiles read ahead (in one pass over the rows: a few dozen, where the
        // read is not small beside the arithmetic), its lines shared out over the row blocks
        TileReadAhead next;
        if (p0 == 0 && p1 == rows) {
          if (call.swiglu) {
            if (t0 + 1 < half) next.add_tile<Bits, Mins, Kind>(w, t0 + 1), next.add_tile<Bits, Mins, Kind>(w, t0 + 1 + half);
          } else {
            for (int64_t t = t1; t < std::min(tiles, t1 + (t1 - t0)); ++t) next.add_tile<Bits, Mins, Kind>(w, t);
          }
        }
        auto block = [&](int64_t r0, auto rows_constant) {
          constexpr int R = decltype(rows_constant)::value;
          const RowsAt xb = rows_at(xr, r0, k, groups);
          const int32_t* st = start.data() + r0 * groups * H;
          ReadAheadCursor ahead = ReadAheadCursor::rows_share(next, r0, r0 + R, p0, p1, groups);
          auto tile = [&](auto zero_start) {
            constexpr bool Z = decltype(zero_start)::value;
            if (count == 2)
              kq_avx512_tile<R, 2, Bits, H, Mins, Kind, Fine, Z>(codes, bytes, xb.q, xb.lo, k, xb.dx, xb.ux, st, groups,
                                                                 res, ahead);
            else
              kq_avx512_tile<R, 1, Bits, H, Mins, Kind, Fine, Z>(codes, bytes, xb.q, xb.lo, k, xb.dx, xb.ux, st, groups,
                                                                 res, ahead);
          };
          if (w.bias == 0)
            tile(std::true_type{});
          else
            tile(std::false_type{});
          if (call.swiglu)
            put_swiglu_rows(o, r0, R, t0 * kTile, res);
          else
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
    float res[kWideRowBlock * 2 * kTile];
    const int64_t width = (t1 - t0) * kTile;
    int64_t done = 0;
    if (path >= kAvx512 && rows <= kWideMaxRows) {  // a decode step's few rows: eight a tile
      for (; done + kWideRowBlock <= rows; done += kWideRowBlock) {
        for (int64_t t = t0; t < t1; ++t) {
          kq_avx512_block<kWideRowBlock, 1, Bits, H, Mins, Kind, Fine>(
              xr.q.data() + done * k, Fine ? xr.lo.data() + done * k : nullptr, k, xr.dx.data() + done * groups,
              xr.ux.data() + done * groups,
              start.data() + done * groups * H, w, t, res, done == 0 && t + 1 < tiles);
          for (int r = 0; r < kWideRowBlock; ++r) o.put(done + r, t * kTile, res + r * kTile, kTile);
        }
      }
    }
    for_row_blocks(rows - done, [&](int64_t r_rest, auto rows_constant) {
      constexpr int R = decltype(rows_constant)::value;
      const int64_t r0 = done + r_rest;
      const RowsAt xb = rows_at(xr, r0, k, groups);
      const int32_t* st = start.data() + r0 * groups * H;
      if (path >= kAvx512) {
        const bool prefetch = r0 == 0 && t1 + (t1 - t0) <= tiles;
        if (t1 - t0 == 2)
          kq_avx512_block<R, 2, Bits, H, Mins, Kind, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, st, w, t0, res, prefetch);
        else
          kq_avx512_block<R, 1, Bits, H, Mins, Kind, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, st, w, t0, res, prefetch);
      } else {
        if constexpr (R == 4) {  // two rows at a time: their sums stay in registers
          kq_avx2_rows<2, Bits, H, Mins, Kind, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, st, w, t0, res);
          kq_avx2_rows<2, Bits, H, Mins, Kind, Fine>(xb.q + 2 * k, Fine ? xb.lo + 2 * k : nullptr, k, xb.dx + 2 * groups,
                                                     xb.ux + 2 * groups, st + 2 * groups * H, w, t0, res + 2 * kTile);
        } else {
          kq_avx2_rows<R, Bits, H, Mins, Kind, Fine>(xb.q, xb.lo, k, xb.dx, xb.ux, st, w, t0, res);
        }
      }
      for (int r = 0; r < R; ++r) o.put(r0 + r, t0 * kTile, res + r * width, width);
    });
  });
}

template <int Bits, int H, bool Mins, int Kind>
void kq_run(const LinearCall& call, int64_t tiles, const PackedW& w) {
  if (call.xr.fine())
    kq_run_form<Bits, H, Mins, Kind, true>(call, tiles, w);
  else
    kq_run_form<Bits, H, Mins, Kind, false>(call, tiles, w);
}

ScaleRef scale_ref(const at::Tensor& values, const std::optional<at::Tensor>& d, int64_t tiles, int64_t k,
                   const char* what) {
  TORCH_CHECK(values.dim() == 3 && values.is_contiguous() && values.size(0) == tiles && values.size(2) == kTile,
              "kq_linear: ", what, " must be contiguous [N/16, K/G, 16]");
  ScaleRef s;
  s.values = values.data_ptr();
  s.groups = values.size(1);
  const bool super = d.has_value() && d->defined();
  if (!super) {
    TORCH_CHECK(values.scalar_type() == at::kHalf, "kq_linear: ", what, " without a super scale must be float16");
    return s;
  }
  TORCH_CHECK(values.scalar_type() == at::kByte || values.scalar_type() == at::kChar,
              "kq_linear: ", what, " with a super scale must be uint8 or int8");
  TORCH_CHECK(k % 256 == 0 && d->scalar_type() == at::kHalf && d->is_contiguous() && d->dim() == 3 &&
                  d->size(0) == tiles && d->size(1) == k / 256 && d->size(2) == kTile,
              "kq_linear: ", what, "' super scales must be contiguous float16 [N/16, K/256, 16]");
  s.d = reinterpret_cast<const uint16_t*>(d->data_ptr<at::Half>());
  s.supers = k / 256;
  const int64_t per_super = s.groups / s.supers;
  TORCH_CHECK(per_super == 8 || per_super == 16, "kq_linear: ", what, " must be per 32 or per 16 weights");
  s.super_shift = per_super == 8 ? 3 : 4;
  return s;
}

at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& nib, const std::optional<at::Tensor>& high,
                     const at::Tensor& scales, const std::optional<at::Tensor>& scale_d,
                     const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& min_d, int64_t bits,
                     int64_t bias, int64_t out_features, bool out_float32, bool fine, bool swiglu,
                     const std::optional<at::Tensor>& add) {
  TORCH_CHECK(nib.scalar_type() == at::kByte && nib.dim() == 5 && nib.size(2) == 4 && nib.size(3) == 16 &&
                  nib.size(4) == 4 && nib.is_contiguous(),
              "kq_linear: nib must be contiguous uint8 [N/16, K/32, 4, 16, 4]");
  const int64_t tiles = nib.size(0), groups = nib.size(1), k = groups * kGroup;
  TORCH_CHECK(tiles * kTile == out_features, "kq_linear: codes hold ", tiles * kTile, " outputs, not ", out_features);
  TORCH_CHECK(bits >= 4 && bits <= 6, "kq_linear: bits must be 4, 5 or 6");
  TORCH_CHECK(0 <= bias && bias < (int64_t{1} << bits), "kq_linear: bias must be within [0, 2^bits)");
  const bool has_high = high.has_value() && high->defined();
  TORCH_CHECK(has_high == (bits > 4), "kq_linear: high bits are given exactly when bits > 4");
  if (has_high)
    TORCH_CHECK(high->scalar_type() == at::kByte && high->is_contiguous() && high->dim() == 3 &&
                    high->size(0) == tiles && high->size(1) == groups && high->size(2) == (bits - 4) * 64,
                "kq_linear: high must be contiguous uint8 [N/16, K/32, (bits - 4) * 64]");
  PackedW w{nib.data_ptr<uint8_t>(), has_high ? high->data_ptr<uint8_t>() : nullptr, groups, {}, {},
            static_cast<int32_t>(bias)};
  w.s = scale_ref(scales, scale_d, tiles, k, "scales");
  TORCH_CHECK(w.s.groups == groups || w.s.groups == 2 * groups, "kq_linear: scales must be per 32 or per 16 weights");
  const int64_t h = w.s.groups / groups;
  const bool has_mins = mins.has_value() && mins->defined();
  if (has_mins) {
    w.m = scale_ref(*mins, min_d, tiles, k, "mins");
    TORCH_CHECK(w.m.groups == groups && (w.m.d == nullptr) == (w.s.d == nullptr) &&
                    mins->scalar_type() == scales.scalar_type(),
                "kq_linear: mins must be per 32 weights, in the scales' form");
    w.m.negate = w.m.d != nullptr;
  }
  const int kind = w.s.d == nullptr ? kHalfScales : scales.scalar_type() == at::kByte ? kSuperU8 : kSuperI8;
  if (swiglu) {
    TORCH_CHECK(out_features % 32 == 0, "kq_linear: the swiglu form needs outputs in a multiple of 32, not ",
                out_features);
    TORCH_CHECK(out_float32 || x.scalar_type() == at::kFloat, "kq_linear: the swiglu form's output is float32");
  }
  const int64_t path = current_path(), rows = x.dim() == 2 ? x.size(0) : 0;
  // the swiglu form in the kernels that store a tile's rows at once (AMX, AVX-512 VNNI's tiles);
  // else the whole output, then argosy_iq::swiglu's work on it: the same bits
  const bool fused = swiglu && kq_stores_tile_rows(path, rows);
  LinearCall call(x, k, groups, fused ? out_features / 2 : out_features, out_float32, "kq_linear", fine);
  call.swiglu = fused;
  const bool has_add = add.has_value() && add->defined();
  if (has_add) {
    TORCH_CHECK(!swiglu && call.o.f != nullptr, "kq_linear: add goes with a float32 output, not the swiglu form");
    TORCH_CHECK(add->scalar_type() == at::kFloat && add->is_contiguous() && add->dim() == 1 &&
                    add->size(0) == out_features,
                "kq_linear: add must be a contiguous float32 [out_features]");
    call.o.add = add->data_ptr<float>();
  }
  if (call.rows == 0) return swiglu ? call.out.narrow(1, 0, out_features / 2).contiguous() : call.out;
  // the forms GGUF's formats take (the codes of any, fewer bits where they fit)
  if (bits == 4 && h == 1 && has_mins && kind == kSuperU8) kq_run<4, 1, true, kSuperU8>(call, tiles, w);  // Q4_K
  else if (bits == 5 && h == 1 && has_mins && kind == kSuperU8) kq_run<5, 1, true, kSuperU8>(call, tiles, w);  // Q5_K
  else if (bits == 6 && h == 2 && !has_mins && kind == kSuperI8) kq_run<6, 2, false, kSuperI8>(call, tiles, w);  // Q6_K
  else if (bits == 5 && h == 1 && !has_mins && kind == kHalfScales) kq_run<5, 1, false, kHalfScales>(call, tiles, w);  // Q5_0
  else if (bits == 5 && h == 1 && has_mins && kind == kHalfScales) kq_run<5, 1, true, kHalfScales>(call, tiles, w);  // Q5_1
  else TORCH_CHECK(false, "kq_linear: no kernel for ", bits, " bits, scales per ", kGroup / h,
                   has_mins ? " with" : " without", " minimums, scale form ", kind);
  if (!swiglu || fused) return call.out;
  at::Tensor out = at::empty({call.rows, out_features / 2}, call.out.options());
  swiglu_rows(call.out.data_ptr<float>(), out.data_ptr<float>(), call.rows, out_features / 2, path);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(argosy_iq, m) {
  m.def(
      "kq_linear(Tensor x, Tensor nib, Tensor? high, Tensor scales, Tensor? scale_d, Tensor? mins, "
      "Tensor? min_d, int bits, int bias, int out_features, bool out_float32, bool fine=False, "
      "bool swiglu=False, Tensor? add=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) { m.impl("kq_linear", &kq_linear); }
