// Invariant attention: the same bits for a row whatever else is in the batch (see iq_common.h
// for the paths). Built with iq_linear.cpp into one library, torch.ops.argosy_iq.
// -- attention, the same for every row: decode rows, prefill rows, any chunk ---------------------
//
// argosy_iq::attention(q, k, v, k_cache!, v_cache!, slots, block_ids, mask, block_size): the
// contract of argosy_ext::paged_decode (csrc/paged_decode.cpp): each row's K/V is written at its
// slot first, then each row attends over the positions its mask row allows, which must be one
// run s .. n-1 of its sequence (a decode row: its context; a prefill row: up to itself; s > 0
// for a sliding-window layer). q is float32, k, v and the caches float16 (as llama.cpp's KV
// cache: 3 more bits than bf16), the output float32. Per row, query head and position
// s <= j < n, in fp32 (fp16 -> fp32 is exact):
//   s_j = tree16(lane l: fma over c of q[16c + l] * k_j[16c + l], c in order) * scale
//   m = max s_j;  p_j = exp_argosy(s_j - m);
//   l = tree16(lane i: sum over j with j - s = i mod 16, j in order)
//   out[d] = (fma over j in order of p_j * v_j[d]) * (1 / l)
// The caches may instead be int8 (--kv-cache-dtype int8, as llama.cpp's q8_0 cache): per slot and
// KV head a row of D codes then D / 32 float16 scales, one per 32 dims (int8 [slots, KVH, D + D /
// 16], D a multiple of 32); k and v then come float32 and are written as d = fp16(max|x| / 127),
// code = clamp(round-half-even(x / float(d)), -127, 127) (all 0 when d is 0): the row's own
// values only. A position's K or V value is float(code) * float(d), exact in fp32 (an 8-bit
// integer times an 11-bit significand), so every path reads the same values and the arithmetic
// below is unchanged.
// tree16(a) = ((a0 + a2) + (a1 + a3)) + ((a4 + a6) + (a5 + a7)) + ... (tree16 in iq_common.h),
// exp_argosy uses only +, -, * and round-to-nearest (no fma), and the max is exact in any order.
// A lane's chain starts from 0 (scalar: fma(q, k, 0)) or from the plain product (vector): the
// same value, as fma(q, k, 0) rounds q * k once, as the product does (only a zero's sign can
// differ, and that cannot reach p). attend_scalar is the statement; the AVX-512 path
// (avx512-vnni, amx-int8) and the AVX2 + FMA path (avx2) do the same operations on 16 or 8 values
// at a time and agree with it bit for bit, for every head dim the op takes (16, 32, ..., 128, 256) and
// any number of query heads per KV head. Rows sharing a block table are cut into tiles (one KV
// head each) that the threads take longest first; a row's result depends on nothing else in the
// call: not the other rows, the tiling or the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "iq_common.h"
#include "iq_exp.h"

namespace {

using namespace argosy_iq;

namespace attn {

constexpr int kLanes = 16;

struct Rows {  // what every path needs of one call
  const float* q;           // fp32 [T, H, D]
  const uint16_t* k_cache;  // fp16 [slots, KVH, D], or nullptr (int8 caches)
  const uint16_t* v_cache;
  const int8_t* k8;  // int8 [slots, KVH, D + D / 16], or nullptr (fp16 caches)
  const int8_t* v8;
  int64_t row_width;  // a slot's row of one KV head, in the cache's elements: D, or D + D / 16
  const int64_t* block_ids;  // [T, max_blocks]
  const int64_t* lens;       // [T]: a row sees positions [starts, lens)
  const int64_t* starts;     // [T]: 0, or where a sliding window begins
  float* out;                // fp32 [T, H * D]
  int64_t heads, kv_heads, dim, max_blocks, block_size;
  float scale;
};

inline int64_t slot_at(const Rows& a, const int64_t* table, int64_t p) {
  return table[p / a.block_size] * a.block_size + p % a.block_size;
}

constexpr int64_t kQ8Group = 32;  // an int8 cache row's dims per scale

inline float q8_scale(const int8_t* row, int64_t dim, int64_t group) {  // the row's group-th fp16 scale
  uint16_t h;
  std::memcpy(&h, row + dim + 2 * group, 2);
  return half_to_float(h);
}

// K (v false) or V of kv head h at a slot, dim d, as fp32 (exact)
inline float kv_at(const Rows& a, bool v, int64_t slot, int64_t h, int64_t d) {
  if (a.k8 == nullptr) return half_to_float((v ? a.v_cache : a.k_cache)[(slot * a.kv_heads + h) * a.dim + d]);
  const int8_t* row = (v ? a.v8 : a.k8) + (slot * a.kv_heads + h) * a.row_width;
  return static_cast<float>(row[d]) * q8_scale(row, a.dim, d / kQ8Group);
}

// rows [r0, r1) share a block table; kv head h: the scalar statement of the arithmetic
void attend_scalar(const Rows& a, int64_t r0, int64_t r1, int64_t h) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim;
  const int64_t* table = a.block_ids + r0 * a.max_blocks;
  std::vector<float> scores, acc(dim);
  float lanes[kLanes];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t n = a.lens[r], s0 = a.starts[r];
    scores.assign(static_cast<size_t>(n), 0.0f);
    for (int64_t g = 0; g < group; ++g) {
      const float* q = a.q + (r * a.heads + h * group + g) * dim;
      float* dst = a.out + (r * a.heads + h * group + g) * dim;
      if (n <= s0) {
        for (int64_t d = 0; d < dim; ++d) dst[d] = 0;
        continue;
      }
      for (int64_t j = s0; j < n; ++j) {
        const int64_t slot = slot_at(a, table, j);
        for (int l = 0; l < kLanes; ++l) {
          float s = 0.0f;
          for (int64_t c = 0; c < dim / kLanes; ++c)
            s = std::fma(q[c * kLanes + l], kv_at(a, false, slot, h, c * kLanes + l), s);
          lanes[l] = s;
        }
        scores[j] = tree16(lanes) * a.scale;
      }
      float mx = scores[s0];
      for (int64_t j = s0 + 1; j < n; ++j) mx = std::max(mx, scores[j]);
      float partial[kLanes] = {};  // lanes counted from the window's start
      for (int64_t j = s0; j < n; ++j) {
        scores[j] = exp_scalar(scores[j] - mx);
        partial[(j - s0) % kLanes] = partial[(j - s0) % kLanes] + scores[j];
      }
      const float inv = 1.0f / tree16(partial);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = s0; j < n; ++j) {
        const int64_t slot = slot_at(a, table, j);
        for (int64_t d = 0; d < dim; ++d) acc[d] = std::fma(scores[j], kv_at(a, true, slot, h, d), acc[d]);
      }
      for (int64_t d = 0; d < dim; ++d) dst[d] = acc[d] * inv;
    }
  }
}

