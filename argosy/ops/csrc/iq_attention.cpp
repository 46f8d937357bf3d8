// Invariant attention: the same bits for a row whatever else is in the batch (see iq_common.h
// for the paths). Built with iq_linear.cpp into one library, torch.ops.argosy_iq.
// -- attention, the same for every row: decode rows, prefill rows, any chunk ---------------------
//
// argosy_iq::attention(q, k, v, k_cache!, v_cache!, slots, block_ids, mask, block_size): the
// contract of argosy_ext::paged_decode (csrc/paged_decode.cpp): each row's K/V is written at its
// slot first, then each row attends over the positions its mask row allows, which must be a
// prefix 0 .. n-1 of its sequence (a decode row: its context; a prefill row: up to itself). Per
// row, query head and position j < n, in fp32 (x_bf16 -> fp32 is exact):
//   s_j = tree16(lane l: fma over c of q[16c + l] * k_j[16c + l], c in order) * scale
//   m = max s_j;  p_j = exp_argosy(s_j - m);  l = tree16(lane i: sum over j = i mod 16, j in order)
//   out[d] = (fma over j in order of p_j * v_j[d]) * (1 / l), rounded to the output dtype
// tree16(a) = ((a0 + a2) + (a1 + a3)) + ((a4 + a6) + (a5 + a7)) + ... as the AVX-512 transpose
// reduction pairs them (tree16 in iq_common.h is its scalar statement) and exp_argosy uses only
// +, -, * and round-to-nearest (no fma), so the vector and scalar paths agree bit for bit. Rows
// of one sequence are taken a few at a time to share K/V loads; nothing a row computes depends
// on the others. Head dims that are multiples of 16 (64 and 128 here).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "iq_common.h"

namespace {

using namespace argosy_iq;

namespace attn {

constexpr int kLanes = 16;

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f;
constexpr float kC2 = -2.12194440e-4f;

inline float exp_scalar(float x) {  // x <= 0 here (s - max)
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kC1;
  r = r - n * kC2;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r;
  p = p + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

struct Rows {  // what every path needs of one call
  const uint16_t* q;        // bf16 [T, H, D]
  const uint16_t* k_cache;  // bf16 [slots, KVH, D]
  const uint16_t* v_cache;
  const int64_t* block_ids;  // [T, max_blocks]
  const int64_t* lens;       // [T]
  uint16_t* out;             // bf16 [T, H * D]
  int64_t heads, kv_heads, dim, max_blocks, block_size;
  float scale;
};

inline int64_t slot_at(const Rows& a, const int64_t* table, int64_t p) {
  return table[p / a.block_size] * a.block_size + p % a.block_size;
}

// rows [r0, r1) share a block table; kv head h: the scalar statement of the arithmetic
void attend_scalar(const Rows& a, int64_t r0, int64_t r1, int64_t h) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim, stride = a.kv_heads * dim;
  const int64_t* table = a.block_ids + r0 * a.max_blocks;
  std::vector<float> scores, acc(dim);
  float lanes[kLanes];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t n = a.lens[r];
    scores.assign(static_cast<size_t>(n), 0.0f);
    for (int64_t g = 0; g < group; ++g) {
      const uint16_t* q = a.q + (r * a.heads + h * group + g) * dim;
      uint16_t* dst = a.out + (r * a.heads + h * group + g) * dim;
      if (n == 0) {
        for (int64_t d = 0; d < dim; ++d) dst[d] = 0;
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* kr = a.k_cache + slot_at(a, table, j) * stride + h * dim;
        for (int l = 0; l < kLanes; ++l) {
          float s = 0.0f;
          for (int64_t c = 0; c < dim / kLanes; ++c)
            s = std::fma(bf16_to_float(q[c * kLanes + l]), bf16_to_float(kr[c * kLanes + l]), s);
          lanes[l] = s;
        }
        scores[j] = tree16(lanes) * a.scale;
      }
      float mx = scores[0];
      for (int64_t j = 1; j < n; ++j) mx = std::max(mx, scores[j]);
      float partial[kLanes] = {};
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = exp_scalar(scores[j] - mx);
        partial[j % kLanes] = partial[j % kLanes] + scores[j];
      }
      const float inv = 1.0f / tree16(partial);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* vr = a.v_cache + slot_at(a, table, j) * stride + h * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] = std::fma(scores[j], bf16_to_float(vr[d]), acc[d]);
      }
      for (int64_t d = 0; d < dim; ++d) dst[d] = float_to_bf16(acc[d] * inv);
    }
  }
}

