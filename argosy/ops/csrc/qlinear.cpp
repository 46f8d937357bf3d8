// Weight-only quantized linear layers for few rows (decode steps), AVX-512 BF16.
//
// argosy_ext::q4_linear(x, codes, scales, mins, out_features): GGUF Q4_0/Q4_1 weights,
//   w[n, k] = d[n, g] * q[n, k] + m[n, g] for the group g = k / 32 (the file's own codes,
//   scales and minimums; Q4_0 is m = -8 d).
// argosy_ext::q8_linear(x, codes, scales, out_features): int8 per output channel,
//   w[n, k] = s[n] * q[n, k].
//
// x is [M, K] bfloat16; the result is [M, N] bfloat16. Products are exact (bf16 x small
// integer) and everything is summed in fp32, the scale applied per group (Q4) or per
// channel (Q8) after its dot product: no rounding of the weights to bf16 on the way.
//
// Why: torch's int4 kernel dequantizes each weight once per row (8 rows cost 2.6x one row)
// and the bf16 weights of the float layers are 3.6x the bytes; here a weight is unpacked
// once for up to 8 rows (more rows: once per 8), and the rows' dot products share it.
//
// Layouts (built by argosy/models/quantized_linear.py), 16 outputs to a tile t:
//   Q4 codes  uint8 [N/16, K/32, 16, 16]: [t, g, j, i] = q[16t+i, 32g+2j] | q[16t+i, 32g+2j+1] << 4
//   Q4 scales, mins float16 [N/16, K/32, 16]: [t, g, i] = d (m) of row 16t+i, group g (the
//     file's own fp16 values)
//   Q8 codes  int8 [N/16, K/2, 16, 2]: [t, j, i, p] = q[16t+i, 2j+p]
//   Q8 scales float32 [N]
// so one 16-byte (Q4) or 32-byte (Q8) load holds the weight pairs (k = 2j, 2j+1) of 16
// outputs, which the bf16-pair dot-product instruction multiplies by a broadcast x pair:
// each of the 16 fp32 lanes accumulates one output, no horizontal sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)
#define ARGOSY_QLINEAR 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kGroup = 32;
constexpr int kMaxRowsPerPass = 16;

#ifdef ARGOSY_QLINEAR
// Linux hands out AMX tile state only on request, once per process
bool request_amx() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

bool qlinear_available() {
#ifdef ARGOSY_QLINEAR
  static const bool granted = request_amx();
  return granted;
#else
  return false;
#endif
}

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "qlinear: x must be a contiguous [rows, in_features] bfloat16 tensor");
  TORCH_CHECK(x.size(1) == k, "qlinear: x has ", x.size(1), " features, the weight ", k);
}

#ifdef ARGOSY_QLINEAR

// GCC's tile intrinsics are asm statements that name only the pointer: without a memory
// barrier it may move the vector stores a tile load reads, or the loads of what a tile store
// wrote, across them.
#define ARGOSY_MEMORY_BARRIER() asm volatile("" : : : "memory")

// AMX tiles: 0 and 3 results (rows x 16 fp32), 1 and 4 x (rows x 32 bf16), 2 and 5 weights
// (16 pairs of k x 16 outputs); two of each so one group's tiles fill while the other's
// are in use
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t : {0, 1, 3, 4}) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t : {2, 5}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC does not see ldtilecfg read the struct and drops the stores above without this
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// 16 pairs (one group of 32 k) of a Q4 tile -> 16 rows of bf16 pairs, exact small integers
inline void unpack_q4(const uint8_t* codes, uint16_t* dst) {
  // bf16 of 0..15 in the first 16 words: vpermw turns 4-bit codes into exact bf16 values
  alignas(64) static const uint16_t kTable[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                                  0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    // output i's byte (lo nibble = k even, hi = k odd) -> words 2i, 2i+1
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * j)));
    const __m512i w = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8);  // (v | v<<12) & mask
    _mm512_store_si512(dst + 32 * j, _mm512_permutexvar_epi16(w, table));
  }
}

// 16 pairs of a Q8 tile -> 16 rows of bf16 pairs (|q| <= 127: exact in bf16)
inline void unpack_q8(const int8_t* codes, uint16_t* dst) {
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const int8_t* c = codes + 32 * j;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
    _mm512_store_si512(dst + 32 * j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

inline void store_row(const __m512 acc, at::BFloat16* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc)));
}

