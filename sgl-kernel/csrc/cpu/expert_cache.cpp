// Expert slot cache (FreeToken, paper §3.2 Eq. 4 and §4.1 "Device-side cache control"):
//
//   expert_cache_control   one MoE layer's cache step: dedup routed experts, hits/misses,
//                          q* fill count, LRU victims, table update, id rewrite
//   expert_bank_copy       copy the filled experts' rows of every bank (host pool -> slots)
//
// The exact semantics (steps 1-9) are the docstring of
// python/sglang/srt/layers/moe/expert_cache/reference.py, whose plain-Python model the tests
// compare against; the CUDA kernels (csrc/cuda/expert_cache.cu) implement the same steps.
// The enumerations (miss policy, counter order), the fill-count formula and the argument checks
// are shared with the CUDA kernels: csrc/shared/expert_cache.h and expert_cache_checks.h.
// The ops are registered here in their own TORCH_LIBRARY_FRAGMENT so that they stay apart from
// the other ops' registration block; `expert_cache_enum` hands the enumerations to Python.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "shared/expert_cache_checks.h"

namespace sglk {
namespace {

namespace ec = sglk::expert_cache;
const at::Device kCpu(at::kCPU);

// Per-thread scratch. tokens[] (indexed by layer-local expert id) is all-zero between calls.
struct Scratch {
  std::vector<int32_t> tokens;    // [E] routed (t, k) entries per expert
  std::vector<int32_t> result;    // [E] slot after the call, or -1 (CPU); valid for routed ids only
  std::vector<int32_t> distinct;  // [E + 1] routed ids in first-seen order (n_distinct valid)
  std::vector<int32_t> misses;    // [E]
  int64_t n_distinct = 0;
  std::vector<std::pair<int64_t, int32_t>> victims;  // (last_use, slot) candidates, then the q smallest
};

Scratch& scratch(int64_t num_experts) {
  thread_local Scratch s;
  if (static_cast<int64_t>(s.tokens.size()) < num_experts) {
    s.tokens.resize(num_experts, 0);
    s.result.resize(num_experts, -1);
    s.distinct.resize(num_experts + 1);  // the dedup loop writes one past the last distinct id
    s.misses.resize(num_experts);
  }
  return s;
}

// Restores the all-zero tokens[] when the call ends, also by an exception.
struct TokensReset {
  Scratch& s;
  ~TokensReset() {
    for (int64_t i = 0; i < s.n_distinct; ++i) s.tokens[s.distinct[i]] = 0;
    s.n_distinct = 0;
  }
};

// ---- step 6: the `cap` smallest (last_use, slot) among the slots with last_use != now ----
//
// One pass over the slot table. Candidates below a threshold are appended to a buffer; when it
// holds `limit` keys it is cut back to the `cap` smallest (nth_element) and the threshold drops
// to the largest kept last_use. Slots are visited in ascending order, so a later slot whose
// last_use equals the threshold has a larger key than every kept one: the test is
// `last_use < threshold` alone, which SIMD evaluates 16 slots at a time. The threshold starts as
// the largest last_use of the first `cap` candidates. A key found below the threshold is still
// checked against `now` (this call's hits), so any table contents give the exact result.

using Key = std::pair<int64_t, int32_t>;

struct VictimBuffer {
  std::vector<Key>& v;
  size_t cap, limit;
  int64_t now, thresh;

  void cut() {
    std::nth_element(v.begin(), v.begin() + (cap - 1), v.end());
    v.resize(cap);
    thresh = v[cap - 1].first;  // the largest kept key's last_use
  }
  void offer(int64_t t, int64_t s) {
    if (t == now || t >= thresh) return;
    v.emplace_back(t, static_cast<int32_t>(s));
    if (v.size() >= limit) cut();
  }
};

void scan_scalar(const int64_t* lu, int64_t s, int64_t S, VictimBuffer& b) {
  for (; s < S; ++s)
    if (lu[s] < b.thresh) b.offer(lu[s], s);
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void scan_avx2(const int64_t* lu, int64_t s, int64_t S, VictimBuffer& b) {
  for (; s + 16 <= S; s += 16) {
    const __m256i th = _mm256_set1_epi64x(b.thresh);
    const __m256i* p = reinterpret_cast<const __m256i*>(lu + s);
    const int m0 = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(th, _mm256_loadu_si256(p))));
    const int m1 = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(th, _mm256_loadu_si256(p + 1))));
    const int m2 = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(th, _mm256_loadu_si256(p + 2))));
    const int m3 = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(th, _mm256_loadu_si256(p + 3))));
    unsigned mask = static_cast<unsigned>(m0 | (m1 << 4) | (m2 << 8) | (m3 << 12));
    while (mask) {
      const int j = __builtin_ctz(mask);
      mask &= mask - 1;
      b.offer(lu[s + j], s + j);  // re-tests against the (possibly lowered) threshold
    }
  }
  scan_scalar(lu, s, S, b);
}
#endif

