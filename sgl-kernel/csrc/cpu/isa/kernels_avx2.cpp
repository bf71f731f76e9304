// AVX2 + FMA build of the kernels in kernels_impl.h. The target ISA is raised
// for this file's own functions only (push/pop around the include); the table
// getter below is compiled for the baseline ISA so that calling it is safe on
// any x86-64. dispatch.cpp only hands the table out when the CPU has AVX2+FMA.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define SGLK_ISA_LEVEL 1
#define SGLK_ISA_NAME "avx2"
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

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

extern "C" const sglk::IsaKernels* sglk_isa_kernels_avx2() { return &sglk::kTable; }

#else
#include "kernel_args.h"
extern "C" const sglk::IsaKernels* sglk_isa_kernels_avx2() { return nullptr; }
#endif
