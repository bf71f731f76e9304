// SIMD kernels of the CPU executor, compiled once per ISA level: the units of
// family `cpu_executor` in isa_units.h, each generated from isa_unit.h, which
// defines
//   SGLK_ISA_LEVEL     0 | 1 | 2   (the vec.h level: scalar, AVX2+FMA, AVX-512)
//   SGLK_ISA_DPBF16    0 | 1       (1: bf16 dots with vdpbf16ps, AVX512_BF16)
//   SGLK_ISA_NAME      the level's name
// and switches the target ISA before including this file. Everything below has
// internal linkage; no torch/STL header (see kernel_args.h for why).
//
// Dot products (see cpu_executor_args.h for the exactness contract):
//  * avx512bf16: 32 bf16 pairs per step, acc = vdpbf16ps(acc, w, x) (each lane
//    adds two exact bf16 x bf16 products, rounding to nearest-even; denormal
//    inputs and outputs are flushed to zero by the instruction);
//  * avx512: 16 elements per step, bf16 -> fp32 by a shift, acc = fma(w, x, acc);
//  * avx2: the same with 8 elements per step;
//  * scalar: one fp32 product and add per element.
// The last partial chunk is loaded zero-padded (masked load, or a padded copy on
// AVX2); each dot ends with one horizontal sum of its accumulator vector.

#include "cpu_executor_args.h"

namespace sglk {
namespace {

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#include "vec.h"

// Decode streams each weight row once, and rows are short (one 4 KB page at
// H = 2048), so the hardware stream prefetchers retrain on every row: the
// first column tile of a row tile prefetches the next row tile (one cache
// line per row per 64 bytes consumed) into L2.
#if SGLK_ISA_LEVEL >= 1
#define SGLK_PREFETCH_NEXT_TILE(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)
#else
#define SGLK_PREFETCH_NEXT_TILE(p) ((void)(p))
#endif

// ------------------------------------------------------------------ dot tiles
#if SGLK_ISA_LEVEL == 2
// Horizontal sums of four accumulators at once, with exactly the pairing tree
// of _mm512_reduce_add_ps (lanes i + i+8, then + i+4, then + i+2, then + i+1;
// IEEE addition is commutative, so operand order does not matter): every dot
// of every tile shape ends with this same tree. Writes the n <= 4 sums of
// a, b, c, d (in this order) to y[0..n).
template <int NS>
static inline __attribute__((always_inline)) void reduce4_store(__m512 a, __m512 b, __m512 c, __m512 d, float* y) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // [a|b|c|d] 128-bit blocks: (i) + (i + 4) of each 256-bit half
  const __m512 v6 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const __m512 v8 = _mm512_add_ps(v6, _mm512_permute_ps(v6, 0x4E));  // (0 + 2), (1 + 3)
  const __m512 v9 = _mm512_add_ps(v8, _mm512_permute_ps(v8, 0xB1));  // (0 + 1)
  const __m128 s = _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, v9));
  if constexpr (NS == 4)
    _mm_storeu_ps(y, s);
  else
    _mm_mask_storeu_ps(y, static_cast<__mmask8>((1u << NS) - 1u), s);
}

// y[c][r0 + r] = sum of acc[r][c] for the R x C accumulators of a tile.
template <int R, int C>
static inline __attribute__((always_inline)) void reduce_tile(__m512 (&acc)[R][C], float* const* y, int64_t r0) {
  const __m512 z = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) {
    int r = 0;
    for (; r + 4 <= R; r += 4) reduce4_store<4>(acc[r][c], acc[r + 1][c], acc[r + 2][c], acc[r + 3][c], y[c] + r0 + r);
    if constexpr (R % 4 == 1) reduce4_store<1>(acc[R - 1][c], z, z, z, y[c] + r0 + R - 1);
    if constexpr (R % 4 == 2) reduce4_store<2>(acc[R - 2][c], acc[R - 1][c], z, z, y[c] + r0 + R - 2);
    if constexpr (R % 4 == 3) reduce4_store<3>(acc[R - 3][c], acc[R - 2][c], acc[R - 1][c], z, y[c] + r0 + R - 3);
  }
}
#endif

// dot_micro<R, C>: the R x C block of dots of rows w + r * w_rs (r < R) with
// columns x[c] (c < C); writes y[c][r0 + r].

#if SGLK_ISA_DPBF16

static constexpr int DOT_CMAX = 4;
// Decode rows per tile for C tokens on an expert. One row at a time makes each thread read
// its rows as one sequential stream (the next row's line prefetched 4 KB ahead), the pattern
// the read-bandwidth figure is measured with; a tile of R rows reads R streams 4 KB apart.
// One vdpbf16ps consumes a whole cache line, so a single row keeps up; at three tokens 4-row
// tiles read faster (the measured tile heights: benchmark/RESULTS.md, cpu_executor).
template <int C>
struct DotRows {
  static constexpr int R = C == 3 ? 4 : 1;
};
static constexpr int PREFILL_ROWS = 4;  // more than DOT_CMAX tokens: tiles of 4 rows x 4 tokens