// -- the vector paths (AVX-512 and AVX2 + FMA) ----------------------------------------------------
//
// A tile is a few rows sharing a block table, for one KV head. Its positions are taken kChunk at a
// time as fp32: K transposed (one vector holds one dimension of W consecutive positions, W = 16 or
// 8; AVX2: kt[d * kChunk + i], AVX-512: see chunk512) and V as rows. So a score vector holds W positions:
// lane l's chain over c is a chain of vector fmas, tree16 over the lanes is vertical adds of the 16
// lane vectors, and every position gets the operations of the definition, in its order. The
// weighted sum of V holds W dimensions of a row and head per vector. A run of rows sharing a table
// that spans several tiles (a prefill) has its chunks made once per call and shared; otherwise a
// tile makes its own, one chunk at a time (a decode row: its K and V read once either way).

constexpr int64_t kChunk = 64;      // positions per chunk: a multiple of 16
constexpr int64_t kTilePairs = 18;  // (row, query head) pairs per tile, about (a multiple of 6)

struct Buffer {  // grow-only scratch, 64-byte aligned
  std::unique_ptr<float[]> raw;
  size_t size = 0;
  float* data = nullptr;
  float* get(size_t n) {
    if (n > size) {
      raw.reset(new float[n + 16]);
      size = n;
      data = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw.get()) + 63) & ~uintptr_t{63});
    }
    return data;
  }
};

struct Scratch {  // per thread, kept between calls
  Buffer q, scores, acc, chunk, inv, window;
  std::vector<int64_t> lens, starts;
};

inline Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// what a tile task needs: rows [r0, r1) sharing `table`, kv head h; `shared`: the run's chunks
// for this head ([K^T chunk | V chunk] per chunk) or nullptr
struct Tile {
  const int64_t* table;
  const float* shared;
  int64_t r0, r1, h;
};

// k_cache / v_cache (or k8 / v8) element offsets of kv head h at positions [j0, j0 + count)
inline void offsets(const Rows& a, const int64_t* table, int64_t h, int64_t j0, int64_t count, int64_t* off) {
  const int64_t stride = a.kv_heads * a.row_width;
  int64_t b = j0 / a.block_size, o = j0 % a.block_size;
  for (int64_t i = 0; i < count; ++i) {
    off[i] = (table[b] * a.block_size + o) * stride + h * a.row_width;
    if (++o == a.block_size) {
      o = 0;
      ++b;
    }
  }
}

// the (row, query head) pairs of a tile, rg = (r - r0) * group + g: their visible positions
inline int64_t tile_lens(const Rows& a, const Tile& t, int64_t group, int64_t* len, int64_t* start) {
  int64_t n_max = 0;
  for (int64_t rg = 0; rg < (t.r1 - t.r0) * group; ++rg) {
    n_max = std::max(n_max, len[rg] = a.lens[t.r0 + rg / group]);
    start[rg] = a.starts[t.r0 + rg / group];
  }
  return n_max;
}

// the first chunk any of `count` pairs sees: chunks before it lie wholly before every window
inline int64_t first_chunk(const int64_t* start, int64_t count) {
  int64_t first = count > 0 ? start[0] : 0;
  for (int64_t i = 1; i < count; ++i) first = std::min(first, start[i]);
  return first / kChunk;
}

// a pair's softmax over its positions [start, n) of sc (the scalar statement's: lanes counted
// from start), leaving p there and 0 before start; returns 1 / l. The vector softmax runs on an
// aligned copy of the window; zeros before it then add nothing to the weighted sums (fma(0, v,
// acc) = acc).
template <class Softmax>
inline float windowed_softmax(Softmax softmax, float* sc, int64_t start, int64_t n, Buffer& scratch) {
  if (start == 0) return n > 0 ? softmax(sc, n) : 0.0f;
  if (n <= start) return 0.0f;
  const int64_t count = n - start;
  float* window = scratch.get(static_cast<size_t>((count + kLanes - 1) / kLanes * kLanes));
  std::memcpy(window, sc + start, static_cast<size_t>(count) * sizeof(float));
  const float inv = softmax(window, count);
  std::memcpy(sc + start, window, static_cast<size_t>(count) * sizeof(float));
  std::fill(sc, sc + start, 0.0f);
  return inv;
}

inline const float* q_row(const Rows& a, const Tile& t, int64_t group, int64_t rg) {
  return a.q + ((t.r0 + rg / group) * a.heads + t.h * group + rg % group) * a.dim;
}

inline void store_row(const Rows& a, const Tile& t, int64_t group, int64_t rg, const float* values, float inv,
                      int64_t n) {
  float* dst = a.out + ((t.r0 + rg / group) * a.heads + t.h * group + rg % group) * a.dim;
  for (int64_t d = 0; d < a.dim; ++d) dst[d] = n == 0 ? 0.0f : values[d] * inv;
}

// the positions of a chunk's K^T that the scores read: `count` rounded up to a block of 16 (the
// rest of a part-filled chunk is never read, so never made)
inline int64_t blocks_of(int64_t count) { return (count + kLanes - 1) / kLanes * kLanes; }

// -- AVX-512 --

#define ARGOSY_ATTN512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#if defined(__clang__)
#define ARGOSY_ATTN_SCHED __attribute__((noinline))
#else
#define ARGOSY_ATTN_SCHED __attribute__((noinline, optimize("schedule-insns", "sched-pressure")))
#endif

ARGOSY_ATTN512 inline __m512 load_half(const uint16_t* p) {  // 16 fp16 -> fp32 (exact)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[e] <- column e of the 16 x 16 matrix whose rows are r[0..15]
ARGOSY_ATTN512 __attribute__((always_inline)) inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {  // u[4m + e], 128-bit lane L: column 4L + e of rows 4m .. 4m + 3
    u[4 * m] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * m + 1] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * m + 2] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * m + 3] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 4
  for (int e = 0; e < 4; ++e) {
    const __m512 w0 = _mm512_shuffle_f32x4(u[e], u[4 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 w1 = _mm512_shuffle_f32x4(u[e], u[4 + e], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 x0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 x1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(3, 1, 3, 1));
    r[e] = _mm512_shuffle_f32x4(w0, x0, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + e] = _mm512_shuffle_f32x4(w0, x0, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + e] = _mm512_shuffle_f32x4(w1, x1, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + e] = _mm512_shuffle_f32x4(w1, x1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The AVX-512 chunk layout: K^T a block of 16 positions at a time (kt[(i / 16) * dim * 16 + d * 16 +
// i % 16]: a block's 256 dims x 16 positions one contiguous 16 KB, not 256 lines 256 bytes apart,
// which fall in a quarter of L1's sets); V as rows, or from head dim 256, 64 dims at a time
// (vf[(d / 64) * kChunk * 64 + i * 64 + d % 64]: a 64-dim slice of the chunk contiguous, likewise)
template <int C>
constexpr int64_t v_row512 = C > 8 ? 4 * kLanes : C * kLanes;  // V's row stride in a chunk

template <int C>
inline int64_t v_index512(int64_t i, int c) {  // V's position i, dims 16c .. 16c + 15
  if constexpr (C > 8) return (c / 4) * kChunk * v_row512<C> + i * v_row512<C> + (c % 4) * kLanes;
  return i * v_row512<C> + c * kLanes;
}

// positions [j0, j0 + count) of kv head h (count <= kChunk) as one chunk: K^T (zero past count), then V
// 16 values of an int8 cache row from dim d0 (a multiple of 16) as fp32: code * scale (exact)
ARGOSY_ATTN512 inline __m512 load_q8_16(const int8_t* row, int64_t dim, int64_t d0) {
  const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d0))));
  return _mm512_mul_ps(codes, _mm512_set1_ps(q8_scale(row, dim, d0 / kQ8Group)));
}

// chunk512 from int8 caches: 16 positions x 16 dims dequantized, transposed, at a time
template <int C>
ARGOSY_ATTN512 void chunk512_q8(const Rows& a, const int64_t* off, int64_t count, float* kt, float* vf) {
  constexpr int64_t dim = C * kLanes;
  if (kt != nullptr)
    for (int64_t i0 = 0; i0 < blocks_of(count); i0 += kLanes)
      for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
        __m512 r[kLanes];
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i)
          r[i] = i0 + i >= count ? _mm512_setzero_ps() : load_q8_16(a.k8 + off[i0 + i], dim, d0);
        transpose16(r);  // r[e]: dim d0 + e of the 16 positions
        float* block = kt + i0 * dim;
#pragma GCC unroll 16
        for (int e = 0; e < kLanes; ++e) _mm512_store_ps(block + (d0 + e) * kLanes, r[e]);
      }
  if (vf != nullptr)
    for (int64_t i = 0; i < count; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) _mm512_store_ps(vf + v_index512<C>(i, c), load_q8_16(a.v8 + off[i], dim, c * kLanes));
}

