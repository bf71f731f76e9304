// Runtime selection of the SIMD kernel table.
//
// The kernels are compiled three times (isa/kernels_{scalar,avx2,avx512}.cpp)
// and the best level the running CPU supports is picked on first use, so the
// extension runs on any x86-64 (and any other architecture through the scalar
// build). SGLANG_CPU_KERNEL_ISA=scalar|avx2|avx512 caps the choice; the
// sgl_kernel.set_cpu_isa op switches it at run time (used by the tests to
// check every level against the same references).
#include <ATen/ATen.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "common.h"

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

const IsaKernels* table_for(const std::string& name) {
  if (name == "avx512") return cpu_has_avx512() ? sglk_isa_kernels_avx512() : nullptr;
  if (name == "avx2") return cpu_has_avx2() ? sglk_isa_kernels_avx2() : nullptr;
  if (name == "scalar") return sglk_isa_kernels_scalar();
  return nullptr;
}

const IsaKernels* best_table() {
  std::string cap = "avx512";
  if (const char* env = std::getenv("SGLANG_CPU_KERNEL_ISA")) {
    std::string e(env);
    if (!e.empty() && e != "auto") {
      TORCH_CHECK(e == "avx512" || e == "avx2" || e == "scalar",
                  "SGLANG_CPU_KERNEL_ISA must be auto, avx512, avx2 or scalar, got '", e, "'");
      cap = e;
    }
  }
  const char* order[] = {"avx512", "avx2", "scalar"};
  bool allowed = false;
  for (const char* n : order) {
    if (cap == n) allowed = true;
    if (!allowed) continue;
    if (const IsaKernels* t = table_for(n)) return t;
  }
  return sglk_isa_kernels_scalar();
}

std::atomic<const IsaKernels*> g_table{nullptr};

}  // namespace

const IsaKernels& kernels() {
  const IsaKernels* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = best_table();
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

std::string current_isa() { return kernels().name; }

std::string select_isa(const std::string& name) {
  if (name == "auto") {
    g_table.store(best_table(), std::memory_order_release);
    return current_isa();
  }
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar",
              "ISA must be auto, avx512, avx2 or scalar, got '", name, "'");
  const IsaKernels* t = table_for(name);
  TORCH_CHECK(t != nullptr, "this CPU does not support the ", name, " kernels");
  g_table.store(t, std::memory_order_release);
  return current_isa();
}

}  // namespace sglk
