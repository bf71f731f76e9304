// Expert slot cache (FreeToken, paper §3.2 Eq. 4 and §4.1 "Device-side cache control"):
//
//   expert_cache_control   one MoE layer's cache step: dedup routed experts, hits/misses,
//                          q* fill count, LRU victims, table update, id rewrite
//   expert_bank_copy       copy the filled experts' rows of every bank (host pool -> slots)
//
// The exact semantics (steps 1-9) are the docstring of
// python/sglang/srt/layers/moe/expert_cache/reference.py, whose plain-Python model the tests
// compare against; the CUDA kernels (csrc/cuda/expert_cache.cu) implement the same steps.
// Both ops are registered here in their own TORCH_LIBRARY_FRAGMENT so that they stay apart from
// the other ops' registration block.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace sglk {
namespace {

constexpr int64_t kPolicyQstar = 0, kPolicyFill = 1, kPolicyCpu = 2;

void check_i32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_i64(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Step 4 before the capacity limits (same expression as the CUDA kernel and reference.py).
int64_t policy_fill_count(int64_t policy, int64_t m, double fill_ratio) {
  if (policy == kPolicyFill) return m;
  if (policy == kPolicyCpu || m == 0) return 0;
  const double x = static_cast<double>(m) * fill_ratio;
  const double r = std::floor(x + 0.5);
  const int64_t q = r >= static_cast<double>(m) ? m : static_cast<int64_t>(r);
  return std::clamp<int64_t>(q, 1, m);
}

// Per-thread scratch, indexed by layer-local expert id. tokens[] is all-zero between calls.
struct Scratch {
  std::vector<int32_t> tokens;  // routed (t, k) entries per expert
  std::vector<int32_t> result;  // slot after the call, or -1 (CPU); valid for routed ids only
  std::vector<int32_t> distinct, misses;
  std::vector<std::pair<int64_t, int32_t>> victims;  // (last_use, slot), sorted
};

Scratch& scratch(int64_t num_experts) {
  thread_local Scratch s;
  if (static_cast<int64_t>(s.tokens.size()) < num_experts) {
    s.tokens.resize(num_experts, 0);
    s.result.resize(num_experts, -1);
  }
  return s;
}

// Restores the all-zero tokens[] when the call ends, also by an exception.
struct TokensReset {
  Scratch& s;
  ~TokensReset() {
    for (int32_t e : s.distinct) s.tokens[e] = 0;
    s.distinct.clear();
  }
};

// ---- victim pass: the `cap` smallest (last_use, slot) among slots with last_use != now ----

// First index in [s, S) with lu[index] < thresh, or S.
int64_t next_below_scalar(const int64_t* lu, int64_t s, int64_t S, int64_t thresh) {
  for (; s < S; ++s)
    if (lu[s] < thresh) return s;
  return S;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) int64_t next_below_avx2(const int64_t* lu, int64_t s, int64_t S, int64_t thresh) {
  const __m256i th = _mm256_set1_epi64x(thresh);
  for (; s + 16 <= S; s += 16) {
    const __m256i* p = reinterpret_cast<const __m256i*>(lu + s);
    const __m256i m0 = _mm256_cmpgt_epi64(th, _mm256_loadu_si256(p));
    const __m256i m1 = _mm256_cmpgt_epi64(th, _mm256_loadu_si256(p + 1));
    const __m256i m2 = _mm256_cmpgt_epi64(th, _mm256_loadu_si256(p + 2));
    const __m256i m3 = _mm256_cmpgt_epi64(th, _mm256_loadu_si256(p + 3));
    const __m256i m = _mm256_or_si256(_mm256_or_si256(m0, m1), _mm256_or_si256(m2, m3));
    if (!_mm256_testz_si256(m, m)) return next_below_scalar(lu, s, s + 16, thresh);
  }
  return next_below_scalar(lu, s, S, thresh);
}
#endif

bool use_avx2() {
#if defined(__x86_64__)
  return std::strcmp(kernels().name, "scalar") != 0;  // the ISA level selected for all CPU ops
#else
  return false;
#endif
}

// One pass over the slot table keeping the `cap` smallest keys, sorted ascending, in `v`.
// Slots are visited in ascending order, so once `cap` keys are kept a slot whose last_use
// equals the largest kept one's is larger than it: the test needs last_use alone. While the
// list is full and its largest last_use is <= now, "last_use < largest" also excludes this
// call's hits (last_use == now), and the pass only looks for values below a threshold: SIMD.
void select_victims(const int64_t* lu, int64_t S, int64_t now, size_t cap,
                    std::vector<std::pair<int64_t, int32_t>>& v, bool avx2) {
  v.clear();
  auto insert = [&](int64_t t, int64_t s) {
    std::pair<int64_t, int32_t> key{t, static_cast<int32_t>(s)};
    auto pos = std::upper_bound(v.begin(), v.end(), key);
    if (v.size() == cap) v.pop_back();
    v.insert(pos, key);
  };
  int64_t s = 0;
  for (; s < S && v.size() < cap; ++s)  // fill the list with the first candidates
    if (lu[s] != now) insert(lu[s], s);
  while (s < S) {
    const int64_t thresh = v.back().first;
    if (thresh > now) {  // only with tables holding future times: the plain test
      for (; s < S; ++s)
        if (lu[s] != now && lu[s] < v.back().first) insert(lu[s], s);
      break;
    }
#if defined(__x86_64__)
    s = avx2 ? next_below_avx2(lu, s, S, thresh) : next_below_scalar(lu, s, S, thresh);
#else
    s = next_below_scalar(lu, s, S, thresh);
#endif
    if (s < S) {
      insert(lu[s], s);
      ++s;
    }
  }
}

}  // namespace

void expert_cache_control_cpu(const at::Tensor& topk_ids, int64_t layer, int64_t num_experts,
                              const at::Tensor& slot_of_id, const at::Tensor& id_of_slot,
                              const at::Tensor& slot_last_use, const at::Tensor& clock, const at::Tensor& slot_ids,
                              const at::Tensor& cpu_ids, const at::Tensor& fill_src, const at::Tensor& fill_dst,
                              const at::Tensor& counts, const at::Tensor& stats, double fill_ratio, int64_t policy) {
  // ---- argument checks (nothing is changed before all of them pass) ----
  check_i32(topk_ids, "topk_ids");
  TORCH_CHECK(topk_ids.dim() == 2, "topk_ids must be [T, K], got shape ", topk_ids.sizes());
  check_i32(slot_ids, "slot_ids");
  check_i32(cpu_ids, "cpu_ids");
  TORCH_CHECK(slot_ids.sizes() == topk_ids.sizes() && cpu_ids.sizes() == topk_ids.sizes(),
              "slot_ids and cpu_ids must have topk_ids' shape ", topk_ids.sizes(), ", got ", slot_ids.sizes(),
              " and ", cpu_ids.sizes());
  TORCH_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  TORCH_CHECK(layer >= 0, "layer must be >= 0, got ", layer);
  check_i32(slot_of_id, "slot_of_id");
  check_i32(id_of_slot, "id_of_slot");
  check_i64(slot_last_use, "slot_last_use");
  check_i64(clock, "clock");
  check_i32(fill_src, "fill_src");
  check_i32(fill_dst, "fill_dst");
  check_i32(counts, "counts");
  check_i64(stats, "stats");
  const int64_t n_ids = slot_of_id.numel();
  TORCH_CHECK(n_ids <= std::numeric_limits<int32_t>::max(), "slot_of_id has more than 2^31-1 entries");
  TORCH_CHECK((layer + 1) * num_experts <= n_ids, "layer ", layer, " with ", num_experts,
              " experts needs slot_of_id of at least ", (layer + 1) * num_experts, " entries, got ", n_ids);
  const int64_t S = id_of_slot.numel();
  TORCH_CHECK(slot_last_use.numel() == S, "slot_last_use must have ", S, " entries (id_of_slot's), got ",
              slot_last_use.numel());
  TORCH_CHECK(clock.numel() == 1, "clock must have one entry, got ", clock.numel());
  const int64_t F = fill_src.numel();
  TORCH_CHECK(fill_dst.numel() == F, "fill_dst must have fill_src's ", F, " entries, got ", fill_dst.numel());
  TORCH_CHECK(counts.numel() == 4, "counts must have 4 entries, got ", counts.numel());
  TORCH_CHECK(stats.numel() == 4, "stats must have 4 entries, got ", stats.numel());
  TORCH_CHECK(policy == kPolicyQstar || policy == kPolicyFill || policy == kPolicyCpu,
              "policy must be 0 (qstar), 1 (fill) or 2 (cpu), got ", policy);
  TORCH_CHECK(std::isfinite(fill_ratio) && fill_ratio >= 0.0, "fill_ratio must be finite and >= 0, got ",
              fill_ratio);

  const int32_t* ids = topk_ids.data_ptr<int32_t>();
  const int64_t n = topk_ids.numel();
  int32_t* sof = slot_of_id.data_ptr<int32_t>();
  int32_t* ios = id_of_slot.data_ptr<int32_t>();
  int64_t* lu = slot_last_use.data_ptr<int64_t>();
  const int32_t E = static_cast<int32_t>(num_experts);
  const int32_t base = static_cast<int32_t>(layer * num_experts);

  Scratch& sc = scratch(num_experts);
  TokensReset reset{sc};

  // ---- 2. deduplicate, count tokens per expert (validates the ids) ----
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    if (e == -1) continue;
    TORCH_CHECK(e >= 0 && e < E, "topk_ids[", i / topk_ids.size(1), ", ", i % topk_ids.size(1), "] = ", e,
                " is outside [-1, ", E, ")");
    if (sc.tokens[e]++ == 0) sc.distinct.push_back(e);
  }
  // ---- 3. classify (read-only until every slot read is validated) ----
  sc.misses.clear();
  int64_t hits = 0;
  for (int32_t e : sc.distinct) {
    const int32_t s = sof[base + e];
    TORCH_CHECK(s >= -1 && s < S, "slot_of_id[", base + e, "] = ", s, " is outside [-1, ", S, ")");
    sc.result[e] = s;  // -1 until filled
    if (s >= 0)
      ++hits;
    else
      sc.misses.push_back(e);
  }