template <int R, int C, bool PF>
static inline void dot_micro(const uint16_t* w, int64_t w_rs, const uint16_t* const* x, int64_t n, float* const* y,
                             int64_t r0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w + r * w_rs + i);
    if constexpr (PF)
      for (int r = 0; r < R; ++r) SGLK_PREFETCH_NEXT_TILE(w + (R + r) * w_rs + i);
    for (int c = 0; c < C; ++c) {
      const __m512i xv = _mm512_loadu_si512(x[c] + i);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  if (i < n) {
    const __mmask32 m = static_cast<__mmask32>((1u << (n - i)) - 1u);
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(m, w + r * w_rs + i);
    for (int c = 0; c < C; ++c) {
      const __m512i xv = _mm512_maskz_loadu_epi16(m, x[c] + i);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  reduce_tile<R, C>(acc, y, r0);
}

#elif SGLK_ISA_LEVEL == 2

static constexpr int DOT_CMAX = 4;
// More rows in flight when few tokens share the expert (one fma chain per row would bind).
template <int C>
struct DotRows {
  static constexpr int R = C == 1 ? 8 : C == 2 ? 6 : 4;
};
static constexpr int PREFILL_ROWS = DotRows<DOT_CMAX>::R;

static inline __attribute__((always_inline)) __m512 cvt16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, int C, bool PF>
static inline void dot_micro(const uint16_t* w, int64_t w_rs, const uint16_t* const* x, int64_t n, float* const* y,
                             int64_t r0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = cvt16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * w_rs + i)));
    if constexpr (PF)
      if ((i & 31) == 0)
        for (int r = 0; r < R; ++r) SGLK_PREFETCH_NEXT_TILE(w + (R + r) * w_rs + i);
    for (int c = 0; c < C; ++c) {
      const __m512 xv = cvt16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[c] + i)));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = cvt16(_mm256_maskz_loadu_epi16(m, w + r * w_rs + i));
    for (int c = 0; c < C; ++c) {
      const __m512 xv = cvt16(_mm256_maskz_loadu_epi16(m, x[c] + i));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  reduce_tile<R, C>(acc, y, r0);
}

#elif SGLK_ISA_LEVEL == 1

static constexpr int DOT_CMAX = 2;
template <int C>
struct DotRows {
  static constexpr int R = 4;
};
static constexpr int PREFILL_ROWS = DotRows<DOT_CMAX>::R;

template <int R, int C, bool PF>
static inline void dot_micro(const uint16_t* w, int64_t w_rs, const uint16_t* const* x, int64_t n, float* const* y,
                             int64_t r0) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = v_load_bf16(w + r * w_rs + i);
    if constexpr (PF)
      if ((i & 31) == 0)
        for (int r = 0; r < R; ++r) SGLK_PREFETCH_NEXT_TILE(w + (R + r) * w_rs + i);
    for (int c = 0; c < C; ++c) {
      const __m256 xv = v_load_bf16(x[c] + i);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  if (i < n) {  // zero-padded copies of the last partial chunk
    uint16_t tw[R][8] = {}, tx[C][8] = {};
    for (int r = 0; r < R; ++r) __builtin_memcpy(tw[r], w + r * w_rs + i, 2 * (n - i));
    for (int c = 0; c < C; ++c) __builtin_memcpy(tx[c], x[c] + i, 2 * (n - i));
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = v_load_bf16(tw[r]);
    for (int c = 0; c < C; ++c) {
      const __m256 xv = v_load_bf16(tx[c]);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[c][r0 + r] = v_hsum(acc[r][c]);
}

#else  // scalar

static constexpr int DOT_CMAX = 1;
template <int C>
struct DotRows {
  static constexpr int R = 1;
};
static constexpr int PREFILL_ROWS = DotRows<DOT_CMAX>::R;

template <int R, int C, bool PF>
static inline void dot_micro(const uint16_t* w, int64_t w_rs, const uint16_t* const* x, int64_t n, float* const* y,
                             int64_t r0) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const uint16_t* wr = w + r * w_rs;
      const uint16_t* xc = x[c];
      float acc = 0.0f;
      for (int64_t i = 0; i < n; ++i) acc += bf16_to_f32(wr[i]) * bf16_to_f32(xc[i]);
      y[c][r0 + r] = acc;
    }
}

#endif

// All column tiles of R rows starting at row r0 (w already points at row r0).
// With pf, the first column tile prefetches the next row tile (see above);
// the caller passes pf only when that tile belongs to the same call, so that
// a thread never pulls in rows another thread's work item will stream.
template <int R, int C>
static inline void dot_first(bool pf, const uint16_t* w, int64_t w_rs, const uint16_t* const* x, int64_t n,
                             float* const* y, int64_t r0) {
  if (pf)
    dot_micro<R, C, true>(w, w_rs, x, n, y, r0);
  else
    dot_micro<R, C, false>(w, w_rs, x, n, y, r0);
}

template <int R, int CM>
static inline void dot_cols(bool pf, const uint16_t* w, int64_t w_rs, const uint16_t* const* x, int64_t cols, int64_t n,
                            float* const* y, int64_t r0) {
  int64_t c = 0;
  for (; c + CM <= cols; c += CM) dot_first<R, CM>(pf && c == 0, w, w_rs, x + c, n, y + c, r0);
  const int64_t cr = cols - c;
  if constexpr (CM > 1) {
    if (cr == 1) dot_first<R, 1>(pf && c == 0, w, w_rs, x + c, n, y + c, r0);
  }
  if constexpr (CM > 2) {
    if (cr == 2) dot_first<R, 2>(pf && c == 0, w, w_rs, x + c, n, y + c, r0);
  }
  if constexpr (CM > 3) {
    if (cr == 3) dot_first<R, 3>(pf && c == 0, w, w_rs, x + c, n, y + c, r0);
  }
  static_assert(CM <= 4, "column remainders above 3 are not dispatched");
}

// The last rows < R of a tile: dispatch the runtime count to a compile-time R.
template <int R, int CM>
struct RowRest {
  static inline void run(int64_t rr, const uint16_t* w, int64_t w_rs, const uint16_t* const* x, int64_t cols, int64_t n,
                         float* const* y, int64_t r0) {
    if (rr == R)
      dot_cols<R, CM>(false, w, w_rs, x, cols, n, y, r0);
    else
      RowRest<R - 1, CM>::run(rr, w, w_rs, x, cols, n, y, r0);
  }
};
template <int CM>
struct RowRest<0, CM> {
  static inline void run(int64_t, const uint16_t*, int64_t, const uint16_t* const*, int64_t, int64_t, float* const*,
                         int64_t) {}
};

