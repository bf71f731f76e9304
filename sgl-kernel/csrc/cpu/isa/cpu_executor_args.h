// Plain-data interface of the CPU executor's SIMD kernels (see
// cpu_executor.cpp for the operator and cpu_executor_pool.cpp for the threads).
// Same rules as kernel_args.h: POD and `static` helpers only, no torch/STL.
//
// The kernels are compiled once per ISA level (the cpu_executor units of
// isa/isa_units.h); dispatch.cpp picks the table of the selected level.
//
// Exactness contract (what the executor's bit-identical merge rests on): within
// one table,
//  * dot_tile computes every dot product y[c][r] with the same sequence of
//    floating-point operations whatever `rows`, `cols` and the position of the
//    row/column inside the tile: one accumulator per (row, column), chunks of
//    the vector width in index order, a zero-padded last chunk, then one fixed
//    horizontal reduction;
//  * glu_bf16 and weighted_sum are element-wise and give the same value
//    for an element wherever it falls in the range (tails are computed through
//    zero-padded full vectors, never through a different scalar formula);
//  * dot_q is dot_tile for a quantized weight matrix: one accumulator per
//    (row, column), the format's steps in index order, the weights decoded
//    (and scaled) in registers the same way in every tile shape, the same
//    horizontal reduction as dot_tile's at each level.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace sglk {

// The expert weight formats the executor reads, in code order (the op's `format` argument;
// Python reads the names through expert_cache_enum("expert_format")):
//   bf16   w [rows, n] bf16
//   fp8    w [rows, n] float8_e4m3fn, scale [ceil(rows/128), ceil(n/128)] f32: value =
//          fp8(w) * scale of its 128 x 128 block (upstream Fp8MoEMethod, weight_scale_inv;
//          compressed-tensors FP8_BLOCK, weight_scale), or scale [rows, 1] f32: value =
//          fp8(w) * scale of its row (compressed-tensors FP8-Dynamic, per output channel:
//          CompressedTensorsW8A8Fp8MoE's weight_scale); QuantMatrix's scale_row_div /
//          scale_col_step say which
//   mxfp4  w [rows, n/2] uint8, e2m1 codes two per byte (element 2j in the low nibble, 2j+1 in
//          the high one), scale [rows, n/32] uint8 e8m0: value = e2m1 * 2^(scale - 127)
//          (upstream Mxfp4MoEMethod, OCP MX)
//   nvfp4  w as mxfp4, scale [rows, n/16] float8_e4m3fn, one f32 global scale per matrix
//          (weight_scale_2): value = e2m1 * fp8(scale) * global (upstream
//          ModelOptNvFp4FusedMoEMethod, the unswizzled layout create_weights makes)
#define SGLK_EXPERT_FORMATS(X) X(bf16) X(fp8) X(mxfp4) X(nvfp4)
#define SGLK_EXPERT_FORMAT_ENUMERATOR(name) kFormat_##name,
enum ExpertFormatCode : int32_t { SGLK_EXPERT_FORMATS(SGLK_EXPERT_FORMAT_ENUMERATOR) kFormatCount };
#undef SGLK_EXPERT_FORMAT_ENUMERATOR

// The gated activation of the expert MLP, h = act(g, u) (the op's `activation` argument, in code
// order; Python reads the names through expert_cache_enum("expert_activation")):
//   silu          h = silu(g) * u                                  (SGLang's SiluAndMul)
//   swiglu_oai    g' = min(g, limit), u' = clamp(u, -limit, limit),
//                 h = (u' + 1) * g' * sigmoid(alpha * g')          (gpt-oss: transformers'
//                                                                   GptOssExperts._apply_gate)
//   swiglu_limit  h = silu(min(g, limit)) * clamp(u, -limit, limit) (DeepSeek-V4's swiglu_limit:
//                                                                   upstream swiglu_limit_func)
//   gelu_tanh     h = gelu_tanh(g) * u, gelu_tanh(g) = g * sigmoid(2c (g + 0.044715 g^3)),
//                 c = sqrt(2 / pi)                                 (Gemma 4: transformers'
//                                                                   gelu_pytorch_tanh, SGLang's
//                                                                   GeluAndMul; 0.5 (1 + tanh z)
//                                                                   = sigmoid(2 z))
// g and u are the gate and up halves (w13 rows [0, I) and [I, 2I)), their biases added.
#define SGLK_EXPERT_ACTIVATIONS(X) X(silu) X(swiglu_oai) X(swiglu_limit) X(gelu_tanh)
#define SGLK_EXPERT_ACTIVATION_ENUMERATOR(name) kAct_##name,
enum ExpertActivationCode : int32_t { SGLK_EXPERT_ACTIVATIONS(SGLK_EXPERT_ACTIVATION_ENUMERATOR) kActCount };
#undef SGLK_EXPERT_ACTIVATION_ENUMERATOR

