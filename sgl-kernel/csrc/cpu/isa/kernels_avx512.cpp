// AVX-512 (F, BW, VL, DQ) build of the kernels in kernels_impl.h; see
// kernels_avx2.cpp for how the target ISA is confined to this file's kernels.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#define SGLK_ISA_LEVEL 2
#define SGLK_ISA_NAME "avx512"
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

extern "C" const sglk::IsaKernels* sglk_isa_kernels_avx512() { return &sglk::kTable; }

#else
#include "kernel_args.h"
extern "C" const sglk::IsaKernels* sglk_isa_kernels_avx512() { return nullptr; }
#endif
