// What the invariant linear kernels (iq_linear.cpp: Q4 and int8 codes; iq_packed.cpp: codes
// held in bit planes) share: step 1 of their arithmetic (each row of x quantized per group of 32,
// the same bits on every path), the output's fp32 or bf16 rounding, and the driving (tiles of 16
// outputs split among threads, never k; rows in blocks). See iq_linear.cpp for the contract.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "iq_common.h"

namespace argosy_iq {
namespace {  // each kernel file its own copy (they are small and inline)

// -- 1. the rows, quantized (the same bits on every path) --------------------------------------

// The fine form (a layer whose x rounding costs the most accuracy: the output head): x's code is
// c = round-half-even(x * (127 / a) * 128) in [-16256, 16256], a 15-bit code, held as two bytes
// c = 128 * hi + lo (hi = floor((c + 64) / 128) in [-127, 127], lo in [-64, 63]) so the byte dot
// products serve it: a dot is 128 * (codes . hi) + (codes . lo), exact in int32. dx = a / 127 /
// 128 (exact: a power of two), sq and ux are c's. x's rounding error is 1/128 of the plain form's.
constexpr int kFineShift = 7;
constexpr float kFineScale = 128.0f;
constexpr int32_t kFineMax = 127 * 128;

// a quantization's array, sized without being zeroed first: every element is written before it
// is read (a prefill's x is MB: std::vector's zeroing was a serial pass over it before the
// parallel quantization)
template <typename T>
class Written {
 public:
  void resize(size_t n) { values_.reset(new T[n]), size_ = n; }
  T* data() { return values_.get(); }
  const T* data() const { return values_.get(); }
  T& operator[](size_t i) { return values_[i]; }
  const T& operator[](size_t i) const { return values_[i]; }
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<T[]> values_;
  size_t size_ = 0;
};

struct QuantizedRows {
  Written<int8_t> q;    // [M, K]: the code, or in the fine form hi
  Written<int8_t> lo;   // [M, K]: the fine form's lo; empty in the plain form
  Written<float> dx;    // [M, G]
  Written<float> ux;    // [M, G]
  Written<int32_t> sq;  // [M, G]
  bool fine() const { return !lo.empty(); }
  int32_t code(int64_t i) const {  // x's integer code at [row * K + k]
    return fine() ? (static_cast<int32_t>(q[i]) << kFineShift) + lo[i] : q[i];
  }
};


// x's quantized rows from row r0 on, as a block of rows reads them (lo: nullptr in the plain form)
struct RowsAt {
  const int8_t* q;
  const int8_t* lo;
  const float* dx;
  const float* ux;
  const int32_t* sq;
};

inline RowsAt rows_at(const QuantizedRows& xr, int64_t r0, int64_t k, int64_t groups) {
  return {xr.q.data() + r0 * k, xr.fine() ? xr.lo.data() + r0 * k : nullptr, xr.dx.data() + r0 * groups,
          xr.ux.data() + r0 * groups, xr.sq.data() + r0 * groups};
}

struct GroupQ {  // one group's quantization
  float dx, ux;
  int32_t sq;
};

inline GroupQ quantize_group(const float* v, int8_t* q, int8_t* lo) {  // lo: nullptr, or the fine form
  float amax = 0.0f;
  for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t qsum = 0;
  if (lo != nullptr) {
    for (int i = 0; i < kGroup; ++i) {
      const float scaled = std::nearbyint(v[i] * inv * kFineScale);
      const auto c = static_cast<int32_t>(std::min<float>(kFineMax, std::max<float>(-kFineMax, scaled)));
      const int32_t hi = (c + 64) >> kFineShift;  // floor
      q[i] = static_cast<int8_t>(hi);
      lo[i] = static_cast<int8_t>(c - (hi << kFineShift));
      qsum += c;
    }
    const float dx = amax / 127.0f / kFineScale;
    return {dx, dx * static_cast<float>(qsum), qsum};
  }
  for (int i = 0; i < kGroup; ++i) {
    const float scaled = std::nearbyint(v[i] * inv);  // the default rounding: half to even
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, scaled)));
    qsum += q[i];
  }
  const float dx = amax / 127.0f;
  return {dx, dx * static_cast<float>(qsum), qsum};
}

