// CUDA kernels of the expert slot cache (FreeToken, paper §3.2 Eq. 4, §4.1 "Device-side cache
// control"): the per-layer control step and the fused bank copy. No torch headers here (the
// binding is expert_cache_binding.cpp), so this file compiles with nvcc alone:
//
//   nvcc -c -std=c++17 -arch=sm_90 -I.. expert_cache.cu   (-I csrc, for shared/expert_cache.h)
//
// Semantics: steps 1-9 of python/sglang/srt/layers/moe/expert_cache/reference.py, identical to
// the CPU op (csrc/cpu/expert_cache.cpp), except that routed ids outside [-1, E) are padding. The
// miss policies, the counter order and the fill-count formula are csrc/shared/expert_cache.h.
//
// Control kernel: ONE block of kThreads threads, so every phase is ordered by __syncthreads
// alone and the whole step is one graph-capturable launch whose outputs have fixed shapes (the
// valid counts are written to device memory). Limits (checked by the binding on the host, no
// sync): E <= kControlMaxExperts (token counts and per-expert results in shared memory,
// 8 bytes per expert), F <= kControlMaxFill (= warp width), S < 2^31. Cost: the routed entries
// are read twice (count, rewrite), experts once, and slot_last_use once (the single victim pass,
// skipped when nothing is to be filled).
//
// Selection of the q smallest keys (victims: (last_use, slot); fills: (-tokens, expert)): each
// warp keeps a sorted list of up to q keys distributed over its lanes (lane j holds the j-th
// smallest) while it scans its share of the items 32 at a time; a key enters when it is smaller
// than the list's q-th key (one ballot rejects a whole chunk in the common case), by a ballot for
// its position and one shuffle-up. Warp 0 then merges the per-warp lists the same way. Keys are
// unique (the slot or expert index is part of the key), so the result is deterministic.
#include <climits>
#include <cstdint>

#include "expert_cache.h"
#include "shared/expert_cache.h"

