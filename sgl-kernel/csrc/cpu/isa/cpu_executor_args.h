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
//  * silu_mul_bf16 and weighted_sum are element-wise and give the same value
//    for an element wherever it falls in the range (tails are computed through
//    zero-padded full vectors, never through a different scalar formula).
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace sglk {

struct CpuExecutorKernels {
  const char* name;  // "scalar" | "avx2" | "avx512" | "avx512bf16"
  const char* dot;   // how the bf16 dots are computed, for expert_pool_info()

  // y[c][r] = sum_{i<n} w[r * w_rs + i] * x[c][i] for r < rows, c < cols.
  // w and x are bf16 bits; products and sums in fp32 (exact bf16 products).
  void (*dot_tile)(const uint16_t* w, int64_t w_rs, int64_t rows, const uint16_t* const* x, int64_t cols, int64_t n,
                   float* const* y);

  // h[i] = bf16(silu(g[i]) * u[i]) for i < n, silu(g) = g / (1 + exp(-g)) in
  // fp32, rounded once to bf16 (nearest-even).
  void (*silu_mul_bf16)(const float* g, const float* u, int64_t n, uint16_t* h);

  // r = 0; for k < nk: r = fma(ws[k], ys[k][i], r);  out[i] = accumulate ? out[i] + r : r
  // for i < n (k in order; fma is a single rounding on the SIMD levels).
  void (*weighted_sum)(float* out, int64_t n, const float* const* ys, const float* ws, int64_t nk, int32_t accumulate);

  // Reads `bytes` bytes from p (64-byte aligned, bytes a multiple of 256) with
  // full-width loads and returns a value that depends on all of them (so the
  // reads are not optimised away). Used to measure read bandwidth.
  uint64_t (*stream_read)(const void* p, int64_t bytes);
};

}  // namespace sglk