template <int C>
ARGOSY_ATTN512 void chunk512(const Rows& a, const int64_t* table, int64_t h, int64_t j0, int64_t count,
                             float* kt, float* vf) {
  constexpr int64_t dim = C * kLanes;
  int64_t off[kChunk];
  offsets(a, table, h, j0, count, off);
  if (a.k8 != nullptr) return chunk512_q8<C>(a, off, count, kt, vf);
  if (kt != nullptr)  // 16 positions x 16 fp16 pairs (32 dims; 16 for the last of an odd C) at a time,
    for (int64_t i0 = 0; i0 < blocks_of(count); i0 += kLanes)  // transposed as 32-bit words
      for (int64_t d0 = 0; d0 < dim; d0 += 2 * kLanes) {
        const int pairs = dim - d0 >= 2 * kLanes ? kLanes : kLanes / 2;
        __m512 r[kLanes];
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i) {
          const float* src = reinterpret_cast<const float*>(a.k_cache + off[i0 + i] + d0);
          r[i] = i0 + i >= count       ? _mm512_setzero_ps()
                 : pairs == kLanes ? _mm512_loadu_ps(src)
                                   : _mm512_zextps256_ps512(_mm256_loadu_ps(src));
        }
        transpose16(r);  // r[e]: dims d0 + 2e (low half) and d0 + 2e + 1 (high half) of the 16 positions
        for (int e = 0; e < pairs; ++e) {
          const __m512i pair = _mm512_castps_si512(r[e]);
          float* block = kt + i0 * dim;  // positions i0 .. i0 + 15: [dim][16]
          _mm512_store_ps(block + (d0 + 2 * e) * kLanes, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair)));
          _mm512_store_ps(block + (d0 + 2 * e + 1) * kLanes,
                          _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16))));
        }
      }
  if (vf != nullptr)
    for (int64_t i = 0; i < count; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        _mm512_store_ps(vf + v_index512<C>(i, c), load_half(a.v_cache + off[i] + c * kLanes));
}

// the scores of NP (row, head) pairs (q: fp32, q_stride apart) at W * NB positions (kt: their first
// column of a chunk), sharing each K load among the pairs. Not inlined, so its q broadcasts stay
// inside it; compiled with register-pressure-aware scheduling (GCC otherwise spills a third of the
// accumulators)
template <int C, int NB, int NP>
ARGOSY_ATTN512 ARGOSY_ATTN_SCHED void qk512(const float* q, int64_t q_stride, const float* kt, float* out,
                                          int64_t out_stride, float scale) {
  __m512 s01[NP][NB], s23[NP][NB];
#pragma GCC unroll 4
  for (int quad = 0; quad < 4; ++quad) {
    __m512 half[NP][NB];  // a0 + a2, then + (a1 + a3)
#pragma GCC unroll 2
    for (int odd = 0; odd < 2; ++odd) {
      __m512 acc[NP][NB][2];  // lanes 4 quad + odd and 4 quad + odd + 2, chains side by side
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int d = c * kLanes + 4 * quad + odd + 2 * e;
          __m512 qb[NP];
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p) qb[p] = _mm512_set1_ps(q[p * q_stride + d]);
#pragma GCC unroll 4
          for (int b = 0; b < NB; ++b) {  // the chain's first term a plain product (= fma(q, k, 0))
            const __m512 k = _mm512_load_ps(kt + (b * C * kLanes + d) * kLanes);
#pragma GCC unroll 4
            for (int p = 0; p < NP; ++p)
              acc[p][b][e] = c == 0 ? _mm512_mul_ps(qb[p], k) : _mm512_fmadd_ps(qb[p], k, acc[p][b][e]);
          }
        }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          const __m512 pair = _mm512_add_ps(acc[p][b][0], acc[p][b][1]);
          half[p][b] = odd == 0 ? pair : _mm512_add_ps(half[p][b], pair);
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {  // tree16: s_quad = (a0 + a2) + (a1 + a3), then (s0 + s1) + (s2 + s3)
        if (quad == 0) s01[p][b] = half[p][b];
        else if (quad == 1) s01[p][b] = _mm512_add_ps(s01[p][b], half[p][b]);
        else if (quad == 2) s23[p][b] = half[p][b];
        else s23[p][b] = _mm512_add_ps(s23[p][b], half[p][b]);
      }
  }
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
      _mm512_store_ps(out + p * out_stride + b * kLanes, _mm512_mul_ps(_mm512_add_ps(s01[p][b], s23[p][b]), _mm512_set1_ps(scale)));
}

// scores (n > 0 of them) -> p (zero from n to the next multiple of 16); returns 1 / l
ARGOSY_ATTN512 ARGOSY_ATTN_SCHED float softmax512(float* sc, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  float mx = sc[0];
  if (full > 0) {  // the max is exact in any order (a -0 / +0 tie gives the same p); four chains
    __m512 m0 = _mm512_load_ps(sc), m1 = m0, m2 = m0, m3 = m0;
    int64_t j0 = kLanes;
    for (; j0 + 4 * kLanes <= full; j0 += 4 * kLanes) {
      m0 = _mm512_max_ps(m0, _mm512_load_ps(sc + j0));
      m1 = _mm512_max_ps(m1, _mm512_load_ps(sc + j0 + kLanes));
      m2 = _mm512_max_ps(m2, _mm512_load_ps(sc + j0 + 2 * kLanes));
      m3 = _mm512_max_ps(m3, _mm512_load_ps(sc + j0 + 3 * kLanes));
    }
    for (; j0 < full; j0 += kLanes) m0 = _mm512_max_ps(m0, _mm512_load_ps(sc + j0));
    mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  }
  for (int64_t j = full; j < n; ++j) mx = std::max(mx, sc[j]);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 partial = _mm512_setzero_ps();  // lane i: the sum over j = i mod 16, j in order
  int64_t j0 = 0;
  for (; j0 + 4 * kLanes <= n; j0 += 4 * kLanes) {  // four exps side by side (each a long chain)
    __m512 p[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) p[u] = exp512(_mm512_sub_ps(_mm512_load_ps(sc + j0 + u * kLanes), m));
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      _mm512_store_ps(sc + j0 + u * kLanes, p[u]);
      partial = _mm512_add_ps(partial, p[u]);
    }
  }
  for (; j0 < n; j0 += kLanes) {
    const __mmask16 valid = static_cast<__mmask16>(n - j0 >= kLanes ? 0xffff : (1u << (n - j0)) - 1u);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_load_ps(sc + j0), m)));
    _mm512_store_ps(sc + j0, p);
    partial = _mm512_add_ps(partial, p);
  }
  alignas(64) float parts[kLanes];
  _mm512_store_ps(parts, partial);
  return 1.0f / tree16(parts);
}