// One group's exact dot products into result tile C (x on tile A, the unpacked codes on B).
// Macros, not templates: GCC's tile intrinsics take the tile number as a literal.
#define ARGOSY_Q4_GROUP_DOT(C, A, B, codes, x, k, w) \
  do {                                               \
    unpack_q4(codes, w);                             \
    ARGOSY_MEMORY_BARRIER();                         \
    _tile_loadd(B, w, 64);                           \
    _tile_loadd(A, x, (k) * 2);                      \
    _tile_zero(C);                                   \
    _tile_dpbf16ps(C, A, B);                         \
  } while (0)

// One tile (16 outputs) x R rows of a Q4 layer: per group, the exact dot products of x with
// the codes (AMX), then acc += d * dot + m * sum(x) in fp32. Two groups at a time, on
// alternating tiles and buffers, so one group's unpacking overlaps the other's AMX work.
// (Unpacking all groups first, then all AMX work, then all scaling measured slower.)
template <int R>
inline void q4_tile(const uint16_t* x, int64_t k, const float* sx, int64_t groups, const uint8_t* codes,
                    const uint16_t* scales, const uint16_t* mins, at::BFloat16* out, int64_t ldo) {
  alignas(64) uint16_t w[2][16 * 32];
  alignas(64) float dots[2][R * 16];
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  auto apply = [&](int64_t g, const float* dot) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kTile)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * kTile)));
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_load_ps(dot + 16 * m), d, acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[m * groups + g]), acc[m]);
    }
  };
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    ARGOSY_Q4_GROUP_DOT(0, 1, 2, codes + g * 256, x + g * kGroup, k, w[0]);
    ARGOSY_Q4_GROUP_DOT(3, 4, 5, codes + (g + 1) * 256, x + (g + 1) * kGroup, k, w[1]);
    _tile_stored(0, dots[0], 64);
    _tile_stored(3, dots[1], 64);
    ARGOSY_MEMORY_BARRIER();
    apply(g, dots[0]);
    apply(g + 1, dots[1]);
  }
  if (g < groups) {
    ARGOSY_Q4_GROUP_DOT(0, 1, 2, codes + g * 256, x + g * kGroup, k, w[0]);
    _tile_stored(0, dots[0], 64);
    ARGOSY_MEMORY_BARRIER();
    apply(g, dots[0]);
  }
  for (int m = 0; m < R; ++m) store_row(acc[m], out + m * ldo);
}

// 32 more k of a Q8 tile's dot products, accumulated on result tile 0 (x on A, codes on B)
#define ARGOSY_Q8_BLOCK_DOT(A, B, codes, x, k, w) \
  do {                                            \
    unpack_q8(codes, w);                          \
    ARGOSY_MEMORY_BARRIER();                      \
    _tile_loadd(B, w, 64);                        \
    _tile_loadd(A, x, (k) * 2);                   \
    _tile_dpbf16ps(0, A, B);                      \
  } while (0)

// One tile x R rows of a per-channel Q8 layer: one AMX accumulation over all of k, blocks
// of 32 k unpacked into alternating buffers.
template <int R>
inline void q8_tile(const uint16_t* x, int64_t k, const int8_t* codes, const float* scales, at::BFloat16* out,
                    int64_t ldo) {
  alignas(64) uint16_t w[2][16 * 32];
  alignas(64) float dots[R * 16];
  const int64_t blocks = k / kGroup;
  _tile_zero(0);
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    ARGOSY_Q8_BLOCK_DOT(1, 2, codes + b * 512, x + b * kGroup, k, w[0]);
    ARGOSY_Q8_BLOCK_DOT(4, 5, codes + (b + 1) * 512, x + (b + 1) * kGroup, k, w[1]);
  }
  if (b < blocks) ARGOSY_Q8_BLOCK_DOT(1, 2, codes + b * 512, x + b * kGroup, k, w[0]);
  _tile_stored(0, dots, 64);
  ARGOSY_MEMORY_BARRIER();
  const __m512 s = _mm512_loadu_ps(scales);
  for (int m = 0; m < R; ++m) store_row(_mm512_mul_ps(_mm512_load_ps(dots + 16 * m), s), out + m * ldo);
}

