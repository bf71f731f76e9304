// The expert-slot cache's enumerations and its fill-count formula: the one definition that the
// CPU op (csrc/cpu/expert_cache.cpp), the CUDA kernels (csrc/cuda/expert_cache.cu) and, through
// the op `expert_cache_enum`, Python (sglang/srt/layers/moe/expert_cache/control.py) read.
// No torch header: the CUDA kernel file includes it and compiles with nvcc alone.
//
// Semantics of the control step: steps 1-9 of
// python/sglang/srt/layers/moe/expert_cache/reference.py (FreeToken §3.2 Eq. 4, §4.1).
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define SGLK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SGLK_HOST_DEVICE inline
#endif

namespace sglk::expert_cache {

// The miss policy: what a control step does with the m misses of a layer call. The position in
// the list is the op's `policy` argument; the name is `--expert-cache-policy`'s value.
//   qstar  q = clamp(round(m * B_P / B_H), 1, m) fills (paper Eq. 4), the rest on the CPU
//   fill   every miss filled (an on-demand LRU cache, as upstream's paged experts)
//   cpu    no fill ever: the load-time placement stays, every miss runs on the CPU
#define SGLK_EXPERT_CACHE_MISS_POLICIES(X) X(qstar) X(fill) X(cpu)

// The counters of one call (`counts`, int32) and their running sums (`stats`, int64), in one
// order. `fills` comes first: the bank copy reads counts[fills] as its valid work-list length.
//   fills        q, experts copied host pool -> slot
//   cpu_experts  m - q, missed experts executed on the CPU from the host pool
//   hits         distinct routed experts found in a slot
//   misses       m, distinct routed experts not in a slot
#define SGLK_EXPERT_CACHE_STATS(X) X(fills) X(cpu_experts) X(hits) X(misses)

#define SGLK_EXPERT_CACHE_ENUMERATOR(name) name,
enum class MissPolicy : int32_t { SGLK_EXPERT_CACHE_MISS_POLICIES(SGLK_EXPERT_CACHE_ENUMERATOR) count };
namespace stat {
enum : int32_t { SGLK_EXPERT_CACHE_STATS(SGLK_EXPERT_CACHE_ENUMERATOR) count };
}
#undef SGLK_EXPERT_CACHE_ENUMERATOR

// Limits of the CUDA control kernel (one block): per-expert token counts and results live in
// shared memory (8 bytes per expert), and the sorted victim / fill lists are one warp wide.
// Python reads them through the op `expert_cache_cuda_limits` to check a model at startup.
constexpr int32_t kCudaMaxExperts = 4096;  // E
constexpr int32_t kCudaMaxFill = 32;       // F

SGLK_HOST_DEVICE bool is_miss_policy(int64_t policy) {
  return policy >= 0 && policy < static_cast<int64_t>(MissPolicy::count);
}

// Step 4 before the capacity limits: how many of the m misses to fill, computed in float64
// without a fused multiply-add, so the host and the device agree bit for bit.
SGLK_HOST_DEVICE int64_t policy_fill_count(MissPolicy policy, int64_t m, double fill_ratio) {
  if (policy == MissPolicy::fill) return m;
  if (policy == MissPolicy::cpu || m == 0) return 0;
#if defined(__CUDA_ARCH__)
  const double r = floor(__dadd_rn(__dmul_rn(static_cast<double>(m), fill_ratio), 0.5));
#else
  const double x = static_cast<double>(m) * fill_ratio;  // baseline ISA: no FMA contraction
  const double r = floor(x + 0.5);
#endif
  const int64_t q = r >= static_cast<double>(m) ? m : static_cast<int64_t>(r);
  return q < 1 ? 1 : q;
}

}  // namespace sglk::expert_cache