// acc[v] += p_v[i] * vf[i] over the chunk's positions i < len[v] - j0, for NV (row, head) pairs and
// K vectors of dimensions (at vf and acc; their rows dim apart)
template <int K, int NV>
ARGOSY_ATTN512 inline void pv512(const float* p, int64_t p_stride, const float* vf, int64_t vrow, int64_t dim,
                                 const int64_t* len, int64_t j0, float* acc) {
  int64_t count[NV], lo = kChunk, hi = 0;
  for (int v = 0; v < NV; ++v) {
    count[v] = std::clamp<int64_t>(len[v] - j0, 0, kChunk);
    lo = std::min(lo, count[v]);
    hi = std::max(hi, count[v]);
  }
  if (hi == 0) return;
  __m512 ac[NV][K];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
    for (int c = 0; c < K; ++c) ac[v][c] = _mm512_load_ps(acc + v * dim + c * kLanes);
  for (int64_t i = 0; i < lo; ++i) {  // every pair
    __m512 vv[K];
#pragma GCC unroll 8
    for (int c = 0; c < K; ++c) vv[c] = _mm512_load_ps(vf + i * vrow + c * kLanes);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m512 pb = _mm512_set1_ps(p[v * p_stride + i]);
#pragma GCC unroll 8
      for (int c = 0; c < K; ++c) ac[v][c] = _mm512_fmadd_ps(pb, vv[c], ac[v][c]);
    }
  }
  for (int64_t i = lo; i < hi; ++i) {  // the pairs that still see position j0 + i
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (i >= count[v]) continue;
      const __m512 pb = _mm512_set1_ps(p[v * p_stride + i]);
#pragma GCC unroll 8
      for (int c = 0; c < K; ++c) ac[v][c] = _mm512_fmadd_ps(pb, _mm512_load_ps(vf + i * vrow + c * kLanes), ac[v][c]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
    for (int c = 0; c < K; ++c) _mm512_store_ps(acc + v * dim + c * kLanes, ac[v][c]);
}

// pv512 for nv <= NV pairs
template <int K, int NV>
ARGOSY_ATTN512 inline void pv512_up_to(int64_t nv, const float* p, int64_t p_stride, const float* vf, int64_t vrow,
                                       int64_t dim, const int64_t* len, int64_t j0, float* acc) {
  if constexpr (NV > 1)
    if (nv < NV) return pv512_up_to<K, NV - 1>(nv, p, p_stride, vf, vrow, dim, len, j0, acc);
  pv512<K, NV>(p, p_stride, vf, vrow, dim, len, j0, acc);
}

// the pieces a tile takes from this path (called, not inlined: each carries its target)

template <int C>
ARGOSY_ATTN512 void widen512(const float* src, float* dst) {  // q into aligned scratch
  for (int c = 0; c < C; ++c) _mm512_store_ps(dst + c * kLanes, _mm512_loadu_ps(src + c * kLanes));
}

// the scores of `count` pairs (q_stride and out_stride apart) at the first 16 * blocks positions of
// a chunk: a pair at a time for four blocks of positions (its q broadcast once for four K loads),
// or, from head dim 128 up (a chunk's K^T outgrows L1), four pairs at a time for each block (each
// K load shared by four pairs; the block's K^T read from L2 once for all the pairs). Every score
// is the same chain either way.
template <int C>
ARGOSY_ATTN512 void scores512(int64_t count, const float* q, int64_t q_stride, const float* kt, float* out,
                              int64_t out_stride, int64_t blocks, float scale) {
  int64_t rg = 0;
  if constexpr (C >= 8)
    if (count >= 4) {  // a block's K^T (16 KB) stays in L1 for every four pairs
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t r = 0; r + 4 <= count; r += 4)
          qk512<C, 1, 4>(q + r * q_stride, q_stride, kt + b * C * kLanes * kLanes, out + r * out_stride + b * kLanes,
                         out_stride, scale);
      rg = count / 4 * 4;
    }
  for (; rg < count; ++rg) {
    const float* qr = q + rg * q_stride;
    float* o = out + rg * out_stride;
    if (blocks == 4) qk512<C, 4, 1>(qr, 0, kt, o, 0, scale);
    else if (blocks == 3) qk512<C, 3, 1>(qr, 0, kt, o, 0, scale);
    else if (blocks == 2) qk512<C, 2, 1>(qr, 0, kt, o, 0, scale);
    else qk512<C, 1, 1>(qr, 0, kt, o, 0, scale);
  }
}

// the weighted sums of `count` pairs over a chunk, NV pairs sharing each V load. Up to 96
// dimensions a row at once (NV pairs' accumulators, one V row and p in the 32 registers); from 128,
// 64 dimensions at a time for 6 pairs (head dim 256: one pair at a time read each V vector per
// FMA, from L2, and was two thirds of Gemma 3's prefill attention). Each accumulator's chain over
// the positions is the same whatever the grouping: the same bits
template <int C>
ARGOSY_ATTN512 void values512(int64_t count, const float* p, int64_t p_stride, const float* vf, const int64_t* len,
                              int64_t j0, float* acc) {
  constexpr int64_t dim = C * kLanes;
  if constexpr (C == 8) {  // V's rows a half at a time (2 pairs a whole row took 10 loads per 16
    // FMAs: Qwen2.5-Coder-1.5B's 1,000-token prefill attention 15.7 -> 13.6 ms a layer)
    for (int64_t d0 = 0; d0 < dim; d0 += 4 * kLanes)
      for (int64_t rg = 0; rg < count; rg += 6)
        pv512_up_to<4, 6>(count - rg, p + rg * p_stride, p_stride, vf + d0, dim, dim, len + rg, j0, acc + rg * dim + d0);
  } else if constexpr (C <= 8) {
    constexpr int NV = std::max(1, std::min(8, (29 - C) / C));
    for (int64_t rg = 0; rg < count; rg += NV)
      pv512_up_to<C, NV>(count - rg, p + rg * p_stride, p_stride, vf, dim, dim, len + rg, j0, acc + rg * dim);
  } else {
    static_assert(C % 4 == 0, "head dims above 128 go 64 at a time");
    for (int64_t d0 = 0; d0 < dim; d0 += 4 * kLanes)
      for (int64_t rg = 0; rg < count; rg += 6)
        pv512_up_to<4, 6>(count - rg, p + rg * p_stride, p_stride, vf + d0 * kChunk, v_row512<C>, dim, len + rg, j0,
                          acc + rg * dim + d0);
  }
}

