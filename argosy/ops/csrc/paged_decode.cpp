// Decode attention over the paged KV cache, one query token per row, for CPU.
//
// argosy_ext::paged_decode(q, k, v, k_cache!, v_cache!, slots, block_ids, mask, block_size)
// writes each row's new K/V at its slot, then attends its query heads over the positions its
// mask allows, reading K/V straight from the cache blocks (no gather copy). Same contract
// as the Python op argosy::paged_decode_attention in argosy/runner/compiled.py, which stays
// as the fallback; this one exists because that op's Python layer and its gather/SDPA
// dispatch cost ~100 us per layer at batch 1 (3 ms of an 11 ms step), for ~5 us of work.
//
// Shapes: q [B, H, D]; k, v [B, KVH, D]; k_cache, v_cache [slots, KVH, D] (contiguous);
// slots [B] int64; block_ids [B * max_blocks] int64; mask [B, 1, 1, max_blocks * block_size]
// bool. Returns [B, H * D] in q's dtype. Scores, softmax and the weighted sum are in fp32.
//
// With AVX-512 BF16 (this machine) a bf16 cache takes a vector path: q.k with the bf16-pair
// dot-product instruction, 16 positions reduced together, and the weighted sum of V with
// its accumulators in registers; other dtypes and CPUs take the plain loops (the compiler
// vectorises them). The build uses -march=native: the library is built per machine.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ARGOSY_AVX512_BF16 1
#include <immintrin.h>

// 16 vectors of 16 partial sums -> one vector whose lane i is the total of v[i]
inline __m512 reduce16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // lane-wise [a0 b0 a1 b1] + [a2 b2 a3 b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the 4 rows' sums over that lane
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[g * n + j] = scale * q_g . k_j for bf16 q and cache: the bf16 pairs' dot-product
// instruction on 16 positions at a time, reduced together (no per-position horizontal sum)
inline void bf16_scores(const at::BFloat16* q, const at::BFloat16* k_cache, const int64_t* slot_of, int64_t n,
                        int64_t group, int64_t dim, int64_t slot_stride, int64_t head_offset, float scale,
                        float* scores) {
  const int64_t chunks = dim / 32;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    __m512bh qv[8];
    for (int64_t c = 0; c < chunks; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * dim + c * 32);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t count = n - j0 < 16 ? n - j0 : 16;
      __m512 acc[16];
      for (int64_t jj = 0; jj < 16; ++jj) {
        acc[jj] = _mm512_setzero_ps();
        if (jj >= count) continue;
        const at::BFloat16* krow = k_cache + slot_of[j0 + jj] * slot_stride + head_offset;
        for (int64_t c = 0; c < chunks; ++c)
          acc[jj] = _mm512_dpbf16_ps(acc[jj], qv[c], (__m512bh)_mm512_loadu_si512(krow + c * 32));
      }
      const __m512 total = _mm512_mul_ps(reduce16(acc), scale_v);
      _mm512_mask_storeu_ps(scores + g * n + j0, static_cast<__mmask16>((1u << count) - 1u), total);
    }
  }
}

// acc[g * dim + d] = sum_j scores[g * n + j] * v_j[d], the accumulators held in registers
template <int G, int DC>
void bf16_weighted_sum(const at::BFloat16* v_cache, const int64_t* slot_of, int64_t n, const float* scores,
                       int64_t slot_stride, int64_t head_offset, float* acc_out) {
  __m512 acc[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* vrow = v_cache + slot_of[j] * slot_stride + head_offset;
    __m512 v[DC];
    for (int c = 0; c < DC; ++c)
      v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + c * 16))), 16));
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + j]);
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc_out + (g * DC + c) * 16, acc[g][c]);
}

using WeightedSum = void (*)(const at::BFloat16*, const int64_t*, int64_t, const float*, int64_t, int64_t, float*);

inline WeightedSum pick_weighted_sum(int64_t group, int64_t dim) {
  if (dim == 64) {
    switch (group) {
      case 1: return bf16_weighted_sum<1, 4>;
      case 2: return bf16_weighted_sum<2, 4>;
      case 3: return bf16_weighted_sum<3, 4>;
      case 4: return bf16_weighted_sum<4, 4>;
    }
  } else if (dim == 128) {
    switch (group) {
      case 1: return bf16_weighted_sum<1, 8>;
      case 2: return bf16_weighted_sum<2, 8>;
      case 3: return bf16_weighted_sum<3, 8>;
      case 4: return bf16_weighted_sum<4, 8>;
    }
  }
  return nullptr;
}
#endif