// rows in passes of at most kMaxRowsPerPass: pass(first_row, integral_constant<rows>)
template <typename Pass>
inline void for_row_passes(int64_t rows, Pass&& pass) {
  for (int64_t row = 0; row < rows; row += kMaxRowsPerPass) {
    switch (std::min<int64_t>(rows - row, kMaxRowsPerPass)) {
#define ARGOSY_PASS(n) \
  case n:              \
    pass(row, std::integral_constant<int, n>{}); \
    break;
      ARGOSY_PASS(1) ARGOSY_PASS(2) ARGOSY_PASS(3) ARGOSY_PASS(4) ARGOSY_PASS(5) ARGOSY_PASS(6) ARGOSY_PASS(7)
      ARGOSY_PASS(8) ARGOSY_PASS(9) ARGOSY_PASS(10) ARGOSY_PASS(11) ARGOSY_PASS(12) ARGOSY_PASS(13)
      ARGOSY_PASS(14) ARGOSY_PASS(15)
      default: pass(row, std::integral_constant<int, 16>{}); break;
#undef ARGOSY_PASS
    }
  }
}

// every tile x every row, tiles split among the threads (a task: enough for both threads,
// few enough to keep weights streaming), rows in passes: run(tile, first_row, rows_constant)
template <typename Run>
inline void for_tiles_and_rows(int64_t tiles, int64_t rows, Run&& run) {
  const int64_t grain = std::max<int64_t>(1, tiles / (8 * at::get_num_threads()));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for_row_passes(rows, [&](int64_t row, auto rows_in_pass) {
      configure_tiles(decltype(rows_in_pass)::value);
      for (int64_t t = begin; t < end; ++t) run(t, row, rows_in_pass);
    });
    _tile_release();
  });
}

#endif  // ARGOSY_QLINEAR

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t out_features) {
  TORCH_CHECK(qlinear_available(), "q4_linear: this build has no AVX-512 BF16 path");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.size(2) == 16 && codes.size(3) == 16 &&
                  codes.is_contiguous(),
              "q4_linear: codes must be contiguous uint8 [N/16, K/32, 16, 16]");
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(tiles * kTile == out_features, "q4_linear: codes hold ", tiles * kTile, " outputs, not ",
              out_features);
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                    t->size(1) == groups && t->size(2) == kTile,
                "q4_linear: scales and mins must be contiguous float16 [N/16, K/32, 16]");
  check_x(x, groups * kGroup);
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, out_features}, x.options());
#ifdef ARGOSY_QLINEAR
  if (rows == 0) return out;
  // per row and group: the sum of x (the minimums' term, m * sum(x), is added per group)
  auto sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* sx = sums.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + (r * groups + g) * kGroup))),
          16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + (r * groups + g) * kGroup + 16))),
          16));
      sx[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  const int64_t k = groups * kGroup;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for_tiles_and_rows(tiles, rows, [&](int64_t t, int64_t row, auto rows_in_pass) {
    q4_tile<decltype(rows_in_pass)::value>(xb + row * k, k, sx + row * groups, groups, cp + t * groups * 256,
                                           sp + t * groups * kTile, mp + t * groups * kTile,
                                           op + row * out_features + t * kTile, out_features);
  });
#endif
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t out_features) {
  TORCH_CHECK(qlinear_available(), "q8_linear: this build has no AVX-512 BF16 path");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4 && codes.size(2) == 16 && codes.size(3) == 2 &&
                  codes.is_contiguous(),
              "q8_linear: codes must be contiguous int8 [N/16, K/2, 16, 2]");
  const int64_t tiles = codes.size(0), k_pairs = codes.size(1);
  TORCH_CHECK(tiles * kTile == out_features, "q8_linear: codes hold ", tiles * kTile, " outputs, not ",
              out_features);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == out_features,
              "q8_linear: scales must be contiguous float32 [N]");
  TORCH_CHECK(k_pairs % 16 == 0, "q8_linear: in_features must be a multiple of 32");
  check_x(x, 2 * k_pairs);
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, out_features}, x.options());
#ifdef ARGOSY_QLINEAR
  if (rows == 0) return out;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t k = 2 * k_pairs;
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for_tiles_and_rows(tiles, rows, [&](int64_t t, int64_t row, auto rows_in_pass) {
    q8_tile<decltype(rows_in_pass)::value>(xb + row * k, k, cp + t * k_pairs * 32, sp + t * kTile,
                                           op + row * out_features + t * kTile, out_features);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(argosy_ext, m) {
  m.def("qlinear_available() -> bool");
  m.def("q4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int out_features) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(argosy_ext, CompositeExplicitAutograd, m) { m.impl("qlinear_available", &qlinear_available); }

TORCH_LIBRARY_IMPL(argosy_ext, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}