// -- AVX2 + FMA --

#define ARGOSY_ATTN256 __attribute__((target("avx2,fma,f16c")))

constexpr int kW8 = 8;

ARGOSY_ATTN256 inline __m256 load_half8(const uint16_t* p) {  // 8 fp16 -> fp32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// the low (shift 0) or high (shift 16) fp16 of each 32-bit word, as fp32
ARGOSY_ATTN256 inline __m256 halves8(__m256i words, int high) {
  const __m256i picked = high ? _mm256_srli_epi32(words, 16) : _mm256_and_si256(words, _mm256_set1_epi32(0xffff));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(picked, picked), 0x08);  // qwords 0, 2
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

// r[e] <- column e of the 8 x 8 matrix whose rows are r[0..7]
ARGOSY_ATTN256 __attribute__((always_inline)) inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int m = 0; m < 2; ++m) {  // u[4m + e], 128-bit lane L: column 4L + e of rows 4m .. 4m + 3
    u[4 * m] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * m + 1] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * m + 2] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * m + 3] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 4
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

// 8 values of an int8 cache row from dim d0 (a multiple of 8) as fp32: code * scale (exact)
ARGOSY_ATTN256 inline __m256 load_q8_8(const int8_t* row, int64_t dim, int64_t d0) {
  const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d0))));
  return _mm256_mul_ps(codes, _mm256_set1_ps(q8_scale(row, dim, d0 / kQ8Group)));
}

// chunk256 from int8 caches: 8 positions x 8 dims dequantized, transposed, at a time
template <int C>
ARGOSY_ATTN256 void chunk256_q8(const Rows& a, const int64_t* off, int64_t count, float* kt, float* vf) {
  constexpr int64_t dim = C * kLanes;
  if (kt != nullptr)
    for (int64_t i0 = 0; i0 < blocks_of(count); i0 += kW8)
      for (int64_t d0 = 0; d0 < dim; d0 += kW8) {
        __m256 r[kW8];
#pragma GCC unroll 8
        for (int i = 0; i < kW8; ++i) r[i] = i0 + i < count ? load_q8_8(a.k8 + off[i0 + i], dim, d0) : _mm256_setzero_ps();
        transpose8(r);  // r[e]: dim d0 + e of the 8 positions
#pragma GCC unroll 8
        for (int e = 0; e < kW8; ++e) _mm256_store_ps(kt + (d0 + e) * kChunk + i0, r[e]);
      }
  if (vf != nullptr)
    for (int64_t i = 0; i < count; ++i)
#pragma GCC unroll 16
      for (int c = 0; c < 2 * C; ++c) _mm256_store_ps(vf + i * dim + c * kW8, load_q8_8(a.v8 + off[i], dim, c * kW8));
}

template <int C>
ARGOSY_ATTN256 void chunk256(const Rows& a, const int64_t* table, int64_t h, int64_t j0, int64_t count,
                             float* kt, float* vf) {
  constexpr int64_t dim = C * kLanes;
  int64_t off[kChunk];
  offsets(a, table, h, j0, count, off);
  if (a.k8 != nullptr) return chunk256_q8<C>(a, off, count, kt, vf);
  if (kt != nullptr)  // 8 positions x 8 fp16 pairs (16 dims) at a time, transposed as 32-bit words
    for (int64_t i0 = 0; i0 < blocks_of(count); i0 += kW8)
      for (int64_t d0 = 0; d0 < dim; d0 += 2 * kW8) {
        __m256 r[kW8];
#pragma GCC unroll 8
        for (int i = 0; i < kW8; ++i)
          r[i] = i0 + i < count ? _mm256_loadu_ps(reinterpret_cast<const float*>(a.k_cache + off[i0 + i] + d0))
                                : _mm256_setzero_ps();
        transpose8(r);  // r[e]: dims d0 + 2e (low half) and d0 + 2e + 1 (high half) of the 8 positions
#pragma GCC unroll 8
        for (int e = 0; e < kW8; ++e) {
          const __m256i pair = _mm256_castps_si256(r[e]);
          _mm256_store_ps(kt + (d0 + 2 * e) * kChunk + i0, halves8(pair, 0));
          _mm256_store_ps(kt + (d0 + 2 * e + 1) * kChunk + i0, halves8(pair, 1));
        }
      }
  if (vf != nullptr)
    for (int64_t i = 0; i < count; ++i)
#pragma GCC unroll 16
      for (int c = 0; c < 2 * C; ++c)
        _mm256_store_ps(vf + i * dim + c * kW8, load_half8(a.v_cache + off[i] + c * kW8));
}

// qk512 for 8 positions a vector
template <int C, int NB, int NP>
ARGOSY_ATTN256 ARGOSY_ATTN_SCHED void qk256(const float* q, int64_t q_stride, const float* kt, float* out,
                                          int64_t out_stride, float scale) {
  __m256 s01[NP][NB], s23[NP][NB];
#pragma GCC unroll 4
  for (int quad = 0; quad < 4; ++quad) {
    __m256 half[NP][NB];  // a0 + a2, then + (a1 + a3)
#pragma GCC unroll 2
    for (int odd = 0; odd < 2; ++odd) {
      __m256 acc[NP][NB][2];  // lanes 4 quad + odd and 4 quad + odd + 2, chains side by side
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int d = c * kLanes + 4 * quad + odd + 2 * e;
          __m256 qb[NP];
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p) qb[p] = _mm256_broadcast_ss(q + p * q_stride + d);
#pragma GCC unroll 4
          for (int b = 0; b < NB; ++b) {  // the chain's first term a plain product (= fma(q, k, 0))
            const __m256 k = _mm256_load_ps(kt + d * kChunk + b * kW8);
#pragma GCC unroll 4
            for (int p = 0; p < NP; ++p)
              acc[p][b][e] = c == 0 ? _mm256_mul_ps(qb[p], k) : _mm256_fmadd_ps(qb[p], k, acc[p][b][e]);
          }
        }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          const __m256 pair = _mm256_add_ps(acc[p][b][0], acc[p][b][1]);
          half[p][b] = odd == 0 ? pair : _mm256_add_ps(half[p][b], pair);
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {  // tree16: s_quad = (a0 + a2) + (a1 + a3), then (s0 + s1) + (s2 + s3)
        if (quad == 0) s01[p][b] = half[p][b];
        else if (quad == 1) s01[p][b] = _mm256_add_ps(s01[p][b], half[p][b]);
        else if (quad == 2) s23[p][b] = half[p][b];
        else s23[p][b] = _mm256_add_ps(s23[p][b], half[p][b]);
      }
  }
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
      _mm256_store_ps(out + p * out_stride + b * kW8, _mm256_mul_ps(_mm256_add_ps(s01[p][b], s23[p][b]), _mm256_set1_ps(scale)));
}