// Rows outer, columns inner: a tile of R weight rows stays in L1 while every
// column (token) passes over it, which is what reuses weights in prefill.
template <int CM, int R>
static inline void dot_rows(const uint16_t* w, int64_t w_rs, int64_t rows, const uint16_t* const* x, int64_t cols,
                            int64_t n, float* const* y) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) dot_cols<R, CM>(r + 2 * R <= rows, w + r * w_rs, w_rs, x, cols, n, y, r);
  if (r < rows) RowRest<R - 1, CM>::run(rows - r, w + r * w_rs, w_rs, x, cols, n, y, r);
}

static void dot_tile(const uint16_t* w, int64_t w_rs, int64_t rows, const uint16_t* const* x, int64_t cols, int64_t n,
                     float* const* y) {
  if (rows <= 0 || cols <= 0) return;
  // Prefill (more tokens than DOT_CMAX): tiles of PREFILL_ROWS rows x DOT_CMAX tokens. Decode:
  // the level's DotRows for the token count. Every dot's arithmetic is the same for any tile
  // shape (its own accumulator, the same reduction tree), so outputs do not depend on it.
  if (cols > DOT_CMAX) {
    dot_rows<DOT_CMAX, PREFILL_ROWS>(w, w_rs, rows, x, cols, n, y);
    return;
  }
  if (cols == 1) dot_rows<1, DotRows<1>::R>(w, w_rs, rows, x, cols, n, y);
  if constexpr (DOT_CMAX > 1) {
    if (cols == 2) dot_rows<2, DotRows<2>::R>(w, w_rs, rows, x, cols, n, y);
  }
  if constexpr (DOT_CMAX > 2) {
    if (cols == 3) dot_rows<3, DotRows<3>::R>(w, w_rs, rows, x, cols, n, y);
  }
  if constexpr (DOT_CMAX > 3) {
    if (cols == 4) dot_rows<4, DotRows<4>::R>(w, w_rs, rows, x, cols, n, y);
  }
}

// ------------------------------------------------------------ quantized dots
// dot_q (see cpu_executor_args.h): the weights of a step are decoded in registers, scaled, and
// fma'd with fp32 activations in the layout of quant_x_pos; nothing is written back.
//  * fp8 (e4m3fn): sign-extended to 16 bits, shifted left by 7 and masked, a byte becomes the
//    fp16 number fp8 * 2^-8 (the 4 exponent bits land in fp16's 5, subnormals included:
//    vcvtph2ps takes them exactly); multiplied by scale * 2^8, an exact power-of-two change, so
//    the weight is fp32(fp8 * scale) at every level. The NaN codes 0x7f / 0xff decode as
//    +-480 * scale (checkpoints hold none).
//  * 4-bit (e2m1): 8 bytes are 16 codes; a table of the 8 (AVX2: vpermps) or 16 (AVX-512:
//    vpermps on zmm) code values, multiplied by the group's scale once per group, is indexed by
//    the codes. AVX2 carries the sign in bit 3 of the code: each table entry is stored xor'ed
//    with its index << 28 and the code << 28 is xor'ed back, which leaves the value with the
//    code's sign bit. The weight is fp32(e2m1 * s) at every level, s = 2^(e - 127) (mxfp4) or
//    fp32(fp8(scale) * global) (nvfp4), read from a 256-entry table of the scale byte built once
//    per dot_q call (fp4_scale_table).
//  * 4-bit on avx512bf16: x in the bf16 layout, e2m1 codes looked up as bf16 (vpermw), the
//    exact products of each group summed by vdpbf16ps, then scaled by one fma per group
//    (qdot_micro_b): the weight is e2m1 itself, the scale applied to the group's dot; the
//    scales of 16 groups decoded at once per row (fp4b_scale16), each step's picked by vpermps.
//  * fp8 on avx512bf16: x as bf16 in natural order, e4m3 rebiased to bf16 in registers (exact,
//    subnormals through a vpermw table), each 128-wide block's dot by vdpbf16ps, then one fma
//    by the block scale (qdot8_micro_b).

static const float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// float8_e4m3fn -> fp32 (exact; 0x7f / 0xff, the NaN codes, give NaN).
static constexpr float fp8e4m3_value(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15 && m == 7) return __builtin_bit_cast(float, 0x7fc00000u);
  if (e == 0) return sign ? -0.001953125f * static_cast<float>(m) : 0.001953125f * static_cast<float>(m);  // m 2^-9
  return __builtin_bit_cast(float, sign | ((e + 120u) << 23) | (m << 20));
}

// e8m0 -> fp32: 2^(e - 127); 0 gives 2^-127 (an fp32 subnormal), 255 (NaN in OCP MX) gives inf.
static constexpr float e8m0_value(uint32_t e) {
  return e == 0 ? __builtin_bit_cast(float, 0x00400000u) : __builtin_bit_cast(float, e << 23);
}

// The two scale codes as 256-entry tables (built at compile time): one load per group instead
// of a branchy decode.
struct ByteTable {
  float v[256];
};
template <float (*F)(uint32_t)>
static constexpr ByteTable make_byte_table() {
  ByteTable t{};
  for (uint32_t b = 0; b < 256; ++b) t.v[b] = F(b);
  return t;
}
static constexpr ByteTable kE4M3 = make_byte_table<fp8e4m3_value>();
static constexpr ByteTable kE8M0 = make_byte_table<e8m0_value>();

static inline float fp8e4m3_to_f32(uint8_t b) { return kE4M3.v[b]; }

// The value a 4-bit format's scale byte stands for, per matrix: mxfp4 2^(e - 127); nvfp4
// fp32(fp8(b) * global) (one rounding, as the format defines it). Built once per dot_q call.
template <int FMT>
static inline void fp4_scale_table(const QuantMatrix& m, float* t) {
  if constexpr (FMT == kFormat_mxfp4) {
    for (int b = 0; b < 256; ++b) t[b] = kE8M0.v[b];
  } else {
    const float g = m.global;
    for (int b = 0; b < 256; ++b) t[b] = kE4M3.v[b] * g;
  }
}