// quantize_group's operations on 32 values held as two vectors: the same products, the same
// round-half-even and clamp, max and integer sums (order-free) and the same dx * float(sq),
// so the same bits (inputs holding NaN aside: the row fails as non-finite anyway)
#define ARGOSY_Q512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// one half group's 16 values times inv: their codes (clamped, then converted rounding half to
// even: the same integers as rounding first, the bounds being integers), stored as bytes (the
// fine form: hi at q, lo at lo); returns the codes
ARGOSY_Q512 inline __m512i code_half_512(__m512 values, __m512 inv, int8_t* q, int8_t* lo) {
  const float top_value = lo != nullptr ? static_cast<float>(kFineMax) : 127.0f;
  __m512 product = _mm512_mul_ps(values, inv);
  if (lo != nullptr) product = _mm512_mul_ps(product, _mm512_set1_ps(kFineScale));
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(top_value), _mm512_max_ps(_mm512_set1_ps(-top_value), product));
  const __m512i codes = _mm512_cvt_roundps_epi32(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (lo != nullptr) {
    const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(codes, _mm512_set1_epi32(64)), kFineShift);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo),
                     _mm512_cvtepi32_epi8(_mm512_sub_epi32(codes, _mm512_slli_epi32(hi, kFineShift))));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(codes));
  }
  return codes;
}

ARGOSY_Q512 inline GroupQ quantize_group_512(__m512 first, __m512 second, int8_t* q, int8_t* lo) {
  const float amax =
      std::max(0.0f, _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second))));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i codes = _mm512_add_epi32(code_half_512(first, inv, q, lo),
                                         code_half_512(second, inv, q + 16, lo != nullptr ? lo + 16 : nullptr));
  const int32_t qsum = _mm512_reduce_add_epi32(codes);
  const float dx = lo != nullptr ? amax / 127.0f / kFineScale : amax / 127.0f;
  return {dx, dx * static_cast<float>(qsum), qsum};
}

// element 0 of each 128-bit lane, as the four values of one 128-bit vector
ARGOSY_Q512 inline __m128i lane_firsts_512(__m512i v) {
  return _mm512_castsi512_si128(
      _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v));
}

// four groups' vectors folded into one: 128-bit lane j holds the max (or integer sum) over group
// j's 16 values, in each of its 4 places (order-free operations: the bits of a whole reduction).
// Lanes (0, 1) with (2, 3) of each pair of groups, then lanes 0, 2 with 1, 3, then within lanes.
ARGOSY_Q512 inline __m512 fold4_max(const __m512 (&v)[4]) {
  const __m512 ab = _mm512_max_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 cd = _mm512_max_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  __m512 all = _mm512_max_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  all = _mm512_max_ps(all, _mm512_permute_ps(all, 0x4E));
  return _mm512_max_ps(all, _mm512_permute_ps(all, 0xB1));
}

ARGOSY_Q512 inline __m512i fold4_add(const __m512i (&v)[4]) {
  const __m512i ab = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x44), _mm512_shuffle_i32x4(v[0], v[1], 0xEE));
  const __m512i cd = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], 0x44), _mm512_shuffle_i32x4(v[2], v[3], 0xEE));
  __m512i all = _mm512_add_epi32(_mm512_shuffle_i32x4(ab, cd, 0x88), _mm512_shuffle_i32x4(ab, cd, 0xDD));
  all = _mm512_add_epi32(all, _mm512_shuffle_epi32(all, _MM_PERM_BADC));
  return _mm512_add_epi32(all, _mm512_shuffle_epi32(all, _MM_PERM_CDAB));
}