ARGOSY_ATTN256 ARGOSY_ATTN_SCHED float softmax256(float* sc, int64_t n) {
  const int64_t full = n / kW8 * kW8;
  float mx = sc[0];
  if (full > 0) {
    __m256 m0 = _mm256_load_ps(sc), m1 = m0, m2 = m0, m3 = m0;
    int64_t j0 = kW8;
    for (; j0 + 4 * kW8 <= full; j0 += 4 * kW8) {
      m0 = _mm256_max_ps(m0, _mm256_load_ps(sc + j0));
      m1 = _mm256_max_ps(m1, _mm256_load_ps(sc + j0 + kW8));
      m2 = _mm256_max_ps(m2, _mm256_load_ps(sc + j0 + 2 * kW8));
      m3 = _mm256_max_ps(m3, _mm256_load_ps(sc + j0 + 3 * kW8));
    }
    for (; j0 < full; j0 += kW8) m0 = _mm256_max_ps(m0, _mm256_load_ps(sc + j0));
    alignas(32) float lanes[kW8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (int l = 0; l < kW8; ++l) mx = std::max(mx, lanes[l]);
  }
  for (int64_t j = full; j < n; ++j) mx = std::max(mx, sc[j]);
  const __m256 m = _mm256_set1_ps(mx);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes j mod 16 = 0..7, 8..15
  int64_t j0 = 0;
  for (; j0 + 2 * kW8 <= n; j0 += 2 * kW8) {
    const __m256 p0 = exp256(_mm256_sub_ps(_mm256_load_ps(sc + j0), m));
    const __m256 p1 = exp256(_mm256_sub_ps(_mm256_load_ps(sc + j0 + kW8), m));
    _mm256_store_ps(sc + j0, p0);
    _mm256_store_ps(sc + j0 + kW8, p1);
    lo = _mm256_add_ps(lo, p0);
    hi = _mm256_add_ps(hi, p1);
  }
  for (; j0 < n; j0 += kW8) {  // j0 a multiple of 16 then 8
    __m256 p = exp256(_mm256_sub_ps(_mm256_load_ps(sc + j0), m));
    if (n - j0 < kW8)
      p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j0)), iota)));
    _mm256_store_ps(sc + j0, p);
    if ((j0 / kW8) % 2 == 0) lo = _mm256_add_ps(lo, p);
    else hi = _mm256_add_ps(hi, p);
  }
  alignas(32) float parts[kLanes];
  _mm256_store_ps(parts, lo);
  _mm256_store_ps(parts + kW8, hi);
  return 1.0f / tree16(parts);
}

// pv512's sum for K vectors of dimensions (at vf, acc; rows dim apart)
template <int K, int NV>
ARGOSY_ATTN256 inline void pv256(const float* p, int64_t p_stride, const float* vf, int64_t dim, const int64_t* len,
                                 int64_t j0, float* acc) {
  int64_t count[NV], lo = kChunk, hi = 0;
  for (int v = 0; v < NV; ++v) {
    count[v] = std::clamp<int64_t>(len[v] - j0, 0, kChunk);
    lo = std::min(lo, count[v]);
    hi = std::max(hi, count[v]);
  }
  if (hi == 0) return;
  __m256 ac[NV][K];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) ac[v][k] = _mm256_load_ps(acc + v * dim + k * kW8);
  for (int64_t i = 0; i < lo; ++i) {
    __m256 vv[K];
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) vv[k] = _mm256_load_ps(vf + i * dim + k * kW8);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m256 pb = _mm256_broadcast_ss(p + v * p_stride + i);
#pragma GCC unroll 4
      for (int k = 0; k < K; ++k) ac[v][k] = _mm256_fmadd_ps(pb, vv[k], ac[v][k]);
    }
  }
  for (int64_t i = lo; i < hi; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (i >= count[v]) continue;
      const __m256 pb = _mm256_broadcast_ss(p + v * p_stride + i);
#pragma GCC unroll 4
      for (int k = 0; k < K; ++k) ac[v][k] = _mm256_fmadd_ps(pb, _mm256_load_ps(vf + i * dim + k * kW8), ac[v][k]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) _mm256_store_ps(acc + v * dim + k * kW8, ac[v][k]);
}

template <int K, int NV>
ARGOSY_ATTN256 inline void pv256_up_to(int64_t nv, const float* p, int64_t p_stride, const float* vf, int64_t dim,
                                       const int64_t* len, int64_t j0, float* acc) {
  if constexpr (NV > 1)
    if (nv < NV) return pv256_up_to<K, NV - 1>(nv, p, p_stride, vf, dim, len, j0, acc);
  pv256<K, NV>(p, p_stride, vf, dim, len, j0, acc);
}

template <int C>
ARGOSY_ATTN256 void widen256(const float* src, float* dst) {  // q into aligned scratch
  for (int c = 0; c < 2 * C; ++c) _mm256_store_ps(dst + c * kW8, _mm256_loadu_ps(src + c * kW8));
}

// scores512's, 8 positions a vector: two blocks for a pair, or (head dim 128 up) two pairs a block
template <int C>
ARGOSY_ATTN256 void scores256(int64_t count, const float* q, int64_t q_stride, const float* kt, float* out,
                              int64_t out_stride, int64_t blocks, float scale) {
  int64_t rg = 0;
  if constexpr (C >= 8)
    for (; rg + 2 <= count; rg += 2)
      for (int64_t b = 0; b < 2 * blocks; ++b)
        qk256<C, 1, 2>(q + rg * q_stride, q_stride, kt + b * kW8, out + rg * out_stride + b * kW8, out_stride, scale);
  for (; rg < count; ++rg)
    for (int64_t b = 0; b < blocks; ++b)
      qk256<C, 2, 1>(q + rg * q_stride, 0, kt + b * kLanes, out + rg * out_stride + b * kLanes, 0, scale);
}

// 32 dimensions at a time (16 for the last of an odd C), 3 (or 4) pairs sharing each V load
template <int C>
ARGOSY_ATTN256 void values256(int64_t count, const float* p, int64_t p_stride, const float* vf, const int64_t* len,
                              int64_t j0, float* acc) {
  constexpr int64_t dim = C * kLanes;
  for (int64_t d0 = 0; d0 < dim; d0 += 4 * kW8) {
    if (dim - d0 >= 4 * kW8)
      for (int64_t rg = 0; rg < count; rg += 3)
        pv256_up_to<4, 3>(count - rg, p + rg * p_stride, p_stride, vf + d0, dim, len + rg, j0, acc + rg * dim + d0);
    else
      for (int64_t rg = 0; rg < count; rg += 4)
        pv256_up_to<2, 4>(count - rg, p + rg * p_stride, p_stride, vf + d0, dim, len + rg, j0, acc + rg * dim + d0);
  }
}

// -- a tile, either path --

template <int C>
struct Avx512 {
  static constexpr auto widen = widen512<C>;
  static constexpr auto chunk = chunk512<C>;
  static constexpr auto scores = scores512<C>;
  static constexpr auto softmax = softmax512;
  static constexpr auto values = values512<C>;
};

template <int C>
struct Avx2 {
  static constexpr auto widen = widen256<C>;
  static constexpr auto chunk = chunk256<C>;
  static constexpr auto scores = scores256<C>;
  static constexpr auto softmax = softmax256;
  static constexpr auto values = values256<C>;
};