#if SGLK_ISA_LEVEL == 2
static constexpr float kFp8Mul = 256.0f;  // undoes the 2^-8 of the fp16 decode
static inline __attribute__((always_inline)) vf fp8_load(const uint8_t* p) {
  const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
}
static constexpr int FP4_NV = 1;  // vectors per 16 codes
typedef __m512 fp4_table;
static inline __attribute__((always_inline)) fp4_table fp4_make_table(float s) {
  return _mm512_mul_ps(_mm512_loadu_ps(kE2M1), _mm512_set1_ps(s));
}
static inline __attribute__((always_inline)) void fp4_decode(const uint8_t* p, fp4_table t, vf* out) {
  int64_t q;
  __builtin_memcpy(&q, p, 8);
  __m512i v = _mm512_cvtepu8_epi32(_mm_set1_epi64x(q));
  v = _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4));
  out[0] = _mm512_permutexvar_ps(v, t);
}
#elif SGLK_ISA_LEVEL == 1
static constexpr float kFp8Mul = 256.0f;
static inline __attribute__((always_inline)) vf fp8_load(const uint8_t* p) {
  const __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
}
static constexpr int FP4_NV = 2;
typedef __m256 fp4_table;
static inline __attribute__((always_inline)) fp4_table fp4_make_table(float s) {
  const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(kE2M1), _mm256_set1_ps(s));
  return _mm256_xor_ps(
      t, _mm256_castsi256_ps(_mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28)));
}
static inline __attribute__((always_inline)) void fp4_decode(const uint8_t* p, fp4_table t, vf* out) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i vh = _mm256_srli_epi32(v, 4);
  out[0] = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, v), _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
  out[1] = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, vh), _mm256_castsi256_ps(_mm256_slli_epi32(vh, 28)));
}
#else
static constexpr float kFp8Mul = 1.0f;
static inline vf fp8_load(const uint8_t* p) { return fp8e4m3_to_f32(*p); }
static constexpr int FP4_NV = 16;
typedef float fp4_table;  // the group scale
static inline fp4_table fp4_make_table(float s) { return s; }
static inline void fp4_decode(const uint8_t* p, fp4_table s, vf* out) {
  for (int j = 0; j < 8; ++j) {
    out[j] = kE2M1[p[j] & 15] * s;
    out[j + 8] = kE2M1[p[j] >> 4] * s;
  }
}
#endif

// Rows per quantized tile for C tokens, per level (accumulators, tables and decoded weights
// must fit the register file: 16 ymm on AVX2, 32 zmm on AVX-512). On AVX-512 one token reads 8
// rows at a time: with 4 the batch-1 fp8 dots ran at ~0.5 of the bf16 ones' bandwidth, with 8
// at ~0.8 (benchmark/RESULTS.md, cpu_executor, quantized experts).
template <int C>
struct QuantRows {
#if SGLK_ISA_LEVEL == 2
  static constexpr int R = C == 1 ? 8 : 4;
#elif SGLK_ISA_LEVEL == 1
  static constexpr int R = C == 1 ? 4 : 2;
#else
  static constexpr int R = 1;
#endif
};

template <int R, int C>
static inline __attribute__((always_inline)) void quant_reduce(vf (&acc)[R][C], float* const* y, int64_t yo) {
#if SGLK_ISA_LEVEL == 2
  reduce_tile<R, C>(acc, y, yo);
#else
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[c][yo + r] = v_hsum(acc[r][c]);
#endif
}

// The R x C dots of matrix rows row..row+R-1 with x[0..C); writes y[c][yo + r]. st: the
// 4-bit formats' scale-byte table (fp4_scale_table). With PF, the rows row+R..row+2R-1 (the
// next tile of the same call) are prefetched into L2 as this tile streams its own, one line
// per row per 64 bytes consumed (see SGLK_PREFETCH_NEXT_TILE).
template <int FMT, int R, int C, bool PF>
static inline void qdot_micro(const QuantMatrix& m, int64_t row, const float* const* x, int64_t n, float* const* y,
                              int64_t yo, const float* st) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = v_zero();
  const uint8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = m.w + (row + r) * m.w_rs;
  const int64_t next = R * m.w_rs;  // bytes from a row to its row in the next tile
  if constexpr (FMT == kFormat_fp8) {
    const float* s[R];
    for (int r = 0; r < R; ++r) s[r] = static_cast<const float*>(m.scale) + ((row + r) / m.scale_row_div) * m.scale_rs;
    vf sv[R];
    for (int64_t i = 0; i < n; i += VW) {
      if (i % kFp8Block == 0)
        for (int r = 0; r < R; ++r) sv[r] = v_set1(s[r][(i / kFp8Block) * m.scale_col_step] * kFp8Mul);
      if constexpr (PF)
        if (i % 64 == 0)
          for (int r = 0; r < R; ++r) SGLK_PREFETCH_NEXT_TILE(w[r] + next + i);
      vf wv[R];
      if (i + VW <= n) {
        for (int r = 0; r < R; ++r) wv[r] = v_mul(fp8_load(w[r] + i), sv[r]);
      } else {  // the zero-padded last chunk (x rows are zero-padded too)
        for (int r = 0; r < R; ++r) {
          uint8_t t[VW] = {};
          __builtin_memcpy(t, w[r] + i, n - i);
          wv[r] = v_mul(fp8_load(t), sv[r]);
        }
      }
      for (int c = 0; c < C; ++c) {
        const vf xv = v_load(x[c] + i);
        for (int r = 0; r < R; ++r) acc[r][c] = v_fma(wv[r], xv, acc[r][c]);
      }
    }
  } else {
    constexpr int64_t G = FMT == kFormat_mxfp4 ? kMxfp4Group : kNvfp4Group;
    const uint8_t* s[R];
    for (int r = 0; r < R; ++r) s[r] = static_cast<const uint8_t*>(m.scale) + (row + r) * m.scale_rs;
    fp4_table tab[R];
    if constexpr (PF)
      for (int r = 0; r < R; ++r)
        for (int64_t o = 0; o < m.scale_rs; o += 64) SGLK_PREFETCH_NEXT_TILE(s[r] + R * m.scale_rs + o);
    for (int64_t i = 0; i < n; i += 16) {
      if (i % G == 0)
        for (int r = 0; r < R; ++r) tab[r] = fp4_make_table(st[s[r][i / G]]);
      if constexpr (PF)
        if (i % 128 == 0)
          for (int r = 0; r < R; ++r) SGLK_PREFETCH_NEXT_TILE(w[r] + next + i / 2);
      vf wv[R][FP4_NV];
      for (int r = 0; r < R; ++r) fp4_decode(w[r] + i / 2, tab[r], wv[r]);
      for (int v = 0; v < FP4_NV; ++v)
        for (int c = 0; c < C; ++c) {
          const vf xv = v_load(x[c] + i + v * VW);
          for (int r = 0; r < R; ++r) acc[r][c] = v_fma(wv[r][v], xv, acc[r][c]);
        }
    }
  }
  quant_reduce<R, C>(acc, y, yo);
}

