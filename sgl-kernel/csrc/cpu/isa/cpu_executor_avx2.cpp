// AVX2 + FMA build of the CPU expert executor's kernels
// (cpu_executor_kernels.h). The target ISA is raised for this file's own functions
// only (push/pop around the include); the table getter below is compiled for
// the baseline ISA, and dispatch.cpp only hands the table out when the CPU
// supports the level.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define SGLK_ISA_LEVEL 1
#define SGLK_MOE_DPBF16 0
#define SGLK_MOE_NAME "avx2"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
// GCC 12 reports its own _mm*_undefined_* helpers (inside the reduce
// intrinsics) as uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "cpu_executor_kernels.h"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

extern "C" const sglk::MoeKernels* sglk_moe_kernels_avx2() { return &sglk::kMoeTable; }

#else
#include "cpu_executor_args.h"
extern "C" const sglk::MoeKernels* sglk_moe_kernels_avx2() { return nullptr; }
#endif