// rows [r0, r1) sharing a table, kv head h, as (row, query head) pairs rg = (r - r0) * group + g:
// the scores of every pair chunk by chunk, each pair's softmax, then the weighted sums chunk by chunk
template <class Path, int C>
void tile(const Rows& a, const Tile& t) {
  constexpr int64_t dim = C * kLanes;
  const int64_t group = a.heads / a.kv_heads, count = (t.r1 - t.r0) * group;
  Scratch& s = scratch();
  s.lens.resize(static_cast<size_t>(count));
  s.starts.resize(static_cast<size_t>(count));
  int64_t* len = s.lens.data();
  int64_t* start = s.starts.data();
  const int64_t n_max = tile_lens(a, t, group, len, start);
  const int64_t chunks = (n_max + kChunk - 1) / kChunk, padded = chunks * kChunk;
  float* qf = s.q.get(count * dim);
  float* sc = s.scores.get(count * padded);
  float* acc = s.acc.get(count * dim);
  float* inv = s.inv.get(count);
  float* own = t.shared == nullptr ? s.chunk.get(kChunk * dim) : nullptr;  // K^T, then V
  for (int64_t rg = 0; rg < count; ++rg) Path::widen(q_row(a, t, group, rg), qf + rg * dim);
  // a sliding window: the chunks wholly before every pair's window are skipped (their p would
  // be 0, and fma(0, v, acc) = acc: the same bits, without reading the context the window hides)
  const int64_t first = first_chunk(start, count);
  for (int64_t ch = first; ch < chunks; ++ch) {
    const int64_t j0 = ch * kChunk, n = std::min(kChunk, n_max - j0);
    const float* kt = own;
    if (own != nullptr) Path::chunk(a, t.table, t.h, j0, n, own, nullptr);
    else kt = t.shared + ch * 2 * kChunk * dim;
    Path::scores(count, qf, dim, kt, sc + j0, padded, (n + kLanes - 1) / kLanes, a.scale);
  }
  for (int64_t rg = 0; rg < count; ++rg)
    inv[rg] = windowed_softmax(Path::softmax, sc + rg * padded, start[rg], len[rg], s.window);
  std::fill(acc, acc + count * dim, 0.0f);
  for (int64_t ch = first; ch < chunks; ++ch) {
    const int64_t j0 = ch * kChunk;
    const float* vf = own;
    if (own != nullptr) Path::chunk(a, t.table, t.h, j0, std::min(kChunk, n_max - j0), nullptr, own);
    else vf = t.shared + ch * 2 * kChunk * dim + kChunk * dim;
    Path::values(count, sc + j0, padded, vf, len, j0, acc);
  }
  for (int64_t rg = 0; rg < count; ++rg) store_row(a, t, group, rg, acc + rg * dim, inv[rg], len[rg] - start[rg]);
}

using TileFn = void (*)(const Rows&, const Tile&);
using ChunkFn = void (*)(const Rows&, const int64_t*, int64_t, int64_t, int64_t, float*, float*);

struct Kernels {
  TileFn tile = nullptr;
  ChunkFn chunk = nullptr;
};

template <template <int> class Path, int C>
Kernels kernels() {
  return {tile<Path<C>, C>, Path<C>::chunk};
}

// the vector kernels of `path` for head dim `dim` (16 .. 128, 256), or none (then the scalar statement)
template <template <int> class Path>
Kernels pick_dim(int64_t dim) {
  switch (dim) {
    case 16: return kernels<Path, 1>();
    case 32: return kernels<Path, 2>();
    case 48: return kernels<Path, 3>();
    case 64: return kernels<Path, 4>();
    case 80: return kernels<Path, 5>();
    case 96: return kernels<Path, 6>();
    case 112: return kernels<Path, 7>();
    case 128: return kernels<Path, 8>();
    case 256: return kernels<Path, 16>();  // Gemma 3
    default: return {};
  }
}

inline Kernels pick(int64_t path, int64_t dim) {
  if (path >= kAvx512) return pick_dim<Avx512>(dim);
  if (path == kAvx2) return pick_dim<Avx2>(dim);
  return {};
}

// f(t) for t in [0, count) over the threads, each taking the next task when it is free
template <class F>
void run_tasks(int64_t count, const F& f) {
  if (count <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(count, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < count; t = next.fetch_add(1)) f(t);
  });
}

}  // namespace attn

// one row of one KV head (dim fp32 values) into an int8 cache row: codes, then a float16 scale
// per 32 (the header's rule)
void quantize_kv_row(const float* x, int64_t dim, int8_t* dst) {
  for (int64_t g = 0; g < dim / attn::kQ8Group; ++g) {
    const float* v = x + g * attn::kQ8Group;
    float amax = 0.0f;
    for (int64_t i = 0; i < attn::kQ8Group; ++i) amax = std::max(amax, std::fabs(v[i]));
    const uint16_t d = c10::detail::fp16_ieee_from_fp32_value(amax / 127.0f);
    const float df = half_to_float(d);
    for (int64_t i = 0; i < attn::kQ8Group; ++i) {
      const float code = df > 0.0f ? std::nearbyint(v[i] / df) : 0.0f;
      dst[g * attn::kQ8Group + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
    }
    std::memcpy(dst + dim + 2 * g, &d, 2);
  }
}

bool int8_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar;
}

// each row's K and V (fp16 [T, KVH, D]; float32 for int8 caches) at its slot of the caches
void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                const at::Tensor& slots) {
  if (int8_caches(k_cache, v_cache)) {
    TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == at::kFloat &&
                    v.scalar_type() == at::kFloat,
                "write_kv: float32 k and v for int8 caches");
    const int64_t kv_heads = k.size(1), dim = k.size(2), width = dim + dim / 16;
    TORCH_CHECK(dim % attn::kQ8Group == 0 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    k_cache.dim() == 3 && k_cache.size(1) == kv_heads && k_cache.size(2) == width &&
                    v_cache.sizes() == k_cache.sizes(),
                "write_kv: int8 caches [slots, KV heads, dim + dim / 16] for k's dim, a multiple of 32");
    TORCH_CHECK(slots.numel() == k.size(0), "write_kv: one slot a row");
    auto kc = k.contiguous();
    auto vc = v.contiguous();
    auto sc = slots.to(at::kLong).contiguous();
    const int64_t num_slots = k_cache.size(0);
    for (int64_t r = 0; r < k.size(0); ++r) {
      const int64_t slot = sc.data_ptr<int64_t>()[r];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot out of range");
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t src = (r * kv_heads + h) * dim, dst = (slot * kv_heads + h) * width;
        quantize_kv_row(kc.data_ptr<float>() + src, dim, k_cache.data_ptr<int8_t>() + dst);
        quantize_kv_row(vc.data_ptr<float>() + src, dim, v_cache.data_ptr<int8_t>() + dst);
      }
    }
    return;
  }
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf &&
                  k_cache.scalar_type() == at::kHalf && v_cache.scalar_type() == at::kHalf,
              "write_kv: float16 k, v and caches (or float32 k, v and int8 caches)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2) && v_cache.sizes() == k_cache.sizes(),
              "write_kv: caches [slots, KV heads, dim] like k");
  TORCH_CHECK(slots.numel() == k.size(0), "write_kv: one slot a row");
  auto kc = k.contiguous();
  auto vc = v.contiguous();
  auto sc = slots.to(at::kLong).contiguous();
  const int64_t rows = k.size(0), row_bytes = k.size(1) * k.size(2) * 2, num_slots = k_cache.size(0);
  auto* kdst = static_cast<char*>(k_cache.data_ptr());
  auto* vdst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = sc.data_ptr<int64_t>()[r];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot out of range");
    std::memcpy(kdst + slot * row_bytes, static_cast<const char*>(kc.data_ptr()) + r * row_bytes, row_bytes);
    std::memcpy(vdst + slot * row_bytes, static_cast<const char*>(vc.data_ptr()) + r * row_bytes, row_bytes);
  }
}

