// What the invariant kernels (iq_linear.cpp, iq_attention.cpp) share: the kernel paths and
// the run-time choice between them, fp16 and bf16 conversions, and the fixed 16-value sum tree.
#pragma once

#include <ATen/ATen.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace argosy_iq {

constexpr int64_t kTile = 16;
constexpr int64_t kGroup = 32;

// kAmx: AVX-512 VNNI, and AMX-INT8 tiles for Q4 steps of kAmxMinRows rows or more (integer dot
// products: the same sums, so the same bits)
enum Path : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kAmx = 4 };

inline bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

inline bool has_avx512() {
  static const bool ok = has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), and Linux's permission for the tile state
inline bool has_amx() {
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!has_avx512() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

inline std::atomic<int64_t>& forced_path() {  // set_path's choice, for every op of the library
  static std::atomic<int64_t> path{kAuto};
  return path;
}

inline int64_t best_path() { return has_amx() ? kAmx : has_avx512() ? kAvx512 : has_avx2() ? kAvx2 : kScalar; }

inline int64_t current_path() {
  const int64_t forced = forced_path().load();
  return forced == kAuto ? best_path() : forced;
}

inline const char* path_name(int64_t path) {
  switch (path) {
    case kAmx: return "amx-int8";
    case kAvx512: return "avx512-vnni";
    case kAvx2: return "avx2";
    default: return "scalar";
  }
}

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }  // exact

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round half to even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}


// float_to_bf16 on 16 values at once (the same integer steps)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void bf16_16(const float* values, uint16_t* dst) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(values));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet)));
}

// float_to_bf16 on 8 values with AVX2 (the same integer steps; a signed compare is exact: both
// sides of it are below 2^31)
__attribute__((target("avx2"))) inline void bf16_8(const float* values, uint16_t* dst) {
  const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(values));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i v = _mm256_blendv_epi8(rounded, quiet, nan);  // each 32-bit value below 2^16
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

// 16 bf16 -> fp32 (exact)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// ((a0 + a2) + (a1 + a3)) + ((a4 + a6) + (a5 + a7)) + ... over 16 values: the fixed order of a
// 16-lane sum (iq_attention.cpp's vector paths add their 16 lane vectors in this order)
inline float tree16(const float* a) {
  float s[4];
  for (int q = 0; q < 4; ++q) s[q] = (a[4 * q] + a[4 * q + 2]) + (a[4 * q + 1] + a[4 * q + 3]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace argosy_iq