#if SGLK_ISA_DPBF16
// The 4-bit formats on vdpbf16ps, x in the bf16 layout (quant_prep_xb). A step is 128 elements
// (64 bytes) of a row, read as 32 words of four codes each (elements 4k .. 4k + 3 in word k,
// lowest nibble first): the words, shifted right by 0, 4, 8 and 12, index a table of the 16
// e2m1 values as bf16 (vpermw reads 5 index bits: entries 16..31 repeat 0..15, so the next
// nibble's low bit does not matter), w_q[k] = e2m1(element 4k + q). Lane j of
// p = vdpbf16ps over q = 0..3 of (w_q, x_q) sums the exact products of elements 8j .. 8j + 7,
// all in one scale group (nvfp4: lanes 2g, 2g + 1 are group g of the step, mxfp4: lanes
// 4g .. 4g + 3), and acc = fma(p, s, acc) with s the lanes' group scales. The last partial step
// loads only the row's bytes (zero codes are 0) and gives the lanes past n a zero scale (x is
// zero-padded to a multiple of 128).
static constexpr uint16_t kE2M1Bf16[32] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                           0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
                                           0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                           0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

// Rows per tile of the bf16 4-bit dots (a step decodes a row in four vectors, used one after the other;
// one token: 8 rows, as QuantRows).
template <int C>
struct Fp4bRows {
  static constexpr int R = C == 1 ? 8 : C == 2 ? 4 : 2;
};

// The scales of 16 consecutive groups of a row (scale bytes s, ng of them left in the row) as
// fp32 lanes, lane k = group k, 0 for k >= ng: one vector per row per 16 groups, from which
// each step's lanes are picked by vpermps. The values are those of fp4_scale_table, bit for
// bit: mxfp4 2^(e - 127) is e << 23 (e = 0: 2^-127, 255: inf); nvfp4's e4m3 byte becomes the
// fp16 number fp8 * 2^-8 (fp8_load's trick, exact), times global * 2^8 (exact): the same one
// rounding of fp8 * global; the NaN codes 0x7f / 0xff give NaN, as the table's.
template <int FMT>
static inline __attribute__((always_inline)) __m512 fp4b_scale16(const uint8_t* s, int64_t ng, __m512 gmul) {
  const __mmask16 k = ng >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << ng) - 1u);
  const __m128i b = _mm_maskz_loadu_epi8(k, s);
  if constexpr (FMT == kFormat_nvfp4) {
    const __m256i h = _mm256_cvtepi8_epi16(b);
    const __m512 f =
        _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
    const __m512 v = _mm512_maskz_mul_ps(k, f, gmul);
    const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    return _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
  } else {
    const __m512i e = _mm512_cvtepu8_epi32(b);
    const __m512i v =
        _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), _mm512_testn_epi32_mask(e, e), _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(k, v));
  }
}

