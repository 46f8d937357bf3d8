// Invariant GeGLU (Gemma's feed-forward activation): the same bits for a value whatever else is
// in the call, on every path, in the eager step and the compiled one alike (the compiler cannot
// see into the op). Built with iq_linear.cpp into torch.ops.argosy_iq.
//
// argosy_iq::geglu(gate_up [T, 2I] bf16 or fp32) -> [T, I] of its dtype: with g the first half of
// a row and u the second, out = gelu_tanh(g) * u, computed per value in fp32 and rounded once
// (bf16: round-half-even), as one statement in +, -, *, / and exp_argosy (iq_exp.h), no fma:
//   v = 0.7978845608 * (g + 0.044715 * ((g * g) * g));  e = exp_argosy(-(|v| + |v|))
//   t = (1 - e) / (1 + e) with v's sign (tanh v);  out = ((0.5 * g) * (1 + t)) * u
// aten's gelu (tanh) then a product in bf16 rounds twice; this rounds once, and its tanh is
// within a few fp32 ulps of libm's (tests/unit/test_invariant_kernels.py). One pass over the
// values instead of aten's three (gelu, its bf16 copy, the product) in the eager prefill.
//
// argosy_iq::swiglu(gate_up) -> [T, I]: the same for SwiGLU (Llama's, Qwen's, SmolLM's
// feed-forward): out = silu(g) * u, its statement in iq_swiglu.h. aten's silu of
// the strided gate half then the product, bf16 [1,000, 2 x 8,960] (the 1.5B's prefill chunk):
// 3.7-5.7 ms, this op 2.3 (AVX-512 EPYC, 2 threads): a few % of the prefill.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "iq_common.h"
#include "iq_exp.h"
#include "iq_swiglu.h"

namespace {

using namespace argosy_iq;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

inline float geglu_scalar(float g, float u) {
  const float v = kSqrt2OverPi * (g + kCubic * ((g * g) * g));
  const float a = std::fabs(v);
  const float e = exp_scalar(-(a + a));
  const float t = std::copysign((1.0f - e) / (1.0f + e), v);
  return ((0.5f * g) * (1.0f + t)) * u;
}

#define ARGOSY_GEGLU512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ARGOSY_GEGLU256 __attribute__((target("avx2,fma,f16c")))

ARGOSY_GEGLU512 inline __m512 geglu512(__m512 g, __m512 u) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 v = _mm512_mul_ps(_mm512_set1_ps(kSqrt2OverPi), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kCubic), g3)));
  const __m512i v_bits = _mm512_castps_si512(v);
  const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, v_bits));
  const __m512 e = exp512(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_add_ps(a, a)), sign)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 mag = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), _mm512_and_si512(v_bits, sign)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, t)), u);
}

ARGOSY_GEGLU256 inline __m256 geglu256(__m256 g, __m256 u) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 v = _mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kCubic), g3)));
  const __m256 a = _mm256_andnot_ps(sign, v);
  const __m256 e = exp256(_mm256_xor_ps(_mm256_add_ps(a, a), sign));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 mag = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 t = _mm256_or_ps(mag, _mm256_and_ps(v, sign));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t)), u);
}

// the activations, each on 1, 8 or 16 values with the same operations
struct Geglu {
  static float one(float g, float u) { return geglu_scalar(g, u); }
  ARGOSY_GEGLU256 static __m256 eight(__m256 g, __m256 u) { return geglu256(g, u); }
  ARGOSY_GEGLU512 static __m512 sixteen(__m512 g, __m512 u) { return geglu512(g, u); }
};

struct Swiglu {
  static float one(float g, float u) { return swiglu_scalar(g, u); }
  ARGOSY_GEGLU256 static __m256 eight(__m256 g, __m256 u) { return swiglu256(g, u); }
  ARGOSY_GEGLU512 static __m512 sixteen(__m512 g, __m512 u) { return swiglu512(g, u); }
};

template <typename T>
inline float load1(const T* p);
template <>
inline float load1(const float* p) { return *p; }
template <>
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }

inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }

ARGOSY_GEGLU512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
ARGOSY_GEGLU512 inline __m512 load16(const uint16_t* p) { return load16_bf16(p); }
ARGOSY_GEGLU512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
ARGOSY_GEGLU512 inline void store16(uint16_t* p, __m512 v) {
  alignas(64) float values[16];
  _mm512_store_ps(values, v);
  bf16_16(values, p);
}