struct Activation {
  int32_t code;  // ExpertActivationCode
  float alpha;   // swiglu_oai's sigmoid slope (gpt-oss: 1.702)
  float limit;   // swiglu_oai / swiglu_limit clamp (gpt-oss: 7.0)
};

// Elements along K per scale group (fp8: the 128-wide block; its 128-row extent is kFp8Block too).
static constexpr int64_t kFp8Block = 128;
static constexpr int64_t kMxfp4Group = 32;
static constexpr int64_t kNvfp4Group = 16;

// One quantized weight matrix (fp8, mxfp4 or nvfp4) of an expert, rows of n elements along K.
struct QuantMatrix {
  int32_t format;     // kFormat_fp8 | kFormat_mxfp4 | kFormat_nvfp4
  const uint8_t* w;   // row 0 of the matrix; row r at w + r * w_rs
  int64_t w_rs;       // bytes per row: n (fp8) or n / 2 (4-bit)
  const void* scale;  // row 0's scales: fp8 f32 [ceil(rows/128) or rows, scale_rs]; mxfp4 uint8 and nvfp4
                      // float8_e4m3fn [rows, scale_rs]
  int64_t scale_rs;   // scale elements per scale row
  float global;       // nvfp4: the matrix's global scale; 1 otherwise
  // fp8 only: weight row r reads scale row r / scale_row_div, and its 128-column block b the
  // element b * scale_col_step of it: kFp8Block and 1 for 128 x 128 blocks, 1 and 0 for one
  // scale per row (per output channel). Either way the weight is fp32(fp8 * its scale).
  int64_t scale_row_div;
  int64_t scale_col_step;
};

// Floats of storage per activation row given to dot_q (x rows are zero-padded to this length;
// the bf16 layout below uses its first quant_xb_stride(n) / 2 floats).
static inline int64_t quant_x_stride(int64_t n) { return (n + 63) / 64 * 64; }

// dot_q's activation layouts; a table's prep_x writes the one its dot_q reads.
// The fp32 layout (every level but avx512bf16): position of element i for `format`:
// the identity for fp8; for the 4-bit formats, within every 16 elements the even ones first,
// then the odd ones (the order in which 8 packed bytes decode: low nibbles, then high nibbles).
static inline int64_t quant_x_pos(int32_t format, int64_t i) {
  if (format == kFormat_fp8) return i;
  const int64_t j = i & 15;
  return (i - j) + (j >> 1) + ((j & 1) << 3);
}

// xf[quant_x_pos(format, i)] = float(x[i]) for i0 <= i < i1 (x: bf16 bits); with pad, also
// xf[i] = 0 for n <= i < quant_x_stride(n).
static inline void quant_prep_x(int32_t format, const uint16_t* x, int64_t i0, int64_t i1, int64_t n, bool pad,
                                float* xf) {
  for (int64_t i = i0; i < i1; ++i) {
    const uint32_t u = static_cast<uint32_t>(x[i]) << 16;
    __builtin_memcpy(xf + quant_x_pos(format, i), &u, 4);
  }
  if (pad)
    for (int64_t i = n; i < quant_x_stride(n); ++i) xf[i] = 0.0f;
}

