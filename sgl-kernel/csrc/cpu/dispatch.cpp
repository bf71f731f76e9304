// Runtime selection of the SIMD kernel tables.
//
// The kernels are compiled once per ISA level (the units of isa/isa_units.h)
// and the best level the running CPU supports is picked on first use, so the extension
// runs on any x86-64 (and any other architecture through the scalar build).
// Levels, best first:
//   avx512bf16  AVX-512 F/BW/VL/DQ + AVX512_BF16: the CPU executor's bf16
//               dots use vdpbf16ps; every other kernel is the avx512 one
//   avx512      AVX-512 F/BW/VL/DQ
//   avx2        AVX2 + FMA
//   scalar      portable C++
// SGLANG_CPU_KERNEL_ISA=avx512bf16|avx512|avx2|scalar caps the choice; the
// sgl_kernel.set_cpu_isa op switches it at run time (used by the tests to
// check every level against the same references).
#include <ATen/ATen.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "common.h"
#include "isa/isa_units.h"

// The table getter of every unit of isa/isa_units.h (defined by its generated .cpp).
#define SGLK_ISA_TABLE_kernels sglk::IsaKernels
#define SGLK_ISA_TABLE_cpu_executor sglk::CpuExecutorKernels
#define SGLK_ISA_DECLARE_GETTER(family, name, level, target, dpbf16) \
  extern "C" const SGLK_ISA_TABLE_##family* sglk_##family##_##name();
SGLK_ISA_UNITS(SGLK_ISA_DECLARE_GETTER)
#undef SGLK_ISA_DECLARE_GETTER

namespace sglk {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool cpu_has_avx512bf16() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// One selectable level: the general kernel table and the CPU executor's.
struct Level {
  const char* name;
  const IsaKernels* isa;
  const CpuExecutorKernels* cpu_executor;
};

const Level* level_for(const std::string& name) {
  static const Level bf16{"avx512bf16", sglk_kernels_avx512(), sglk_cpu_executor_avx512bf16()};
  static const Level avx512{"avx512", sglk_kernels_avx512(), sglk_cpu_executor_avx512()};
  static const Level avx2{"avx2", sglk_kernels_avx2(), sglk_cpu_executor_avx2()};
  static const Level scalar{"scalar", sglk_kernels_scalar(), sglk_cpu_executor_scalar()};
  if (name == "avx512bf16") return cpu_has_avx512bf16() ? &bf16 : nullptr;
  if (name == "avx512") return cpu_has_avx512() ? &avx512 : nullptr;
  if (name == "avx2") return cpu_has_avx2() ? &avx2 : nullptr;
  if (name == "scalar") return &scalar;
  return nullptr;
}

bool is_level_name(const std::string& n) { return n == "avx512bf16" || n == "avx512" || n == "avx2" || n == "scalar"; }

const Level* best_level() {
  std::string cap = "avx512bf16";
  if (const char* env = std::getenv("SGLANG_CPU_KERNEL_ISA")) {
    std::string e(env);
    if (!e.empty() && e != "auto") {
      TORCH_CHECK(is_level_name(e), "SGLANG_CPU_KERNEL_ISA must be auto, avx512bf16, avx512, avx2 or scalar, got '", e,
                  "'");
      cap = e;
    }
  }
  const char* order[] = {"avx512bf16", "avx512", "avx2", "scalar"};
  bool allowed = false;
  for (const char* n : order) {
    if (cap == n) allowed = true;
    if (!allowed) continue;
    if (const Level* l = level_for(n)) return l;
  }
  return level_for("scalar");
}

std::atomic<const Level*> g_level{nullptr};

const Level& level() {
  const Level* l = g_level.load(std::memory_order_acquire);
  if (l == nullptr) {
    l = best_level();
    g_level.store(l, std::memory_order_release);
  }
  return *l;
}

}  // namespace

const IsaKernels& kernels() { return *level().isa; }

const CpuExecutorKernels& cpu_executor_kernels() { return *level().cpu_executor; }

std::string current_isa() { return level().name; }

std::string select_isa(const std::string& name) {
  if (name == "auto") {
    g_level.store(best_level(), std::memory_order_release);
    return current_isa();
  }
  TORCH_CHECK(is_level_name(name), "ISA must be auto, avx512bf16, avx512, avx2 or scalar, got '", name, "'");
  const Level* l = level_for(name);
  TORCH_CHECK(l != nullptr, "this CPU does not support the ", name, " kernels");
  g_level.store(l, std::memory_order_release);
  return current_isa();
}

}  // namespace sglk