#define ARGOSY_ATTN512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

ARGOSY_ATTN512 inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 vectors -> lane i = tree16(v[i]) (the transpose reduction of csrc/paged_decode.cpp)
ARGOSY_ATTN512 inline __m512 reduce16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

ARGOSY_ATTN512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(kC1)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(kC2)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

constexpr int kMaxGroup = 8;   // query heads per KV head the vector path takes (else scalar)
constexpr int kTileRows = 2;   // rows sharing each K/V load (their q and sums held in registers)

// rows [r0, r1) (at most kTileRows) share a block table; kv head h. R rows, G query heads per
// KV head, C chunks of 16 in the head dim: compile-time, so q and the sums stay in registers.
template <int R, int G, int C>
ARGOSY_ATTN512 void attend_block(const Rows& a, int64_t r0, int64_t h) {
  const int64_t dim = C * kLanes, stride = a.kv_heads * dim;
  const int64_t* table = a.block_ids + r0 * a.max_blocks;
  int64_t lens[R], n_max = 0;
  for (int r = 0; r < R; ++r) n_max = std::max(n_max, lens[r] = a.lens[r0 + r]);
  std::vector<int64_t> slot(static_cast<size_t>(n_max));
  for (int64_t j = 0; j < n_max; ++j) slot[j] = slot_at(a, table, j) * stride + h * dim;
  const int64_t padded = (n_max + kLanes - 1) / kLanes * kLanes;
  std::vector<float> scores(static_cast<size_t>(R * G * padded));
  __m512 qv[R][G][C];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) qv[r][g][c] = load_bf16(a.q + ((r0 + r) * a.heads + h * G + g) * dim + c * kLanes);
  // scores, 16 positions at a time: each position's 16 lanes, then the transpose reduction
  alignas(64) __m512 lanes[R * G][kLanes];
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < n_max; j0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n_max - j0);
    for (int64_t jj = 0; jj < kLanes; ++jj) {
      if (jj >= count) {
        for (int rg = 0; rg < R * G; ++rg) lanes[rg][jj] = _mm512_setzero_ps();
        continue;
      }
      const uint16_t* kr = a.k_cache + slot[j0 + jj];
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_bf16(kr + c * kLanes);
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_mul_ps(qv[r][g][0], kv[0]);  // exact: a bf16 product
          for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[r][g][c], kv[c], acc);
          lanes[r * G + g][jj] = acc;
        }
    }
    for (int rg = 0; rg < R * G; ++rg)
      _mm512_storeu_ps(scores.data() + rg * padded + j0, _mm512_mul_ps(reduce16(lanes[rg]), scale));
  }
  // softmax per row and head
  float inv[R][G];
  for (int r = 0; r < R; ++r) {
    const int64_t n = lens[r];
    for (int g = 0; g < G; ++g) {
      float* sc = scores.data() + (r * G + g) * padded;
      inv[r][g] = 0.0f;
      if (n == 0) continue;
      float mx = sc[0];
      for (int64_t j = 1; j < n; ++j) mx = std::max(mx, sc[j]);
      const __m512 m = _mm512_set1_ps(mx);
      __m512 partial = _mm512_setzero_ps();
      for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
        const __mmask16 valid = static_cast<__mmask16>(n - j0 >= kLanes ? 0xffff : (1u << (n - j0)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j0), m)));
        _mm512_storeu_ps(sc + j0, p);  // lanes past n: 0, never read
        partial = _mm512_add_ps(partial, p);
      }
      alignas(64) float parts[kLanes];
      _mm512_store_ps(parts, partial);
      inv[r][g] = 1.0f / tree16(parts);
    }
  }
  // the weighted sum of V: each V row loaded once for every row and head of the block
  __m512 acc[R][G][C];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[r][g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n_max; ++j) {
    const uint16_t* vr = a.v_cache + slot[j];
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_bf16(vr + c * kLanes);
    for (int r = 0; r < R; ++r) {
      if (j >= lens[r]) continue;
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(scores[(r * G + g) * padded + j]);
        for (int c = 0; c < C; ++c) acc[r][g][c] = _mm512_fmadd_ps(pj, vv[c], acc[r][g][c]);
      }
    }
  }
  alignas(64) float values[kLanes];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      uint16_t* dst = a.out + ((r0 + r) * a.heads + h * G + g) * dim;
      const __m512 iv = _mm512_set1_ps(inv[r][g]);
      for (int c = 0; c < C; ++c) {
        _mm512_store_ps(values, _mm512_mul_ps(acc[r][g][c], iv));
        for (int l = 0; l < kLanes; ++l) dst[c * kLanes + l] = float_to_bf16(values[l]);
      }
    }
}