// quantize_group_512 on four consecutive groups at once: the same operations on each value
// (code_half_512), the reductions
// folded four groups a vector and the scalar steps (127 / amax, amax / 127, dx * sq) as vector
// operations on four groups' lanes: the same bits, in about half the instructions
ARGOSY_Q512 inline void quantize_four_512(const uint16_t* xb, const float* xf, int64_t rg, QuantizedRows& out) {
  const bool fine = out.fine();
  const int64_t offset = rg * kGroup;
  __m512 halves[8], amax[4];
  for (int i = 0; i < 8; ++i)
    halves[i] = xb ? load16_bf16(xb + offset + 16 * i) : _mm512_loadu_ps(xf + offset + 16 * i);
  for (int j = 0; j < 4; ++j) amax[j] = _mm512_max_ps(_mm512_abs_ps(halves[2 * j]), _mm512_abs_ps(halves[2 * j + 1]));
  const __m512 m = _mm512_max_ps(_mm512_setzero_ps(), fold4_max(amax));
  const __mmask16 positive = _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0f), m);
  __m512i sums[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 inv_j = _mm512_shuffle_f32x4(inv, inv, 0x55 * j);
    int8_t* q = out.q.data() + offset + 32 * j;
    int8_t* lo = fine ? out.lo.data() + offset + 32 * j : nullptr;
    sums[j] = _mm512_add_epi32(code_half_512(halves[2 * j], inv_j, q, lo),
                               code_half_512(halves[2 * j + 1], inv_j, q + 16, fine ? lo + 16 : nullptr));
  }
  const __m512i sq = fold4_add(sums);
  __m512 dx = _mm512_div_ps(m, _mm512_set1_ps(127.0f));
  if (fine) dx = _mm512_div_ps(dx, _mm512_set1_ps(kFineScale));
  const __m512 ux = _mm512_mul_ps(dx, _mm512_cvtepi32_ps(sq));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.dx.data() + rg), lane_firsts_512(_mm512_castps_si512(dx)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.ux.data() + rg), lane_firsts_512(_mm512_castps_si512(ux)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.sq.data() + rg), lane_firsts_512(sq));
}

ARGOSY_Q512 void quantize_groups_512(const uint16_t* xb, const float* xf, int64_t begin, int64_t end,
                                     QuantizedRows& out) {
  for (; begin + 4 <= end; begin += 4) quantize_four_512(xb, xf, begin, out);
  for (int64_t rg = begin; rg < end; ++rg) {
    const int64_t offset = rg * kGroup;
    const __m512 lo = xb ? load16_bf16(xb + offset) : _mm512_loadu_ps(xf + offset);
    const __m512 hi = xb ? load16_bf16(xb + offset + 16) : _mm512_loadu_ps(xf + offset + 16);
    const GroupQ g = quantize_group_512(lo, hi, out.q.data() + offset, out.fine() ? out.lo.data() + offset : nullptr);
    out.dx[rg] = g.dx;
    out.ux[rg] = g.ux;
    out.sq[rg] = g.sq;
  }
}

QuantizedRows quantize_rows(const at::Tensor& x, int64_t groups, bool vector, bool fine) {
  const int64_t rows = x.size(0), k = groups * kGroup;
  QuantizedRows out;
  out.q.resize(static_cast<size_t>(rows * k));
  if (fine) out.lo.resize(static_cast<size_t>(rows * k));
  out.dx.resize(static_cast<size_t>(rows * groups));
  out.ux.resize(static_cast<size_t>(rows * groups));
  out.sq.resize(static_cast<size_t>(rows * groups));
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const uint16_t* xb = is_bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const float* xf = is_bf16 ? nullptr : x.data_ptr<float>();
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    if (vector) {  // rows are contiguous: row r, group g is r * G + g
      quantize_groups_512(xb, xf, begin, end, out);
      return;
    }
    float v[kGroup];
    for (int64_t rg = begin; rg < end; ++rg) {
      const int64_t offset = rg * kGroup;
      const float* values = xf + offset;
      if (is_bf16) {
        for (int64_t i = 0; i < kGroup; ++i) v[i] = bf16_to_float(xb[offset + i]);
        values = v;
      }
      const GroupQ g = quantize_group(values, out.q.data() + offset, fine ? out.lo.data() + offset : nullptr);
      out.dx[rg] = g.dx;
      out.ux[rg] = g.ux;
      out.sq[rg] = g.sq;
    }
  });
  return out;
}

// each 128-bit lane: the sum of its 16 bytes (in each of its four 32-bit places)
ARGOSY_Q512 inline __m512i lane_sums_512(const int8_t* p) {
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_set1_epi8(1), _mm512_loadu_si512(p));
  __m512i s = _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
  s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_BADC));
  return _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB));
}

