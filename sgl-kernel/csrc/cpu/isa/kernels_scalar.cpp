// Portable fallback: the kernels of kernels_impl.h on plain fp32 scalars,
// compiled for the baseline ISA of the build. Used when the CPU has neither
// AVX2+FMA nor AVX-512 (or when forced with SGLANG_CPU_KERNEL_ISA=scalar).
#define SGLK_ISA_LEVEL 0
#define SGLK_ISA_NAME "scalar"
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own _mm512_undefined_* helpers as maybe-uninitialized,
// and cannot bound the chunk loops (their trip counts come from arguments).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Waggressive-loop-optimizations"
#endif
#include "kernels_impl.h"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

extern "C" const sglk::IsaKernels* sglk_isa_kernels_scalar() { return &sglk::kTable; }