  // ---- 1. advance the clock; mark hits ----
  int64_t* clk = clock.data_ptr<int64_t>();
  const int64_t now = ++clk[0];
  for (int32_t e : sc.distinct)
    if (sc.result[e] >= 0) lu[sc.result[e]] = now;

  // ---- 4. fill count; 6. victims by one pass over the slot table ----
  const int64_t m = static_cast<int64_t>(sc.misses.size());
  int64_t q = std::min(policy_fill_count(policy, m, fill_ratio), F);
  sc.victims.clear();
  if (q > 0) {
    select_victims(lu, S, now, static_cast<size_t>(q), sc.victims, use_avx2());
    q = std::min<int64_t>(q, static_cast<int64_t>(sc.victims.size()));
  }

  // ---- 5. fill order: most tokens first, then lower id; 7. install ----
  int32_t* fsrc = fill_src.data_ptr<int32_t>();
  int32_t* fdst = fill_dst.data_ptr<int32_t>();
  if (q > 0) {
    auto& ms = sc.misses;
    const auto& tok = sc.tokens;
    std::partial_sort(ms.begin(), ms.begin() + q, ms.end(), [&](int32_t a, int32_t b) {
      return tok[a] != tok[b] ? tok[a] > tok[b] : a < b;
    });
    for (int64_t i = 0; i < q; ++i) {
      const int32_t e = ms[i];
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
      sc.result[e] = v;
    }
  }
  for (int64_t i = q; i < F; ++i) fsrc[i] = fdst[i] = -1;