template <int FMT, int R, int C, bool PF>
static inline void qdot_micro_b(const QuantMatrix& m, int64_t row, const float* const* xs, int64_t n, float* const* y,
                                int64_t yo, __m512 gmul) {
  constexpr int64_t G = FMT == kFormat_mxfp4 ? kMxfp4Group : kNvfp4Group;
  constexpr int GS = static_cast<int>(128 / G);  // groups per step
  constexpr int64_t CH = 16 * G;                 // elements per 16 groups (one scale vector)
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* x[C];
  for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const uint16_t*>(xs[c]);
  const uint8_t* w[R];
  const uint8_t* s[R];
  for (int r = 0; r < R; ++r) {
    w[r] = m.w + (row + r) * m.w_rs;
    s[r] = static_cast<const uint8_t*>(m.scale) + (row + r) * m.scale_rs;
  }
  if constexpr (PF)
    for (int r = 0; r < R; ++r)
      for (int64_t o = 0; o < m.scale_rs; o += 64) SGLK_PREFETCH_NEXT_TILE(s[r] + R * m.scale_rs + o);
  const int64_t next = R * m.w_rs;
  const __m512i tab = _mm512_loadu_si512(kE2M1Bf16);
  const __m512 z = _mm512_setzero_ps();
  // lane j of a step holds elements 8j .. 8j + 7: group j / (16 / GS) of the step
  const __m512i ix0 =
      _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), GS == 8 ? 1 : 2);
  auto step = [&](int64_t i, const __m512i(&v)[R], const __m512(&sc)[R], __m512i ix) __attribute__((always_inline)) {
    for (int r = 0; r < R; ++r) {
      const __m512i w0 = _mm512_permutexvar_epi16(v[r], tab);
      const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v[r], 4), tab);
      const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v[r], 8), tab);
      const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v[r], 12), tab);
      const __m512 sv = _mm512_permutexvar_ps(ix, sc[r]);
      for (int c = 0; c < C; ++c) {
        const uint16_t* xc = x[c] + i;
        __m512 p = _mm512_dpbf16_ps(z, (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xc));
        p = _mm512_dpbf16_ps(p, (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xc + 32));
        p = _mm512_dpbf16_ps(p, (__m512bh)w2, (__m512bh)_mm512_loadu_si512(xc + 64));
        p = _mm512_dpbf16_ps(p, (__m512bh)w3, (__m512bh)_mm512_loadu_si512(xc + 96));
        acc[r][c] = _mm512_fmadd_ps(p, sv, acc[r][c]);
      }
    }
  };
  for (int64_t c0 = 0; c0 < n; c0 += CH) {
    __m512 sc[R];
    for (int r = 0; r < R; ++r) sc[r] = fp4b_scale16<FMT>(s[r] + c0 / G, (n - c0) / G, gmul);
    const int64_t c1 = n - c0 < CH ? n : c0 + CH;
    __m512i ix = ix0;
    int64_t i = c0;
    for (; i + 128 <= c1; i += 128) {
      if constexpr (PF)
        for (int r = 0; r < R; ++r) SGLK_PREFETCH_NEXT_TILE(w[r] + next + i / 2);
      __m512i v[R];
      for (int r = 0; r < R; ++r) v[r] = _mm512_loadu_si512(w[r] + i / 2);
      step(i, v, sc, ix);
      ix = _mm512_add_epi32(ix, _mm512_set1_epi32(GS));
    }
    if (i < c1) {  // the row's last, partial step: n - i is a multiple of G below 128
      const __mmask64 bm = (uint64_t{1} << ((c1 - i) / 2)) - 1u;
      __m512i v[R];
      for (int r = 0; r < R; ++r) v[r] = _mm512_maskz_loadu_epi8(bm, w[r] + i / 2);
      step(i, v, sc, ix);
    }
  }
  reduce_tile<R, C>(acc, y, yo);
}

template <int FMT, int C>
static inline void qdot_rows_b(const QuantMatrix& m, int64_t r0, int64_t rows, const float* const* x, int64_t n,
                               float* const* y) {
  constexpr int R = Fp4bRows<C>::R;
  const __m512 gmul = _mm512_set1_ps(FMT == kFormat_nvfp4 ? m.global * 256.0f : 1.0f);
  int64_t r = 0;
  for (; r + 2 * R <= rows; r += R) qdot_micro_b<FMT, R, C, true>(m, r0 + r, x, n, y, r, gmul);
  for (; r + R <= rows; r += R) qdot_micro_b<FMT, R, C, false>(m, r0 + r, x, n, y, r, gmul);
  for (; r < rows; ++r) qdot_micro_b<FMT, 1, C, false>(m, r0 + r, x, n, y, r, gmul);
}

// fp8 on vdpbf16ps, x as bf16 in natural order (quant_prep_x8b). Every e4m3 value is exact in
// bf16; a step decodes 32 bytes of a row, widened with their sign to words, to bf16 words of
// fp8 * 2^8: shifted left by 4, the magnitude bits sit in bf16's exponent (bits 7..10) and
// mantissa (4..6), the sign in bit 15; or'ing in bit 14 adds 128 to the exponent (the bias
// 7 -> 127 and the 2^8). The subnormal codes (exponent 0: 0 and m * 2^-9) take m * 2^-1 from a
// vpermw table instead (vdpbf16ps would flush them otherwise); the NaN codes 0x7f / 0xff decode
// as +-480 * 2^8, as fp8_load's. Lane j of vdpbf16ps adds the exact products of elements 2j and
// 2j + 1; the four steps of a 128-wide block go to one per-block sum p, and
// acc = fma(p, scale * 2^-8, acc) applies the block's scale once. The last partial step loads
// only the row's bytes (zero codes are 0; x is zero-padded to a multiple of 32).
static constexpr uint16_t kE4M3SubBf16[32] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4020, 0x4040, 0x4060};

static inline __attribute__((always_inline)) __m512i fp8b_decode(__m256i bytes, __m512i sub) {
  const __m512i sx = _mm512_cvtepi8_epi16(bytes);
  const __m512i t = _mm512_slli_epi16(sx, 4);
  // (t & 0x07F0) | 0x4000: the magnitude of a normal code
  __m512i v = _mm512_ternarylogic_epi32(t, _mm512_set1_epi16(0x07F0), _mm512_set1_epi16(0x4000), 0xEA);
  v = _mm512_mask_permutexvar_epi16(v, _mm512_testn_epi16_mask(sx, _mm512_set1_epi16(0x0078)), sx, sub);
  // v | (t & 0x8000): the sign
  return _mm512_ternarylogic_epi32(v, t, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
}

template <int C>
struct Fp8bRows {
  static constexpr int R = C == 1 ? 8 : C == 2 ? 4 : 2;
};

template <int R, int C, bool PF>
static inline void qdot8_micro_b(const QuantMatrix& m, int64_t row, const float* const* xs, int64_t n, float* const* y,
                                 int64_t yo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* x[C];
  for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const uint16_t*>(xs[c]);
  const uint8_t* w[R];
  const float* s[R];
  for (int r = 0; r < R; ++r) {
    w[r] = m.w + (row + r) * m.w_rs;
    s[r] = static_cast<const float*>(m.scale) + ((row + r) / m.scale_row_div) * m.scale_rs;
  }
  const int64_t next = R * m.w_rs;
  const __m512i sub = _mm512_loadu_si512(kE4M3SubBf16);
  for (int64_t b0 = 0; b0 < n; b0 += kFp8Block) {
    const int64_t b1 = n - b0 < kFp8Block ? n : b0 + kFp8Block;
    __m512 p[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) p[r][c] = _mm512_setzero_ps();
    for (int64_t i = b0; i < b1; i += 32) {
      if constexpr (PF)
        if (i % 64 == 0)
          for (int r = 0; r < R; ++r) SGLK_PREFETCH_NEXT_TILE(w[r] + next + i);
      __m512i wv[R];
      if (i + 32 <= b1) {
        for (int r = 0; r < R; ++r)
          wv[r] = fp8b_decode(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i)), sub);
      } else {
        const __mmask32 bm = static_cast<__mmask32>((1u << (b1 - i)) - 1u);
        for (int r = 0; r < R; ++r) wv[r] = fp8b_decode(_mm256_maskz_loadu_epi8(bm, w[r] + i), sub);
      }
      for (int c = 0; c < C; ++c) {
        const __m512i xv = _mm512_loadu_si512(x[c] + i);
        for (int r = 0; r < R; ++r) p[r][c] = _mm512_dpbf16_ps(p[r][c], (__m512bh)wv[r], (__m512bh)xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sv = _mm512_set1_ps(s[r][(b0 / kFp8Block) * m.scale_col_step] * (1.0f / 256.0f));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p[r][c], sv, acc[r][c]);
    }
  }
  reduce_tile<R, C>(acc, y, yo);
}