namespace sglk_cuda {
namespace {

namespace ec = sglk::expert_cache;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMiss = -2;  // per-expert result of a routed miss that is not filled (CPU)
constexpr int kCopyThreads = 256;

static_assert(kControlMaxFill <= 32, "the selection lists are one warp wide");
static_assert(kThreads >= kControlMaxFill, "one thread per fill-list entry");

__device__ __forceinline__ bool key_less(long long a1, int b1, long long a2, int b2) {
  return a1 < a2 || (a1 == a2 && b1 < b2);
}

__device__ __forceinline__ int warp_sum(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// Sorted list of up to `cap` (<= 32) keys held by one warp: lane j holds the j-th smallest,
// lanes past the list's end hold the sentinel (LLONG_MAX, INT_MAX), larger than any real key.
struct WarpList {
  long long a;
  int b;

  __device__ __forceinline__ void clear() {
    a = LLONG_MAX;
    b = INT_MAX;
  }

  // Threshold: the cap-th smallest kept key (the sentinel while fewer are kept).
  __device__ __forceinline__ void threshold(int cap, long long& ta, int& tb) const {
    ta = __shfl_sync(kFull, a, cap - 1);
    tb = __shfl_sync(kFull, b, cap - 1);
  }

  // Insert the warp-uniform key (ka, kb) if it is below the threshold. All lanes call this.
  __device__ __forceinline__ void offer(long long ka, int kb, int cap, int lane) {
    long long ta;
    int tb;
    threshold(cap, ta, tb);
    if (!key_less(ka, kb, ta, tb)) return;                                 // uniform branch
    const int pos = __popc(__ballot_sync(kFull, key_less(a, b, ka, kb)));  // pos < cap
    const long long ua = __shfl_up_sync(kFull, a, 1);
    const int ub = __shfl_up_sync(kFull, b, 1);
    if (lane == pos) {
      a = ka;
      b = kb;
    } else if (lane > pos && lane < cap) {
      a = ua;
      b = ub;
    }
  }

  // Offer every lane's (ka, kb) for which `valid` holds; cheap when none beats the threshold.
  __device__ __forceinline__ void offer_lanes(bool valid, long long ka, int kb, int cap, int lane) {
    long long ta;
    int tb;
    threshold(cap, ta, tb);
    unsigned pass = __ballot_sync(kFull, valid && key_less(ka, kb, ta, tb));
    while (pass) {
      const int src = __ffs(pass) - 1;
      pass &= pass - 1;
      const long long xa = __shfl_sync(kFull, ka, src);
      const int xb = __shfl_sync(kFull, kb, src);
      offer(xa, xb, cap, lane);
    }
  }
};

// Block-wide: the `cap` (1..32) smallest keys over the candidates among items [0, n), sorted
// into out_a/out_b[0, 32) (sentinels past the candidates). gen(i, a, b) says whether item i is a
// candidate and sets its key. Adds the number of candidates to *count when count is non-null.
// Must be called by all threads with uniform arguments; ends with __syncthreads().
template <class Gen>
__device__ void block_select(int64_t n, int cap, Gen gen, long long* out_a, int* out_b, int* count, long long (*wa)[32],
                             int (*wb)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  WarpList list;
  list.clear();
  int found = 0;
  for (int64_t base = static_cast<int64_t>(warp) * 32; base < n; base += kThreads) {
    const int64_t i = base + lane;
    long long ka = LLONG_MAX;
    int kb = INT_MAX;
    const bool cand = i < n && gen(i, ka, kb);
    found += __popc(__ballot_sync(kFull, cand));
    list.offer_lanes(cand, ka, kb, cap, lane);
  }
  wa[warp][lane] = list.a;
  wb[warp][lane] = list.b;
  if (count != nullptr && lane == 0 && found > 0) atomicAdd(count, found);
  __syncthreads();
  if (warp == 0) {
    WarpList merged;
    merged.a = wa[0][lane];
    merged.b = wb[0][lane];
    for (int w = 1; w < kWarps; ++w) merged.offer_lanes(lane < cap, wa[w][lane], wb[w][lane], cap, lane);
    out_a[lane] = merged.a;
    out_b[lane] = merged.b;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) expert_cache_control_kernel(const ControlArgs p) {
  extern __shared__ int32_t smem[];
  const int E = p.num_experts;
  int32_t* tokens = smem;      // [E] routed entries per expert
  int32_t* result = smem + E;  // [E] slot after the call, kMiss (CPU), or -1 (not routed)
  __shared__ long long wa[kWarps][32];
  __shared__ int wb[kWarps][32];
  __shared__ long long victim_a[32], fill_a[32];
  __shared__ int victim_slot[32], fill_expert[32];
  __shared__ int s_hits, s_misses, s_candidates, s_live;
  __shared__ long long s_now;
  const int tid = threadIdx.x, lane = tid & 31;

  // 1. clock
  if (tid == 0) {
    s_now = p.clock[0] + 1;
    s_hits = s_misses = s_candidates = 0;
    const int live = p.live_slots != nullptr ? *p.live_slots : p.num_slots;  // device data: no sync
    s_live = live < 0 ? 0 : (live > p.num_slots ? p.num_slots : live);
  }
  for (int e = tid; e < E; e += kThreads) tokens[e] = 0;
  __syncthreads();
  const long long now = s_now;
  const int S = s_live;  // slots [S, num_slots) are outside the cache: never hit, never a victim
  if (tid == 0) p.clock[0] = now;

  // 2. deduplicate: tokens per expert (ids outside [0, E) are padding)
  for (int64_t i = tid; i < p.n_entries; i += kThreads) {
    const int32_t e = p.topk_ids[i];
    if (e >= 0 && e < E) atomicAdd(&tokens[e], 1);
  }
  __syncthreads();

  // 3. classify; hits take the current time
  const int32_t base = p.layer * E;
  int my_hits = 0, my_misses = 0;
  for (int e = tid; e < E; e += kThreads) {
    int r = -1;
    if (tokens[e] > 0) {
      const int32_t s = p.slot_of_id[base + e];
      if (s >= 0 && s < S) {
        p.slot_last_use[s] = now;
        r = s;
        ++my_hits;
      } else {
        r = kMiss;
        ++my_misses;
      }
    }
    result[e] = r;
  }
  my_hits = warp_sum(my_hits);
  my_misses = warp_sum(my_misses);
  if (lane == 0 && my_hits > 0) atomicAdd(&s_hits, my_hits);
  if (lane == 0 && my_misses > 0) atomicAdd(&s_misses, my_misses);
  __syncthreads();  // also publishes the hits' slot_last_use to the whole block
  const int hits = s_hits, m = s_misses;

  // 4-6. q, victims (one pass over the slot table), fill order
  // Device data when given (a re-derived B_P / B_H reaches captured graphs); a bad value reads as 0.
  double ratio = p.fill_ratio;
  if (p.live_fill_ratio != nullptr) {
    ratio = *p.live_fill_ratio;
    if (!(ratio >= 0.0 && ratio <= 1.0e300)) ratio = 0.0;
  }
  const int64_t wanted = ec::policy_fill_count(static_cast<ec::MissPolicy>(p.policy), m, ratio);
  int q = static_cast<int>(wanted < p.num_fill ? wanted : p.num_fill);
  if (q > 0) {  // uniform
    int64_t* const lu = p.slot_last_use;
    block_select(
        S, q,
        [&](int64_t s, long long& ka, int& kb) {
          const long long t = lu[s];
          ka = t;
          kb = static_cast<int>(s);
          return t != now;
        },
        victim_a, victim_slot, &s_candidates, wa, wb);
    block_select(
        E, q,
        [&](int64_t e, long long& ka, int& kb) {
          if (result[e] != kMiss) return false;
          ka = -static_cast<long long>(tokens[e]);
          kb = static_cast<int>(e);
          return true;
        },
        fill_a, fill_expert, nullptr, wa, wb);
    q = min(q, s_candidates);
  }

  // 7. install: evict all victims first, then map the fills (a victim's old id is resident and
  // a fill's id is not, so with consistent tables this equals the sequential order).
  if (tid < q) {
    const int v = victim_slot[tid];
    const int32_t old = p.id_of_slot[v];
    if (old >= 0 && old < p.n_ids) p.slot_of_id[old] = -1;
  }
  __syncthreads();
  if (tid < q) {
    const int e = fill_expert[tid];
    const int32_t g = base + e;
    const int v = victim_slot[tid];
    p.id_of_slot[v] = g;
    p.slot_of_id[g] = v;
    p.slot_last_use[v] = now;
    p.fill_src[tid] = g;
    p.fill_dst[tid] = v;
    result[e] = v;
  } else if (tid < p.num_fill) {
    p.fill_src[tid] = -1;
    p.fill_dst[tid] = -1;
  }
  __syncthreads();

  // 8. rewrite
  for (int64_t i = tid; i < p.n_entries; i += kThreads) {
    const int32_t e = p.topk_ids[i];
    int32_t so = -1, co = -1;
    if (e >= 0 && e < E) {
      const int r = result[e];
      if (r >= 0)
        so = r;
      else
        co = base + e;
    }
    p.slot_ids[i] = so;
    p.cpu_ids[i] = co;
  }

  // 9. counts, stats
  if (tid == 0) {
    p.counts[ec::stat::fills] = q;
    p.counts[ec::stat::cpu_experts] = m - q;
    p.counts[ec::stat::hits] = hits;
    p.counts[ec::stat::misses] = m;
    p.stats[ec::stat::fills] += q;
    p.stats[ec::stat::cpu_experts] += m - q;
    p.stats[ec::stat::hits] += hits;
    p.stats[ec::stat::misses] += m;
  }
}

__global__ void __launch_bounds__(kCopyThreads) expert_bank_copy_kernel(const BankCopyArgs p) {
  const int i = blockIdx.x;
  if (i >= p.counts[ec::stat::fills]) return;  // device-side valid count
  const int b = blockIdx.y;
  const int64_t sr = p.fill_src[i], dr = p.fill_dst[i];
  if (sr < 0 || sr >= p.src_rows[b] || dr < 0 || dr >= p.dst_rows[b]) return;
  const int64_t bytes = p.row_bytes[b];
  const char* s = p.src[b] + sr * bytes;
  char* d = p.dst[b] + dr * bytes;
  const int64_t start = static_cast<int64_t>(blockIdx.z) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.z) * blockDim.x;
  if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d) | static_cast<uintptr_t>(bytes)) & 15) == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    const int64_t n4 = bytes / 16;
    for (int64_t k = start; k < n4; k += step) d4[k] = s4[k];
  } else {
    for (int64_t k = start; k < bytes; k += step) d[k] = s[k];
  }
}

}  // namespace