  // ---- 8. rewrite ----
  int32_t* so = slot_ids.data_ptr<int32_t>();
  int32_t* co = cpu_ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    if (e == -1) {
      so[i] = co[i] = -1;
      continue;
    }
    const int32_t r = sc.result[e];
    so[i] = r;
    co[i] = r >= 0 ? -1 : base + e;
  }

  // ---- 9. counts and stats ----
  int32_t* cnt = counts.data_ptr<int32_t>();
  cnt[0] = static_cast<int32_t>(q);
  cnt[1] = static_cast<int32_t>(m - q);
  cnt[2] = static_cast<int32_t>(hits);
  cnt[3] = static_cast<int32_t>(m);
  int64_t* st = stats.data_ptr<int64_t>();
  st[0] += hits;
  st[1] += m;
  st[2] += q;
  st[3] += m - q;
}

// dst_banks[b][fill_dst[i]] = src_banks[b][fill_src[i]] for i < counts[0], every bank b.
void expert_bank_copy_cpu(const std::vector<at::Tensor>& src_banks, const std::vector<at::Tensor>& dst_banks,
                          const at::Tensor& fill_src, const at::Tensor& fill_dst, const at::Tensor& counts) {
  TORCH_CHECK(src_banks.size() == dst_banks.size(), "src_banks and dst_banks must have the same length, got ",
              src_banks.size(), " and ", dst_banks.size());
  check_i32(fill_src, "fill_src");
  check_i32(fill_dst, "fill_dst");
  check_i32(counts, "counts");
  const int64_t F = fill_src.numel();
  TORCH_CHECK(fill_dst.numel() == F, "fill_dst must have fill_src's ", F, " entries, got ", fill_dst.numel());
  TORCH_CHECK(counts.numel() >= 1, "counts must have at least one entry");
  const int64_t nb = static_cast<int64_t>(src_banks.size());
  std::vector<const char*> src(nb);
  std::vector<char*> dst(nb);
  std::vector<int64_t> row_bytes(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const at::Tensor& s = src_banks[b];
    const at::Tensor& d = dst_banks[b];
    TORCH_CHECK(s.device().is_cpu() && d.device().is_cpu(), "bank ", b, ": CPU tensors expected, got ", s.device(),
                " and ", d.device());
    TORCH_CHECK(s.dim() >= 1 && d.dim() == s.dim() && s.sizes().slice(1) == d.sizes().slice(1), "bank ", b,
                ": src and dst must have the same row shape, got ", s.sizes(), " and ", d.sizes());
    TORCH_CHECK(s.scalar_type() == d.scalar_type(), "bank ", b, ": dtypes differ (", s.scalar_type(), " vs ",
                d.scalar_type(), ")");
    TORCH_CHECK(s.is_contiguous() && d.is_contiguous(), "bank ", b, ": src and dst must be contiguous");
    src[b] = static_cast<const char*>(s.data_ptr());
    dst[b] = static_cast<char*>(d.data_ptr());
    int64_t row_elems = 1;
    for (int64_t k = 1; k < s.dim(); ++k) row_elems *= s.size(k);
    row_bytes[b] = row_elems * static_cast<int64_t>(s.element_size());
  }
  const int64_t q = counts.data_ptr<int32_t>()[0];
  TORCH_CHECK(q >= 0 && q <= F, "counts[0] = ", q, " is outside [0, ", F, "]");
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

}  // namespace sglk

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "expert_cache_control(Tensor topk_ids, int layer, int num_experts, Tensor(a!) slot_of_id, "
      "Tensor(b!) id_of_slot, Tensor(c!) slot_last_use, Tensor(d!) clock, Tensor(e!) slot_ids, Tensor(f!) cpu_ids, "
      "Tensor(g!) fill_src, Tensor(h!) fill_dst, Tensor(i!) counts, Tensor(j!) stats, float fill_ratio, "
      "int policy) -> ()");
  m.def(
      "expert_bank_copy(Tensor[] src_banks, Tensor(a!)[] dst_banks, Tensor fill_src, Tensor fill_dst, "
      "Tensor counts) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("expert_cache_control", &sglk::expert_cache_control_cpu);
  m.impl("expert_bank_copy", &sglk::expert_bank_copy_cpu);
}