// The bf16 layout (avx512bf16's 4-bit dots, vdpbf16ps): the bf16 bits themselves, within every
// 128 elements four runs of 32, run q holding elements 4k + q (64 packed bytes read as 32 words
// of four codes, each shifted by 4q), zero-padded to a multiple of 128 elements.
static inline int64_t quant_xb_stride(int64_t n) { return (n + 127) / 128 * 128; }
static inline int64_t quant_xb_pos(int64_t i) { return (i & ~int64_t{127}) + ((i & 3) << 5) + ((i & 127) >> 2); }
static inline void quant_prep_xb(const uint16_t* x, int64_t i0, int64_t i1, int64_t n, bool pad, uint16_t* xb) {
  for (int64_t i = i0; i < i1; ++i) xb[quant_xb_pos(i)] = x[i];
  if (pad)
    for (int64_t i = n; i < quant_xb_stride(n); ++i) xb[quant_xb_pos(i)] = 0;
}

// avx512bf16's fp8 layout: the bf16 bits in natural order (vdpbf16ps pairs elements 2j and
// 2j + 1 of 32 bytes widened to words), zero-padded to a multiple of 32 elements.
static inline void quant_prep_x8b(const uint16_t* x, int64_t i0, int64_t i1, int64_t n, bool pad, uint16_t* xb) {
  for (int64_t i = i0; i < i1; ++i) xb[i] = x[i];
  if (pad)
    for (int64_t i = n; i < (n + 31) / 32 * 32; ++i) xb[i] = 0;
}

struct CpuExecutorKernels {
  const char* name;  // "scalar" | "avx2" | "avx512" | "avx512bf16"
  const char* dot;   // how the bf16 dots are computed, for expert_pool_info()

  // y[c][r] = sum_{i<n} w[r * w_rs + i] * x[c][i] for r < rows, c < cols.
  // w and x are bf16 bits; products and sums in fp32 (exact bf16 products).
  void (*dot_tile)(const uint16_t* w, int64_t w_rs, int64_t rows, const uint16_t* const* x, int64_t cols, int64_t n,
                   float* const* y);

  // h[i] = bf16(act(g[i], u[i])) for i < n (act: the Activation above) in fp32, rounded once to
  // bf16 (nearest-even); silu(g) = g / (1 + exp(-g)), sigmoid(z) = 1 / (1 + exp(-z)).
  void (*glu_bf16)(const float* g, const float* u, int64_t n, const Activation* act, uint16_t* h);

  // r = 0; for k < nk: r = fma(ws[k], ys[k][i], r);  out[i] = accumulate ? out[i] + r : r
  // for i < n (k in order; fma is a single rounding on the SIMD levels).
  void (*weighted_sum)(float* out, int64_t n, const float* const* ys, const float* ws, int64_t nk, int32_t accumulate);

  // Writes x (bf16 bits) into the activation layout this table's dot_q reads for `format`
  // (quant_prep_x's fp32 layout, or on avx512bf16 the bf16 ones: quant_prep_xb for the 4-bit
  // formats, quant_prep_x8b for fp8), into rows of quant_x_stride(n) floats of storage: elements i0 <= i < i1, and with
  // pad the zero padding after n (x may be null when i0 == i1).
  void (*prep_x)(int32_t format, const uint16_t* x, int64_t i0, int64_t i1, int64_t n, int32_t pad, float* xf);

  // y[c][r] = sum_{i<n} dequant(m, r0 + r, i) * x[c][i] for r < rows, c < cols, with x in the
  // format's activation layout written by prep_x: products and sums in fp32 (the bf16 layouts:
  // vdpbf16ps over each scale group's or 128-wide block's codes, then one fma by its scale). n must be a
  // multiple of the format's group for the 4-bit formats (the op checks).
  void (*dot_q)(const QuantMatrix* m, int64_t r0, int64_t rows, const float* const* x, int64_t cols, int64_t n,
                float* const* y);

  // Reads `bytes` bytes from p (64-byte aligned, bytes a multiple of 256) with
  // full-width loads and returns a value that depends on all of them (so the
  // reads are not optimised away). Used to measure read bandwidth.
  uint64_t (*stream_read)(const void* p, int64_t bytes);
};

}  // namespace sglk
