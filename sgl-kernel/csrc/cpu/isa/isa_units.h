// The SIMD translation units: one line per (kernel family, ISA level). This list is the only
// place a unit is named. sgl-kernel/setup.py generates one .cpp per line into
// build/isa_units/ (defines from the line, then isa_unit.h, the one source of every unit), and
// dispatch.cpp declares each unit's table getter from it.
//
//   SGLK_ISA_UNIT(family, name, level, target, dpbf16)
//     family  kernels       the general CPU ops' kernels (kernels_impl.h, table IsaKernels)
//             cpu_executor  the CPU executor's kernels (cpu_executor_kernels.h, table
//                           CpuExecutorKernels)
//     name    the level's name, also its getter's suffix: sglk_<family>_<name>()
//     level   the vec.h level: 0 scalar, 1 AVX2+FMA, 2 AVX-512
//     target  the GCC/clang target the unit's functions are compiled for ("" = the baseline)
//     dpbf16  1: the executor's bf16 dots use vdpbf16ps (AVX512_BF16)
//
// A new level is one line per family here plus its entry in dispatch.cpp's level table.
#define SGLK_ISA_TARGET_AVX2 "avx2,fma,f16c"
#define SGLK_ISA_TARGET_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define SGLK_ISA_TARGET_AVX512BF16 "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"

#define SGLK_ISA_UNITS(SGLK_ISA_UNIT)                               \
  SGLK_ISA_UNIT(kernels, scalar, 0, "", 0)                          \
  SGLK_ISA_UNIT(kernels, avx2, 1, SGLK_ISA_TARGET_AVX2, 0)          \
  SGLK_ISA_UNIT(kernels, avx512, 2, SGLK_ISA_TARGET_AVX512, 0)      \
  SGLK_ISA_UNIT(cpu_executor, scalar, 0, "", 0)                     \
  SGLK_ISA_UNIT(cpu_executor, avx2, 1, SGLK_ISA_TARGET_AVX2, 0)     \
  SGLK_ISA_UNIT(cpu_executor, avx512, 2, SGLK_ISA_TARGET_AVX512, 0) \
  SGLK_ISA_UNIT(cpu_executor, avx512bf16, 2, SGLK_ISA_TARGET_AVX512BF16, 1)