using Block = void (*)(const Rows&, int64_t, int64_t);

template <int R, int C>
Block pick_group(int64_t group) {
  switch (group) {
    case 1: return attend_block<R, 1, C>;
    case 2: return attend_block<R, 2, C>;
    case 3: return attend_block<R, 3, C>;
    case 4: return attend_block<R, 4, C>;
    case 5: return attend_block<R, 5, C>;
    case 6: return attend_block<R, 6, C>;
    case 7: return attend_block<R, 7, C>;
    case 8: return attend_block<R, 8, C>;
    default: return nullptr;
  }
}

// the vector block for `rows` rows (1 or 2), or nullptr (then the scalar statement)
inline Block pick_block(int64_t rows, int64_t group, int64_t dim) {
  if (dim == 64) return rows == 2 ? pick_group<2, 4>(group) : pick_group<1, 4>(group);
  if (dim == 128) return rows == 2 ? pick_group<2, 8>(group) : pick_group<1, 8>(group);
  return nullptr;
}

}  // namespace attn

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_ids, const at::Tensor& mask,
                     int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attention: q, k, v must be [T, heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "attention: bfloat16 q, k, v and caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: caches must be contiguous");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && dim % attn::kLanes == 0 && dim <= 128,
              "attention: heads a multiple of KV heads, head dim a multiple of 16 up to 128");
  TORCH_CHECK(k_cache.size(1) == kv_heads && k_cache.size(2) == dim, "attention: cache shape");
  const int64_t ctx = mask.size(-1);
  TORCH_CHECK(ctx % block_size == 0 && block_ids.numel() == rows * (ctx / block_size),
              "attention: block table and mask disagree");
  auto qc = q.contiguous();
  auto kc = k.contiguous();
  auto vc = v.contiguous();
  auto sc = slots.to(at::kLong).contiguous();
  auto bc = block_ids.to(at::kLong).contiguous();
  auto mc = mask.to(at::kBool).contiguous().view({rows, ctx});
  const int64_t row_bytes = kv_heads * dim * 2, num_slots = k_cache.size(0);
  auto* kdst = static_cast<char*>(k_cache.data_ptr());
  auto* vdst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = sc.data_ptr<int64_t>()[r];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "attention: slot out of range");
    std::memcpy(kdst + slot * row_bytes, static_cast<const char*>(kc.data_ptr()) + r * row_bytes, row_bytes);
    std::memcpy(vdst + slot * row_bytes, static_cast<const char*>(vc.data_ptr()) + r * row_bytes, row_bytes);
  }
  const int64_t max_blocks = ctx / block_size, num_blocks = num_slots / block_size;
  const int64_t* table = bc.data_ptr<int64_t>();
  for (int64_t i = 0; i < bc.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "attention: block id out of range");
  std::vector<int64_t> lens(static_cast<size_t>(rows));
  const bool* m = mc.data_ptr<bool>();
  for (int64_t r = 0; r < rows; ++r) {  // the visible positions: a prefix
    int64_t n = 0;
    while (n < ctx && m[r * ctx + n]) ++n;
    lens[r] = n;
  }
  auto out = at::empty({rows, heads * dim}, q.options());
  attn::Rows a{reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
               table,
               lens.data(),
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
               heads,
               kv_heads,
               dim,
               max_blocks,
               block_size,
               1.0f / std::sqrt(static_cast<float>(dim))};
  // tiles: up to kTileRows consecutive rows with the same block table
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t r = 0; r < rows;) {
    int64_t end = r + 1;
    while (end < rows && end - r < attn::kTileRows &&
           std::memcmp(table + end * max_blocks, table + r * max_blocks, max_blocks * sizeof(int64_t)) == 0)
      ++end;
    tiles.emplace_back(r, end);
    r = end;
  }
  const bool vector = current_path() >= kAvx512;
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * kv_heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [r0, r1] = tiles[t / kv_heads];
      const attn::Block block = vector ? attn::pick_block(r1 - r0, heads / kv_heads, dim) : nullptr;
      if (block != nullptr)
        block(a, r0, t % kv_heads);
      else
        attn::attend_scalar(a, r0, r1, t % kv_heads);
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) { m.impl("attention", &attention); }