ARGOSY_GEGLU256 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
ARGOSY_GEGLU256 inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// one row's values [i0, i1): the vector paths take 16 or 8 at a time, the rest one at a time
template <typename Act, typename T>
ARGOSY_GEGLU512 void row512(const T* g, const T* u, T* out, int64_t n, bool stream) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>)
    if (stream)  // out + i at 64-byte boundaries (see run)
      for (; i + 16 <= n; i += 16) _mm512_stream_ps(out + i, Act::sixteen(load16(g + i), load16(u + i)));
  for (; i + 16 <= n; i += 16) store16(out + i, Act::sixteen(load16(g + i), load16(u + i)));
  for (; i < n; ++i) store1(out + i, Act::one(load1(g + i), load1(u + i)));
}

template <typename Act, typename T>
ARGOSY_GEGLU256 void row256(const T* g, const T* u, T* out, int64_t n) {
  int64_t i = 0;
  alignas(32) float values[8];
  for (; i + 8 <= n; i += 8) {
    _mm256_store_ps(values, Act::eight(load8(g + i), load8(u + i)));
    for (int l = 0; l < 8; ++l) store1(out + i + l, values[l]);
  }
  for (; i < n; ++i) store1(out + i, Act::one(load1(g + i), load1(u + i)));
}

template <typename Act, typename T>
void row_scalar(const T* g, const T* u, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store1(out + i, Act::one(load1(g + i), load1(u + i)));
}

template <typename Act, typename T>
void run(const T* in, T* out, int64_t rows, int64_t inter, int64_t path) {
  const int64_t chunk = 1024;  // values a task: rows are cut into chunks, each value on its own
  const int64_t per_row = (inter + chunk - 1) / chunk;
  // a prefill's output (tens of MB) by non-temporal stores, which skip reading each line before
  // filling it; a decode step's (small, read next from cache) by ordinary ones. The 1.5B's
  // 1,000-token prefill: 5.0 -> 3.9 ms a layer
  const bool stream = std::is_same_v<T, float> && path >= kAvx512 && rows * inter >= (int64_t{1} << 20) &&
                      reinterpret_cast<uintptr_t>(out) % 64 == 0 && inter % 16 == 0;
  at::parallel_for(0, rows * per_row, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / per_row, i0 = (task % per_row) * chunk, n = std::min(chunk, inter - i0);
      const T* g = in + r * 2 * inter + i0;
      T* o = out + r * inter + i0;
      if (path >= kAvx512)
        row512<Act>(g, g + inter, o, n, stream);
      else if (path == kAvx2)
        row256<Act>(g, g + inter, o, n);
      else
        row_scalar<Act>(g, g + inter, o, n);
    }
    if (stream) _mm_sfence();  // the streamed stores done before the threads join
  });
}

template <typename Act>
at::Tensor gated(const at::Tensor& gate_up, const char* op) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0 &&
                  (gate_up.scalar_type() == at::kBFloat16 || gate_up.scalar_type() == at::kFloat),
              op, ": gate_up must be a contiguous [rows, 2 * intermediate] bfloat16 or float32 tensor");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, path = current_path();
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  if (rows == 0 || inter == 0) return out;
  if (gate_up.scalar_type() == at::kFloat)
    run<Act>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter, path);
  else
    run<Act>(reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()),
             reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), rows, inter, path);
  return out;
}

}  // namespace

void argosy_iq::swiglu_rows(const float* gate_up, float* out, int64_t rows, int64_t inter, int64_t path) {
  run<Swiglu>(gate_up, out, rows, inter, path);
}

namespace {

at::Tensor geglu(const at::Tensor& gate_up) { return gated<Geglu>(gate_up, "geglu"); }
at::Tensor swiglu(const at::Tensor& gate_up) { return gated<Swiglu>(gate_up, "swiglu"); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(argosy_iq, m) {
  m.def("geglu(Tensor gate_up) -> Tensor");
  m.def("swiglu(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(argosy_iq, CPU, m) {
  m.impl("geglu", &geglu);
  m.impl("swiglu", &swiglu);
}