bool use_avx2() {
#if defined(__x86_64__)
  return std::strcmp(kernels().name, "scalar") != 0;  // the ISA level selected for all CPU ops
#else
  return false;
#endif
}

// Leaves the min(cap, candidates) smallest keys in v, sorted ascending.
void select_victims(const int64_t* lu, int64_t S, int64_t now, size_t cap, std::vector<Key>& v, bool avx2) {
  v.clear();
  int64_t s = 0;
  for (; s < S && v.size() < cap; ++s)
    if (lu[s] != now) v.emplace_back(lu[s], static_cast<int32_t>(s));
  if (v.size() == cap && s < S) {
    int64_t t_max = v[0].first;
    for (const Key& k : v) t_max = std::max(t_max, k.first);
    VictimBuffer b{v, cap, 4 * cap + 16, now, t_max};
#if defined(__x86_64__)
    if (avx2)
      scan_avx2(lu, s, S, b);
    else
      scan_scalar(lu, s, S, b);
#else
    (void)avx2;
    scan_scalar(lu, s, S, b);
#endif
    if (v.size() > cap) b.cut();
  }
  std::sort(v.begin(), v.end());
}

}  // namespace

void expert_cache_control_cpu(const at::Tensor& topk_ids, int64_t layer, int64_t num_experts,
                              const at::Tensor& slot_of_id, const at::Tensor& id_of_slot,
                              const at::Tensor& slot_last_use, const at::Tensor& clock, const at::Tensor& slot_ids,
                              const at::Tensor& cpu_ids, const at::Tensor& fill_src, const at::Tensor& fill_dst,
                              const at::Tensor& counts, const at::Tensor& stats, double fill_ratio, int64_t policy,
                              const c10::optional<at::Tensor>& live_slots,
                              const c10::optional<at::Tensor>& live_fill_ratio) {
  // ---- argument checks (nothing is changed before all of them pass) ----
  const ec::ControlShape shape =
      ec::check_control_args(topk_ids, layer, num_experts, slot_of_id, id_of_slot, slot_last_use, clock, slot_ids,
                             cpu_ids, fill_src, fill_dst, counts, stats, fill_ratio, policy, kCpu);
  ec::check_live_slots(live_slots, kCpu);
  ec::check_live_fill_ratio(live_fill_ratio, kCpu);
  if (live_fill_ratio.has_value()) {
    fill_ratio = live_fill_ratio->data_ptr<double>()[0];
    TORCH_CHECK(std::isfinite(fill_ratio) && fill_ratio >= 0.0, "live_fill_ratio must be finite and >= 0, got ",
                fill_ratio);
  }
  const int64_t n_ids = shape.n_ids, F = shape.num_fill;
  // Slots [S, capacity) are outside the cache: never a hit (checked below), never a victim.
  const int64_t S = live_slots.has_value() ? live_slots->data_ptr<int32_t>()[0] : shape.num_slots;
  TORCH_CHECK(S >= 0 && S <= shape.num_slots, "live_slots = ", S, " is outside [0, ", shape.num_slots, "]");

  const int32_t* ids = topk_ids.data_ptr<int32_t>();
  const int64_t n = topk_ids.numel();
  int32_t* sof = slot_of_id.data_ptr<int32_t>();
  int32_t* ios = id_of_slot.data_ptr<int32_t>();
  int64_t* lu = slot_last_use.data_ptr<int64_t>();
  const int32_t E = static_cast<int32_t>(num_experts);
  const int32_t base = static_cast<int32_t>(layer * num_experts);

  Scratch& sc = scratch(num_experts);
  TokensReset reset{sc};
  int32_t* const tokens = sc.tokens.data();
  int32_t* const result = sc.result.data();
  int32_t* const distinct = sc.distinct.data();
  int32_t* const misses = sc.misses.data();

  // ---- 2. deduplicate, count tokens per expert (validates the ids) ----
  int64_t nd = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    if (e == -1) continue;
    if (static_cast<uint32_t>(e) >= static_cast<uint32_t>(E)) {
      sc.n_distinct = nd;
      TORCH_CHECK(false, "topk_ids[", i / topk_ids.size(1), ", ", i % topk_ids.size(1), "] = ", e, " is outside [-1, ",
                  E, ")");
    }
    distinct[nd] = e;
    nd += tokens[e]++ == 0;
  }
  sc.n_distinct = nd;
  // ---- 3. classify (read-only until every slot read is validated) ----
  int64_t m = 0, hits = 0;
  for (int64_t i = 0; i < nd; ++i) {
    const int32_t e = distinct[i];
    const int32_t s = sof[base + e];
    TORCH_CHECK(s >= -1 && s < S, "slot_of_id[", base + e, "] = ", s, " is outside [-1, ", S, ")");
    result[e] = s;  // -1 until filled
    hits += s >= 0;
    misses[m] = e;
    m += s < 0;
  }

  // ---- 1. advance the clock; mark hits ----
  int64_t* clk = clock.data_ptr<int64_t>();
  const int64_t now = ++clk[0];
  for (int64_t i = 0; i < nd; ++i)
    if (result[distinct[i]] >= 0) lu[result[distinct[i]]] = now;

  // ---- 4. fill count; 6. victims by one pass over the slot table ----
  int64_t q = std::min(ec::policy_fill_count(static_cast<ec::MissPolicy>(policy), m, fill_ratio), F);
  if (q > 0) {
    select_victims(lu, S, now, static_cast<size_t>(q), sc.victims, use_avx2());
    q = std::min<int64_t>(q, static_cast<int64_t>(sc.victims.size()));
  }

  // ---- 5. fill order: most tokens first, then lower id; 7. install ----
  int32_t* fsrc = fill_src.data_ptr<int32_t>();
  int32_t* fdst = fill_dst.data_ptr<int32_t>();
  if (q > 0) {
    std::partial_sort(misses, misses + q, misses + m, [tokens](int32_t a, int32_t b) {
      return tokens[a] != tokens[b] ? tokens[a] > tokens[b] : a < b;
    });
    for (int64_t i = 0; i < q; ++i) {
      const int32_t e = misses[i];
      const int32_t g = base + e;
      const int32_t v = sc.victims[i].second;
      const int32_t old = ios[v];
      TORCH_CHECK(old >= -1 && old < n_ids, "id_of_slot[", v, "] = ", old, " is outside [-1, ", n_ids, ")");
      if (old >= 0) sof[old] = -1;
      ios[v] = g;
      sof[g] = v;
      lu[v] = now;
      fsrc[i] = g;
      fdst[i] = v;
      result[e] = v;
    }
  }
  for (int64_t i = q; i < F; ++i) fsrc[i] = fdst[i] = -1;

  // ---- 8. rewrite ----
  int32_t* so = slot_ids.data_ptr<int32_t>();
  int32_t* co = cpu_ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    const int32_t r = e == -1 ? -1 : result[e];
    so[i] = r;
    co[i] = (e == -1 || r >= 0) ? -1 : base + e;
  }

  // ---- 9. counts and stats ----
  int32_t* cnt = counts.data_ptr<int32_t>();
  int64_t* st = stats.data_ptr<int64_t>();
  int64_t call[ec::stat::count];
  call[ec::stat::fills] = q;
  call[ec::stat::cpu_experts] = m - q;
  call[ec::stat::hits] = hits;
  call[ec::stat::misses] = m;
  for (int i = 0; i < ec::stat::count; ++i) {
    cnt[i] = static_cast<int32_t>(call[i]);
    st[i] += call[i];
  }
}