// code_starts' 16-code groups [i, end) four at a time (the integers of its scalar loop);
// returns where it stopped
ARGOSY_Q512 int64_t half_starts_512(const QuantizedRows& xr, int64_t i, int64_t end, int32_t bias, int32_t* start) {
  for (; i + 4 <= end; i += 4) {
    __m512i s = lane_sums_512(xr.q.data() + i * 16);
    if (xr.fine()) s = _mm512_add_epi32(_mm512_slli_epi32(s, kFineShift), lane_sums_512(xr.lo.data() + i * 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(start + i),
                     lane_firsts_512(_mm512_mullo_epi32(s, _mm512_set1_epi32(-bias))));
  }
  return i;
}

// the integer dot products' starting values, per row and weight group of kGroup / h codes
// ([rows, groups, h]): -bias times the sum of x's codes over the group (the fine form's 128 * hi
// + lo; h = 1: the quantization's own sums), so that a dot over codes stored as q + bias starts
// at what makes it q . xq. `vector`: AVX-512 (the same integers)
Written<int32_t> code_starts(const QuantizedRows& xr, int64_t rows, int64_t groups, int64_t h, int32_t bias,
                             bool vector) {
  Written<int32_t> start;
  start.resize(static_cast<size_t>(rows * groups * h));
  const int64_t k = groups * kGroup;
  at::parallel_for(0, rows, std::max<int64_t>(1, 64 / std::max<int64_t>(1, k / 1024)), [&](int64_t r0, int64_t r1) {
    int64_t i = r0 * groups * h;  // rows are contiguous: [r, g, h] is i
    const int64_t end = r1 * groups * h;
    if (h == 1) {
      for (; i < end; ++i) start[static_cast<size_t>(i)] = -bias * xr.sq[static_cast<size_t>(i)];
      return;
    }
    if (vector && kGroup / h == 16) i = half_starts_512(xr, i, end, bias, start.data());
    for (; i < end; ++i) {
      int32_t sum = 0;
      for (int64_t b = 0; b < kGroup / h; ++b) sum += xr.code(i * (kGroup / h) + b);
      start[static_cast<size_t>(i)] = -bias * sum;
    }
  });
  return start;
}

// -- the output: fp32 or bf16 ------------------------------------------------------------------

struct Output {
  float* f = nullptr;
  uint16_t* b = nullptr;
  int64_t ld = 0;
  bool vector = false;  // AVX-512 for the bf16 rounding
  bool vector8 = false;  // AVX2 for it
  // fp32 outputs: a value per column added to every row as it is stored (a layer's bias: the
  // bits of adding it after, one fp32 rounding, without another pass over the output)
  const float* add = nullptr;
  // fp32 rows whose 16-value pieces sit at 64-byte boundaries: a kernel may write them with
  // non-temporal stores (then _mm_sfence before its threads join). A prefill's outputs are tens of
  // MB: ordinary stores first read each line they fill (the AMX K-quant kernel, the 1.5B's
  // 1,000-token gate/up: 62-68 -> 46-52 ms, the whole prefill 239-263 -> 276-283 tok/s)
  bool streamable() const {
    return f != nullptr && reinterpret_cast<uintptr_t>(f) % 64 == 0 && ld % 16 == 0;
  }
  void put(int64_t row, int64_t col, const float* values, int64_t count) const {
    if (f != nullptr) {
      float* to = f + row * ld + col;
      if (add == nullptr) {
        std::memcpy(to, values, static_cast<size_t>(count) * 4);
      } else {
        for (int64_t i = 0; i < count; ++i) to[i] = values[i] + add[col + i];
      }
      return;
    }
    int64_t i = 0;
    if (vector)
      for (; i + 16 <= count; i += 16) bf16_16(values + i, b + row * ld + col + i);
    else if (vector8)
      for (; i + 8 <= count; i += 8) bf16_8(values + i, b + row * ld + col + i);
    for (; i < count; ++i) b[row * ld + col + i] = float_to_bf16(values[i]);
  }
};

// a row's values (`count` and `col` multiples of 16) by non-temporal stores where the output
// allows (the caller then calls _mm_sfence before its threads join), else by Output::put. A
// prefill's output is tens of MB: ordinary stores bring each line into L2, where they push out
// the x and unpacked codes a pass of the AVX-512 VNNI tile kernels keeps there (Qwen2.5-Coder-1.5B's
// gate/up, forced avx512-vnni, 1,000 rows, 2 threads: 72-78 -> 62-69 ms; one thread:
// 142 -> 124 ms; the down projection ~2%, the 1,000-token prefill 213 -> 227 tok/s)
ARGOSY_Q512 inline void put_row_streamed(const Output& out, int64_t row, int64_t col, const float* values,
                                         int64_t count) {
  if (!out.streamable()) return out.put(row, col, values, count);
  float* to = out.f + row * out.ld + col;
  if (out.add == nullptr) {
    for (int64_t i = 0; i < count; i += 16) _mm512_stream_ps(to + i, _mm512_loadu_ps(values + i));
  } else {
    for (int64_t i = 0; i < count; i += 16)
      _mm512_stream_ps(to + i, _mm512_add_ps(_mm512_loadu_ps(values + i), _mm512_loadu_ps(out.add + col + i)));
  }
}

// -- driving: tiles split among threads, rows in blocks ---------------------------------------

constexpr int kRowBlock = 4;  // rows a block (AVX-512: with 2 tiles; AVX2: 1 tile)
constexpr int kWideRowBlock = 8;  // q8, AVX-512: rows a block with 1 tile, in steps of up to
constexpr int64_t kWideMaxRows = 32;  // rows

template <typename Block>
void for_tile_blocks(int64_t tiles, int64_t tiles_per_block, Block&& block) {
  const int64_t blocks = (tiles + tiles_per_block - 1) / tiles_per_block;
  const int64_t grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block(b * tiles_per_block, std::min(tiles, (b + 1) * tiles_per_block));
  });
}