// argosy_iq::write_kv: the attention op's first step alone (a step whose last layer attends for
// some of its rows writes every row's K/V first)
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  write_rows(k, v, k_cache, v_cache, slots);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_ids, const at::Tensor& mask,
                     int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attention: q, k, v must be [T, heads, D]");
  const bool q8 = int8_caches(k_cache, v_cache);
  TORCH_CHECK(q.scalar_type() == at::kFloat &&
                  (q8 ? k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat
                      : k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf && k_cache.scalar_type() == at::kHalf &&
                            v_cache.scalar_type() == at::kHalf),
              "attention: float32 q; float16 k, v and caches, or float32 k, v and int8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: caches must be contiguous");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && dim % attn::kLanes == 0 && (dim <= 128 || dim == 256),
              "attention: heads a multiple of KV heads, head dim a multiple of 16 up to 128, or 256");
  const int64_t row_width = q8 ? dim + dim / 16 : dim;
  TORCH_CHECK(k_cache.size(1) == kv_heads && k_cache.size(2) == row_width && (!q8 || dim % attn::kQ8Group == 0),
              "attention: cache shape");
  const int64_t ctx = mask.size(-1);
  TORCH_CHECK(ctx % block_size == 0 && block_ids.numel() == rows * (ctx / block_size),
              "attention: block table and mask disagree");
  auto qc = q.contiguous();
  auto bc = block_ids.to(at::kLong).contiguous();
  auto mc = mask.to(at::kBool).contiguous().view({rows, ctx});
  TORCH_CHECK(k.size(0) == rows, "attention: one K/V row a query row");
  write_rows(k, v, k_cache, v_cache, slots);
  const int64_t num_slots = k_cache.size(0);
  const int64_t max_blocks = ctx / block_size, num_blocks = num_slots / block_size;
  const int64_t* table = bc.data_ptr<int64_t>();
  for (int64_t i = 0; i < bc.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "attention: block id out of range");
  std::vector<int64_t> lens(static_cast<size_t>(rows)), starts(static_cast<size_t>(rows));
  const bool* m = mc.data_ptr<bool>();
  for (int64_t r = 0; r < rows; ++r) {  // the visible positions: one run, from the first true to the next false
    const bool* row = m + r * ctx;
    const void* first_true = std::memchr(row, 1, static_cast<size_t>(ctx));
    starts[r] = first_true == nullptr ? 0 : static_cast<const bool*>(first_true) - row;
    const void* next_false = std::memchr(row + starts[r], 0, static_cast<size_t>(ctx - starts[r]));
    lens[r] = next_false == nullptr ? ctx : static_cast<const bool*>(next_false) - row;
  }
  auto out = at::empty({rows, heads * dim}, q.options());
  attn::Rows a{qc.data_ptr<float>(),
               q8 ? nullptr : reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::Half>()),
               q8 ? nullptr : reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::Half>()),
               q8 ? k_cache.data_ptr<int8_t>() : nullptr,
               q8 ? v_cache.data_ptr<int8_t>() : nullptr,
               row_width,
               table,
               lens.data(),
               starts.data(),
               out.data_ptr<float>(),
               heads,
               kv_heads,
               dim,
               max_blocks,
               block_size,
               1.0f / std::sqrt(static_cast<float>(dim))};
  const int64_t group = heads / kv_heads;
  const attn::Kernels kernels = attn::pick(current_path(), dim);
  // runs of consecutive rows with the same block table, cut into tiles of about kTilePairs (row,
  // query head) pairs; a run of several tiles gets its K/V chunks made once (shared)
  const int64_t tile_rows = std::max<int64_t>(1, attn::kTilePairs / group);
  const int64_t chunk_floats = 2 * attn::kChunk * dim;
  struct Run {
    int64_t r0, r1, n, chunks, offset;  // n: its longest row's positions; offset: into the shared chunks (-1: none)
    int64_t first;                      // the first chunk a row of the run sees (a window: later than 0)
  };
  std::vector<Run> runs;
  int64_t shared_floats = 0;
  for (int64_t r = 0; r < rows;) {
    int64_t end = r + 1, n = lens[r];
    while (end < rows &&
           std::memcmp(table + end * max_blocks, table + r * max_blocks, max_blocks * sizeof(int64_t)) == 0)
      n = std::max(n, lens[end++]);
    const int64_t chunks = (n + attn::kChunk - 1) / attn::kChunk;
    const bool shared = kernels.tile != nullptr && end - r > tile_rows && chunks > 0;
    runs.push_back({r, end, n, chunks, shared ? shared_floats : -1, attn::first_chunk(starts.data() + r, end - r)});
    if (shared) shared_floats += kv_heads * chunks * chunk_floats;
    r = end;
  }
  attn::Buffer shared_buffer;  // this call's (a prefill of n positions: kv_heads * n * dim * 8 bytes)
  float* shared = shared_buffer.get(static_cast<size_t>(shared_floats));
  // the shared chunks: (run, kv head, chunk) tasks
  std::vector<std::array<int64_t, 3>> preps;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].offset >= 0)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t ch = runs[i].first; ch < runs[i].chunks; ++ch) preps.push_back({static_cast<int64_t>(i), h, ch});
  attn::run_tasks(static_cast<int64_t>(preps.size()), [&](int64_t t) {
    const auto [i, h, ch] = preps[t];
    const Run& run = runs[i];
    float* base = shared + run.offset + (h * run.chunks + ch) * chunk_floats;
    kernels.chunk(a, table + run.r0 * max_blocks, h, ch * attn::kChunk,
                  std::min(attn::kChunk, run.n - ch * attn::kChunk), base, base + attn::kChunk * dim);
  });
  // the tiles, each for one kv head; the longest first, so the threads finish together
  struct Task {
    int64_t run, r0, r1, h, cost;
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < runs.size(); ++i)
    for (int64_t r0 = runs[i].r0; r0 < runs[i].r1; r0 += tile_rows) {
      const int64_t r1 = std::min(r0 + tile_rows, runs[i].r1);
      int64_t cost = 0;
      for (int64_t r = r0; r < r1; ++r) cost += lens[r] - starts[r] + 1;
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({static_cast<int64_t>(i), r0, r1, h, cost});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  attn::run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const Task& task = tasks[t];
    const Run& run = runs[task.run];
    if (kernels.tile == nullptr) return attn::attend_scalar(a, task.r0, task.r1, task.h);
    const float* chunks =
        run.offset >= 0 ? shared + run.offset + task.h * run.chunks * chunk_floats : nullptr;
    kernels.tile(a, {table + task.r0 * max_blocks, chunks, task.r0, task.r1, task.h});
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) {
  m.impl("attention", &attention);
  m.impl("write_kv", &write_kv);
}