template <int C>
static inline void qdot8_rows_b(const QuantMatrix& m, int64_t r0, int64_t rows, const float* const* x, int64_t n,
                                float* const* y) {
  constexpr int R = Fp8bRows<C>::R;
  int64_t r = 0;
  for (; r + 2 * R <= rows; r += R) qdot8_micro_b<R, C, true>(m, r0 + r, x, n, y, r);
  for (; r + R <= rows; r += R) qdot8_micro_b<R, C, false>(m, r0 + r, x, n, y, r);
  for (; r < rows; ++r) qdot8_micro_b<1, C, false>(m, r0 + r, x, n, y, r);
}
#endif

// Rows in tiles of QuantRows<C>::R (every tile but the last prefetching the next), then the
// remaining rows one at a time.
template <int FMT, int C>
static inline void qdot_rows(const QuantMatrix& m, int64_t r0, int64_t rows, const float* const* x, int64_t n,
                             float* const* y, const float* st) {
  constexpr int R = QuantRows<C>::R;
  int64_t r = 0;
  for (; r + 2 * R <= rows; r += R) qdot_micro<FMT, R, C, true>(m, r0 + r, x, n, y, r, st);
  for (; r + R <= rows; r += R) qdot_micro<FMT, R, C, false>(m, r0 + r, x, n, y, r, st);
  for (; r < rows; ++r) qdot_micro<FMT, 1, C, false>(m, r0 + r, x, n, y, r, st);
}

template <int FMT>
static void qdot_format(const QuantMatrix& m, int64_t r0, int64_t rows, const float* const* x, int64_t cols, int64_t n,
                        float* const* y) {
  int64_t c = 0;
#if SGLK_ISA_DPBF16
  if constexpr (FMT == kFormat_fp8) {
    for (; c + 4 <= cols; c += 4) qdot8_rows_b<4>(m, r0, rows, x + c, n, y + c);
    if (cols - c == 1) qdot8_rows_b<1>(m, r0, rows, x + c, n, y + c);
    if (cols - c == 2) qdot8_rows_b<2>(m, r0, rows, x + c, n, y + c);
    if (cols - c == 3) qdot8_rows_b<3>(m, r0, rows, x + c, n, y + c);
  } else {
    for (; c + 4 <= cols; c += 4) qdot_rows_b<FMT, 4>(m, r0, rows, x + c, n, y + c);
    if (cols - c == 1) qdot_rows_b<FMT, 1>(m, r0, rows, x + c, n, y + c);
    if (cols - c == 2) qdot_rows_b<FMT, 2>(m, r0, rows, x + c, n, y + c);
    if (cols - c == 3) qdot_rows_b<FMT, 3>(m, r0, rows, x + c, n, y + c);
  }
#else
  alignas(64) float st[256];
  if constexpr (FMT != kFormat_fp8) fp4_scale_table<FMT>(m, st);
  for (; c + 4 <= cols; c += 4) qdot_rows<FMT, 4>(m, r0, rows, x + c, n, y + c, st);
  if (cols - c == 1) qdot_rows<FMT, 1>(m, r0, rows, x + c, n, y + c, st);
  if (cols - c == 2) qdot_rows<FMT, 2>(m, r0, rows, x + c, n, y + c, st);
  if (cols - c == 3) qdot_rows<FMT, 3>(m, r0, rows, x + c, n, y + c, st);
#endif
}

static void prep_x(int32_t format, const uint16_t* x, int64_t i0, int64_t i1, int64_t n, int32_t pad, float* xf) {
#if SGLK_ISA_DPBF16
  if (format == kFormat_fp8)
    quant_prep_x8b(x, i0, i1, n, pad != 0, reinterpret_cast<uint16_t*>(xf));
  else
    quant_prep_xb(x, i0, i1, n, pad != 0, reinterpret_cast<uint16_t*>(xf));
#else
  quant_prep_x(format, x, i0, i1, n, pad != 0, xf);
#endif
}

static void dot_q(const QuantMatrix* m, int64_t r0, int64_t rows, const float* const* x, int64_t cols, int64_t n,
                  float* const* y) {
  if (rows <= 0 || cols <= 0) return;
  if (m->format == kFormat_fp8)
    qdot_format<kFormat_fp8>(*m, r0, rows, x, cols, n, y);
  else if (m->format == kFormat_mxfp4)
    qdot_format<kFormat_mxfp4>(*m, r0, rows, x, cols, n, y);
  else if (m->format == kFormat_nvfp4)
    qdot_format<kFormat_nvfp4>(*m, r0, rows, x, cols, n, y);
}

