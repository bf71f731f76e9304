// The one source of every SIMD translation unit (see isa_units.h). A generated unit defines
//   SGLK_ISA_FAMILY_KERNELS or SGLK_ISA_FAMILY_CPU_EXECUTOR   which kernel family
//   SGLK_ISA_NAME     the level's name ("avx2", ...)
//   SGLK_ISA_LEVEL    0 | 1 | 2 (vec.h: scalar, AVX2+FMA, AVX-512)
//   SGLK_ISA_TARGET   the target string, "" for the baseline
//   SGLK_ISA_DPBF16   0 | 1
//   SGLK_ISA_GETTER   the table getter's name, sglk_<family>_<name>
// and includes this file. The target ISA is raised for the family's kernels only (push/pop
// around the include); the getter is compiled for the baseline ISA, so calling it is safe on any
// CPU, and dispatch.cpp hands a table out only when the CPU supports its level. Without x86 SIMD
// in the build, a SIMD unit's getter returns null.
#if defined(SGLK_ISA_FAMILY_KERNELS)
#define SGLK_ISA_IMPL "kernels_impl.h"
#define SGLK_ISA_ARGS "kernel_args.h"
#define SGLK_ISA_TABLE sglk::IsaKernels
#elif defined(SGLK_ISA_FAMILY_CPU_EXECUTOR)
#define SGLK_ISA_IMPL "cpu_executor_kernels.h"
#define SGLK_ISA_ARGS "cpu_executor_args.h"
#define SGLK_ISA_TABLE sglk::CpuExecutorKernels
#else
#error "define SGLK_ISA_FAMILY_KERNELS or SGLK_ISA_FAMILY_CPU_EXECUTOR before including isa_unit.h"
#endif

#define SGLK_ISA_STRINGIFY(...) #__VA_ARGS__
#define SGLK_ISA_PRAGMA(...) _Pragma(SGLK_ISA_STRINGIFY(__VA_ARGS__))

#if SGLK_ISA_LEVEL == 0 || defined(__x86_64__) || defined(__i386__)
#if SGLK_ISA_LEVEL > 0
#include <immintrin.h>
#if defined(__clang__)
SGLK_ISA_PRAGMA(clang attribute push(__attribute__((target(SGLK_ISA_TARGET))), apply_to = function))
#else
#pragma GCC push_options
SGLK_ISA_PRAGMA(GCC target(SGLK_ISA_TARGET))
#endif
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own _mm*_undefined_* helpers (inside the reduce intrinsics) as
// uninitialized, and cannot bound the chunk loops (their trip counts come from arguments).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Waggressive-loop-optimizations"
#endif
#include SGLK_ISA_IMPL
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#if SGLK_ISA_LEVEL > 0
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

extern "C" const SGLK_ISA_TABLE* SGLK_ISA_GETTER() { return &sglk::kTable; }

#else  // a SIMD level in a build without x86 SIMD
#include SGLK_ISA_ARGS
extern "C" const SGLK_ISA_TABLE* SGLK_ISA_GETTER() { return nullptr; }
#endif
