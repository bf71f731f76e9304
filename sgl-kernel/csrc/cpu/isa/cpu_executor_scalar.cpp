// Portable fallback of the CPU expert executor's kernels (cpu_executor_kernels.h)
// on plain fp32 scalars, compiled for the baseline ISA of the build. Used when
// the CPU has no AVX2+FMA (or when forced with SGLANG_CPU_KERNEL_ISA=scalar).
#define SGLK_ISA_LEVEL 0
#define SGLK_MOE_DPBF16 0
#define SGLK_MOE_NAME "scalar"
#include "cpu_executor_kernels.h"

extern "C" const sglk::MoeKernels* sglk_moe_kernels_scalar() { return &sglk::kMoeTable; }