cudaError_t launch_expert_cache_control(const ControlArgs& args, cudaStream_t stream) {
  if (args.num_experts < 1 || args.num_experts > kControlMaxExperts || args.num_fill < 0 ||
      args.num_fill > kControlMaxFill || args.num_slots < 0)
    return cudaErrorInvalidValue;
  const size_t smem = 2 * sizeof(int32_t) * static_cast<size_t>(args.num_experts);
  expert_cache_control_kernel<<<1, kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_expert_bank_copy(const BankCopyArgs& args, cudaStream_t stream) {
  if (args.num_banks < 0 || args.num_banks > kBankCopyMaxBanks || args.num_fill < 0) return cudaErrorInvalidValue;
  if (args.num_banks == 0 || args.num_fill == 0) return cudaSuccess;
  int64_t max_row = 0;
  for (int b = 0; b < args.num_banks; ++b) max_row = args.row_bytes[b] > max_row ? args.row_bytes[b] : max_row;
  if (max_row == 0) return cudaSuccess;
  // Enough blocks per row to keep many 16-byte loads in flight over PCIe (rows are megabytes).
  const int64_t per_block = static_cast<int64_t>(kCopyThreads) * 16 * 8;
  int64_t chunks = (max_row + per_block - 1) / per_block;
  chunks = chunks < 1 ? 1 : (chunks > 64 ? 64 : chunks);
  const dim3 grid(static_cast<unsigned>(args.num_fill), static_cast<unsigned>(args.num_banks),
                  static_cast<unsigned>(chunks));
  expert_bank_copy_kernel<<<grid, kCopyThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace sglk_cuda