// rows in blocks of kRowBlock, the rest one size smaller at a time: run(first_row, constant)
template <typename Run>
inline void for_row_blocks(int64_t rows, Run&& run) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) run(r, std::integral_constant<int, kRowBlock>{});
  for (; r + 2 <= rows; r += 2) run(r, std::integral_constant<int, 2>{});
  if (r < rows) run(r, std::integral_constant<int, 1>{});
}

// rows [r0, r1) in blocks of RB, then one block each of 4 (below RB), 2 and 1 rows for the rest
// (the prefill kernels' row blocks): run(first_row, constant)
template <int RB, typename Run>
inline void for_rows_in_blocks_of(int64_t r0, int64_t r1, Run&& run) {
  for (; r0 + RB <= r1; r0 += RB) run(r0, std::integral_constant<int, RB>{});
  if constexpr (RB > 4)
    if (r0 + 4 <= r1) run(r0, std::integral_constant<int, 4>{}), r0 += 4;
  if (r0 + 2 <= r1) run(r0, std::integral_constant<int, 2>{}), r0 += 2;
  if (r0 < r1) run(r0, std::integral_constant<int, 1>{});
}

Output make_output(at::Tensor& out, int64_t path) {
  Output o;
  o.ld = out.size(1);
  o.vector = path >= kAvx512;
  o.vector8 = path == kAvx2;
  if (out.scalar_type() == at::kFloat)
    o.f = out.data_ptr<float>();
  else
    o.b = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  return o;
}

void check_x(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              op, ": x must be a contiguous [rows, in_features] bfloat16 or float32 tensor");
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " features, the weight ", k);
}

// what q4_linear and q8_linear do once their weights are checked: x checked, the output
// allocated, x's rows quantized (none when there are no rows), the path chosen
struct LinearCall {
  at::Tensor out;
  int64_t rows, path;
  QuantizedRows xr;
  Output o;
  bool swiglu = false;  // kq_linear's swiglu form: out holds SwiGLU of the gate's and the up's halves

  LinearCall(const at::Tensor& x, int64_t k, int64_t groups, int64_t out_features, bool out_float32, const char* op,
             bool fine = false)
      : rows(0), path(current_path()) {
    check_x(x, k, op);
    rows = x.size(0);
    out = at::empty({rows, out_features}, x.options().dtype(out_float32 ? at::kFloat : x.scalar_type()));
    if (rows > 0) xr = quantize_rows(x, groups, path >= kAvx512, fine);
    o = make_output(out, path);
  }
};

// AMX-INT8 (both kernel files): the target, a compiler barrier around tile stores, and the
// tile configuration ldtilecfg reads (palette 1)
#define ARGOSY_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define ARGOSY_MEMORY_BARRIER() asm volatile("" : : : "memory")

// an AMX kernel's 16-row block of one tile (16 outputs at column `col`), nr of its rows real: by
// non-temporal stores where the output allows (the kernel then calls _mm_sfence before its
// threads join), else through res and Output::put
ARGOSY_AMX inline void put_tile_rows(const Output& out, int64_t r0, int64_t nr, int64_t col, const __m512* acc,
                                     float* res) {
  if (out.streamable()) {
    const __m512 add = out.add == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(out.add + col);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      if (r < nr)
        _mm512_stream_ps(out.f + (r0 + r) * out.ld + col, out.add == nullptr ? acc[r] : _mm512_add_ps(acc[r], add));
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    if (r < nr) _mm512_store_ps(res + 16 * r, acc[r]);
  for (int64_t r = 0; r < nr; ++r) out.put(r0 + r, col, res + 16 * r, kTile);
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace
}  // namespace argosy_iq