template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_ids,
            const bool* mask, scalar_t* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
            int64_t max_blocks, int64_t block_size) {
  const int64_t group = heads / kv_heads;
  const int64_t ctx = max_blocks * block_size;
  const int64_t slot_stride = kv_heads * dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const int64_t tasks = batch * kv_heads;
  [[maybe_unused]] const bool fast_bf16 = dim % 32 == 0 && dim <= 256;
#ifdef ARGOSY_AVX512_BF16
  const WeightedSum weighted_sum = pick_weighted_sum(group, dim);
#endif
  // small steps run on the calling thread: waking the pool costs more than the work
  int64_t visible = 0;
  for (int64_t i = 0; i < batch * ctx; ++i) visible += mask[i];
  const int64_t grain = visible * heads * dim < (1 << 18) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), scores;
    std::vector<int64_t> slot_of;
    scores.reserve(group * ctx);
    slot_of.reserve(ctx);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const bool* m = mask + b * ctx;
      const int64_t* table = block_ids + b * max_blocks;
      slot_of.clear();
      for (int64_t p = 0; p < ctx; ++p)
        if (m[p]) slot_of.push_back(table[p / block_size] * block_size + p % block_size);
      const int64_t n = static_cast<int64_t>(slot_of.size());
      scalar_t* dst = out + (b * heads + h * group) * dim;
      if (n == 0) {
        for (int64_t i = 0; i < group * dim; ++i) dst[i] = scalar_t(0.0f);
        continue;
      }
      scores.resize(group * n);
      bool scored = false;
#ifdef ARGOSY_AVX512_BF16
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        if (fast_bf16) {
          bf16_scores(q + (b * heads + h * group) * dim, k_cache, slot_of.data(), n, group, dim, slot_stride,
                      h * dim, scale, scores.data());
          scored = true;
        }
      }
#endif
      if (!scored) {
        to_float(q + (b * heads + h * group) * dim, qf.data(), group * dim);
        for (int64_t i = 0; i < group * dim; ++i) qf[i] *= scale;
        for (int64_t j = 0; j < n; ++j) {
          to_float(k_cache + slot_of[j] * slot_stride + h * dim, row.data(), dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
            scores[g * n + j] = s;
          }
        }
      }
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float mx = s[0];
        for (int64_t j = 1; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        inv_sum[g] = 1.0f / sum;
      }
      bool summed = false;
#ifdef ARGOSY_AVX512_BF16
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        if (weighted_sum != nullptr) {
          weighted_sum(v_cache, slot_of.data(), n, scores.data(), slot_stride, h * dim, acc.data());
          summed = true;
        }
      }
#endif
      if (!summed) std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < (summed ? 0 : n); ++j) {
        to_float(v_cache + slot_of[j] * slot_stride + h * dim, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) dst[g * dim + d] = scalar_t(acc[g * dim + d] * inv_sum[g]);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_ids,
                        const at::Tensor& mask, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "paged_decode: q, k, v must be [B, heads, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q, k, v and the caches must share a dtype");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "paged_decode: heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(1) == kv_heads && k_cache.size(2) == dim, "paged_decode: cache shape");
  const int64_t ctx = mask.size(-1);
  TORCH_CHECK(ctx % block_size == 0 && block_ids.numel() == batch * (ctx / block_size),
              "paged_decode: block table and mask disagree");
  auto qc = q.contiguous();
  auto kc = k.contiguous();
  auto vc = v.contiguous();
  auto sc = slots.to(at::kLong).contiguous();
  auto bc = block_ids.to(at::kLong).contiguous();
  auto mc = mask.to(at::kBool).contiguous();
  auto out = at::empty({batch, heads * dim}, q.options());
  const int64_t row_bytes = kv_heads * dim * static_cast<int64_t>(q.element_size());
  auto* kdst = static_cast<char*>(k_cache.data_ptr());
  auto* vdst = static_cast<char*>(v_cache.data_ptr());
  const int64_t num_slots = k_cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t slot = sc.data_ptr<int64_t>()[b];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "paged_decode: slot out of range");
    std::memcpy(kdst + slot * row_bytes, static_cast<const char*>(kc.data_ptr()) + b * row_bytes, row_bytes);
    std::memcpy(vdst + slot * row_bytes, static_cast<const char*>(vc.data_ptr()) + b * row_bytes, row_bytes);
  }
  const int64_t max_blocks = ctx / block_size;
  const int64_t num_blocks = num_slots / block_size;
  const int64_t* table = bc.data_ptr<int64_t>();
  for (int64_t i = 0; i < bc.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "paged_decode: block id out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    attend<scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), table,
                     mc.data_ptr<bool>(), out.data_ptr<scalar_t>(), batch, heads, kv_heads, dim, max_blocks,
                     block_size);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(argosy_ext, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "Tensor block_ids, Tensor mask, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(argosy_ext, CPU, m) { m.impl("paged_decode", &paged_decode); }