// dst_banks[b][fill_dst[i]] = src_banks[b][fill_src[i]] for i < counts[stat::fills], every bank b.
void expert_bank_copy_cpu(const std::vector<at::Tensor>& src_banks, const std::vector<at::Tensor>& dst_banks,
                          const at::Tensor& fill_src, const at::Tensor& fill_dst, const at::Tensor& counts) {
  for (size_t b = 0; b < src_banks.size() && b < dst_banks.size(); ++b)
    TORCH_CHECK(src_banks[b].device().is_cpu() && dst_banks[b].device().is_cpu(), "bank ", b,
                ": CPU tensors expected, got ", src_banks[b].device(), " and ", dst_banks[b].device());
  const std::vector<int64_t> row_bytes =
      ec::check_bank_copy_args(src_banks, dst_banks, fill_src, fill_dst, counts, kCpu);
  const int64_t F = fill_src.numel();
  const int64_t nb = static_cast<int64_t>(src_banks.size());
  std::vector<const char*> src(nb);
  std::vector<char*> dst(nb);
  for (int64_t b = 0; b < nb; ++b) {
    src[b] = static_cast<const char*>(src_banks[b].data_ptr());
    dst[b] = static_cast<char*>(dst_banks[b].data_ptr());
  }
  const int64_t q = counts.data_ptr<int32_t>()[ec::stat::fills];
  TORCH_CHECK(q >= 0 && q <= F, "counts[", ec::stat::fills, "] (fills) = ", q, " is outside [0, ", F, "]");
  const int32_t* fs = fill_src.data_ptr<int32_t>();
  const int32_t* fd = fill_dst.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < q; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      TORCH_CHECK(fs[i] >= 0 && fs[i] < src_banks[b].size(0), "fill_src[", i, "] = ", fs[i], " is outside bank ", b,
                  "'s ", src_banks[b].size(0), " rows");
      TORCH_CHECK(fd[i] >= 0 && fd[i] < dst_banks[b].size(0), "fill_dst[", i, "] = ", fd[i], " is outside bank ", b,
                  "'s ", dst_banks[b].size(0), " rows");
      total += row_bytes[b];
    }
  }
  auto copy = [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = j / nb, b = j % nb;
      std::memcpy(dst[b] + fd[i] * row_bytes[b], src[b] + fs[i] * row_bytes[b], row_bytes[b]);
    }
  };
  // Threads only pay off for large rows (expert weights are megabytes).
  if (total < (int64_t{1} << 20))
    copy(0, q * nb);
  else
    at::parallel_for(0, q * nb, 1, copy);
}