// --------------------------------------------------------------- elementwise
static inline void silu_mul_vec(const float* g, const float* u, uint16_t* h) {
  const vf gv = v_load(g);
  const vf s = v_div(gv, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), gv))));
  v_store_bf16(h, v_mul(s, v_load(u)));
}

// gpt-oss's clamped SwiGLU: (u' + 1) * g' / (1 + exp(-alpha g')), g' = min(g, L),
// u' = clamp(u, -L, L) (transformers: g' * sigmoid(alpha g'), the same value up to rounding).
static inline void swiglu_oai_vec(const float* g, const float* u, vf alpha, vf limit, uint16_t* h) {
  const vf gv = v_min(v_load(g), limit);
  const vf uv = v_max(v_min(v_load(u), limit), v_sub(v_zero(), limit));
  const vf s = v_div(gv, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), v_mul(alpha, gv)))));
  v_store_bf16(h, v_mul(s, v_add(uv, v_set1(1.0f))));
}

// DeepSeek-V4's swiglu_limit: silu(min(g, L)) * clamp(u, -L, L).
static inline void swiglu_limit_vec(const float* g, const float* u, vf limit, uint16_t* h) {
  const vf gv = v_min(v_load(g), limit);
  const vf uv = v_max(v_min(v_load(u), limit), v_sub(v_zero(), limit));
  const vf s = v_div(gv, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), gv))));
  v_store_bf16(h, v_mul(s, uv));
}

// Gemma 4's tanh-approximated GELU: g / (1 + exp(-2c (g + 0.044715 g^3))) * u, c = sqrt(2 / pi)
// (the tanh form 0.5 g (1 + tanh(c (g + 0.044715 g^3))) written through sigmoid(2z); exp
// overflows to inf for very negative g, giving -0 as the tanh form's limit).
static inline void gelu_tanh_mul_vec(const float* g, const float* u, uint16_t* h) {
  const vf gv = v_load(g);
  const vf inner = v_mul(gv, v_fma(v_set1(0.044715f), v_mul(gv, gv), v_set1(1.0f)));
  const vf z = v_mul(v_set1(-1.5957691216057308f), inner);  // -2 sqrt(2 / pi)
  const vf s = v_div(gv, v_add(v_set1(1.0f), v_exp(z)));
  v_store_bf16(h, v_mul(s, v_load(u)));
}

static inline void glu_vec(const float* g, const float* u, const Activation& a, uint16_t* h) {
  if (a.code == kAct_gelu_tanh)
    gelu_tanh_mul_vec(g, u, h);
  else if (a.code == kAct_swiglu_oai)
    swiglu_oai_vec(g, u, v_set1(a.alpha), v_set1(a.limit), h);
  else if (a.code == kAct_swiglu_limit)
    swiglu_limit_vec(g, u, v_set1(a.limit), h);
  else
    silu_mul_vec(g, u, h);
}

static void glu_bf16(const float* g, const float* u, int64_t n, const Activation* act, uint16_t* h) {
  const Activation a = *act;
  int64_t i = 0;
  for (; i + VW <= n; i += VW) glu_vec(g + i, u + i, a, h + i);
  if (i < n) {  // through a zero-padded full vector: same lanes, same values
    float tg[VW] = {}, tu[VW] = {};
    uint16_t th[VW];
    __builtin_memcpy(tg, g + i, 4 * (n - i));
    __builtin_memcpy(tu, u + i, 4 * (n - i));
    glu_vec(tg, tu, a, th);
    __builtin_memcpy(h + i, th, 2 * (n - i));
  }
}

static void weighted_sum(float* out, int64_t n, const float* const* ys, const float* ws, int64_t nk,
                         int32_t accumulate) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    vf r = v_zero();
    for (int64_t k = 0; k < nk; ++k) r = v_fma(v_set1(ws[k]), v_load(ys[k] + i), r);
    if (accumulate) r = v_add(v_load(out + i), r);
    v_store(out + i, r);
  }
  for (; i < n; ++i) {  // SIMD levels only: a fused scalar fma equals the vector lane's
    float r = 0.0f;
    for (int64_t k = 0; k < nk; ++k) r = __builtin_fmaf(ws[k], ys[k][i], r);
    out[i] = accumulate ? out[i] + r : r;
  }
}

// ------------------------------------------------------------ read bandwidth
static uint64_t stream_read(const void* p, int64_t bytes) {
#if SGLK_ISA_LEVEL == 2
  const char* b = static_cast<const char*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t o = 0; o < bytes; o += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(b + o));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(b + o + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(b + o + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(b + o + 192));
  }
  return static_cast<uint64_t>(
      _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))));
#elif SGLK_ISA_LEVEL == 1
  const char* b = static_cast<const char*>(p);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t o = 0; o < bytes; o += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(b + o)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(b + o + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(b + o + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(b + o + 96)));
  }
  a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  uint64_t s[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s), a0);
  return s[0] + s[1] + s[2] + s[3];
#else
  const uint64_t* q = static_cast<const uint64_t*>(p);
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (int64_t o = 0; o < bytes / 8; o += 4) {
    a0 += q[o];
    a1 += q[o + 1];
    a2 += q[o + 2];
    a3 += q[o + 3];
  }
  return a0 + a1 + a2 + a3;
#endif
}

static const CpuExecutorKernels kTable = {
    SGLK_ISA_NAME,
#if SGLK_ISA_DPBF16
    "vdpbf16ps (bf16 pairs, fp32 accumulate)",
#elif SGLK_ISA_LEVEL == 2
    "avx512 bf16->fp32 + fma",
#elif SGLK_ISA_LEVEL == 1
    "avx2 bf16->fp32 + fma",
#else
    "scalar fp32",
#endif
    &dot_tile,
    &glu_bf16,
    &weighted_sum,
    &prep_x,
    &dot_q,
    &stream_read,
};

}  // namespace
}  // namespace sglk