std::vector<std::string> expert_format_names();      // cpu_executor.cpp
std::vector<std::string> expert_activation_names();  // cpu_executor.cpp

// The names of one enumeration in value order: "miss_policy" or "stat" (the order of `counts`
// and `stats`) of csrc/shared/expert_cache.h, or "expert_format" (the CPU executor's `format`
// codes, SGLK_EXPERT_FORMATS of isa/cpu_executor_args.h) or "expert_activation" (its
// `activation` codes, SGLK_EXPERT_ACTIVATIONS).
std::vector<std::string> expert_cache_enum(const std::string& kind) {
  if (kind == "expert_format") return expert_format_names();
  if (kind == "expert_activation") return expert_activation_names();
#define SGLK_EXPERT_CACHE_NAME(name) #name,
  if (kind == "miss_policy") return {SGLK_EXPERT_CACHE_MISS_POLICIES(SGLK_EXPERT_CACHE_NAME)};
  if (kind == "stat") return {SGLK_EXPERT_CACHE_STATS(SGLK_EXPERT_CACHE_NAME)};
#undef SGLK_EXPERT_CACHE_NAME
  TORCH_CHECK(false, "expert_cache_enum: kind must be miss_policy, stat, expert_format or expert_activation, got '",
              kind, "'");
}

// [E, F] limits of the CUDA control kernel, for the host-side startup checks.
std::vector<int64_t> expert_cache_cuda_limits() { return {ec::kCudaMaxExperts, ec::kCudaMaxFill}; }

}  // namespace sglk

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("expert_cache_enum(str kind) -> str[]", &sglk::expert_cache_enum);
  m.def("expert_cache_cuda_limits() -> int[]", &sglk::expert_cache_cuda_limits);
  m.def(
      "expert_cache_control(Tensor topk_ids, int layer, int num_experts, Tensor(a!) slot_of_id, "
      "Tensor(b!) id_of_slot, Tensor(c!) slot_last_use, Tensor(d!) clock, Tensor(e!) slot_ids, Tensor(f!) cpu_ids, "
      "Tensor(g!) fill_src, Tensor(h!) fill_dst, Tensor(i!) counts, Tensor(j!) stats, float fill_ratio, "
      "int policy, Tensor? live_slots=None, Tensor? live_fill_ratio=None) -> ()");
  m.def(
      "expert_bank_copy(Tensor[] src_banks, Tensor(a!)[] dst_banks, Tensor fill_src, Tensor fill_dst, "
      "Tensor counts) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("expert_cache_control", &sglk::expert_cache_control_cpu);
  m.impl("expert_bank_copy", &sglk::expert_bank_copy_cpu);
}
