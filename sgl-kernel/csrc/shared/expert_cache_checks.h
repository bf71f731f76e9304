// Argument checks of the expert-cache ops, shared by the CPU implementations
// (csrc/cpu/expert_cache.cpp) and the CUDA binding (csrc/cuda/expert_cache_binding.cpp). They read
// tensor metadata only (no device sync, so a CUDA call stays capturable in a graph) and raise
// before any state changes. The device-specific rules (the CPU op's id range check, the CUDA
// kernel's limits, where a source bank may live) stay with each implementation.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "shared/expert_cache.h"

namespace sglk::expert_cache {

// torch's Python name of an integer dtype ("int32"), else c10's ("Float").
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    default:
      return c10::toString(t);
  }
}

inline void check_on(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& dev) {
  TORCH_CHECK(t.device() == dev, name, " must be on ", dev, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype_name(dtype), ", got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// "0 (qstar), 1 (fill), 2 (cpu)": the miss policies' values and names, for error messages.
inline std::string miss_policy_values() {
  std::string out;
  int value = 0;
#define SGLK_EXPERT_CACHE_VALUE(name)                                  \
  out += (value ? ", " : "") + std::to_string(value) + " (" #name ")"; \
  ++value;
  SGLK_EXPERT_CACHE_MISS_POLICIES(SGLK_EXPERT_CACHE_VALUE)
#undef SGLK_EXPERT_CACHE_VALUE
  return out;
}

// Sizes of one control call, read from its validated tensors.
struct ControlShape {
  int64_t n_ids;      // L * E, entries of slot_of_id
  int64_t num_slots;  // S
  int64_t num_fill;   // F, capacity of the fill lists
};

// Every tensor on `dev` with the schema's dtype and shape, layer and num_experts inside
// slot_of_id, a known policy and a finite fill_ratio >= 0.
inline ControlShape check_control_args(const at::Tensor& topk_ids, int64_t layer, int64_t num_experts,
                                       const at::Tensor& slot_of_id, const at::Tensor& id_of_slot,
                                       const at::Tensor& slot_last_use, const at::Tensor& clock,
                                       const at::Tensor& slot_ids, const at::Tensor& cpu_ids,
                                       const at::Tensor& fill_src, const at::Tensor& fill_dst, const at::Tensor& counts,
                                       const at::Tensor& stats, double fill_ratio, int64_t policy,
                                       const at::Device& dev) {
  check_on(topk_ids, "topk_ids", at::kInt, dev);
  TORCH_CHECK(topk_ids.dim() == 2, "topk_ids must be [T, K], got shape ", topk_ids.sizes());
  check_on(slot_ids, "slot_ids", at::kInt, dev);
  check_on(cpu_ids, "cpu_ids", at::kInt, dev);
  TORCH_CHECK(slot_ids.sizes() == topk_ids.sizes() && cpu_ids.sizes() == topk_ids.sizes(),
              "slot_ids and cpu_ids must have topk_ids' shape ", topk_ids.sizes(), ", got ", slot_ids.sizes(), " and ",
              cpu_ids.sizes());
  TORCH_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  TORCH_CHECK(layer >= 0, "layer must be >= 0, got ", layer);
  check_on(slot_of_id, "slot_of_id", at::kInt, dev);
  check_on(id_of_slot, "id_of_slot", at::kInt, dev);
  check_on(slot_last_use, "slot_last_use", at::kLong, dev);
  check_on(clock, "clock", at::kLong, dev);
  check_on(fill_src, "fill_src", at::kInt, dev);
  check_on(fill_dst, "fill_dst", at::kInt, dev);
  check_on(counts, "counts", at::kInt, dev);
  check_on(stats, "stats", at::kLong, dev);
  const int64_t n_ids = slot_of_id.numel();
  TORCH_CHECK(n_ids <= std::numeric_limits<int32_t>::max(), "slot_of_id has more than 2^31-1 entries");
  TORCH_CHECK((layer + 1) * num_experts <= n_ids, "layer ", layer, " with ", num_experts,
              " experts needs slot_of_id of at least ", (layer + 1) * num_experts, " entries, got ", n_ids);
  const int64_t S = id_of_slot.numel();
  TORCH_CHECK(S <= std::numeric_limits<int32_t>::max(), "more than 2^31-1 slots");
  TORCH_CHECK(slot_last_use.numel() == S, "slot_last_use must have ", S, " entries (id_of_slot's), got ",
              slot_last_use.numel());
  TORCH_CHECK(clock.numel() == 1, "clock must have one entry, got ", clock.numel());
  const int64_t F = fill_src.numel();
  TORCH_CHECK(fill_dst.numel() == F, "fill_dst must have fill_src's ", F, " entries, got ", fill_dst.numel());
  TORCH_CHECK(counts.numel() == stat::count, "counts must have ", stat::count, " entries, got ", counts.numel());
  TORCH_CHECK(stats.numel() == stat::count, "stats must have ", stat::count, " entries, got ", stats.numel());
  TORCH_CHECK(is_miss_policy(policy), "policy must be one of ", miss_policy_values(), ", got ", policy);
  TORCH_CHECK(std::isfinite(fill_ratio) && fill_ratio >= 0.0, "fill_ratio must be finite and >= 0, got ", fill_ratio);
  return {n_ids, S, F};
}

// The optional live slot count: int32 [1] on `dev`. Slots [live, S) are outside the cache (the
// tail of a shrunk pool, FreeToken §3.3 "Runtime cache reconfiguration"); its value is read by
// the op that uses it (CPU: checked there; CUDA: clamped to [0, S] in the kernel, no sync).
inline void check_live_slots(const c10::optional<at::Tensor>& live_slots, const at::Device& dev) {
  if (!live_slots.has_value()) return;
  check_on(*live_slots, "live_slots", at::kInt, dev);
  TORCH_CHECK(live_slots->numel() == 1, "live_slots must have one entry, got ", live_slots->numel());
}

// live_fill_ratio: [1] float64 on `dev`, B_P / B_H as device data (replaces the float argument, so
// a captured graph follows a re-derived ratio). Its value is checked where the caller can read it
// without a sync (the CPU op); the CUDA kernel treats a negative or non-finite value as 0.
inline void check_live_fill_ratio(const c10::optional<at::Tensor>& live_fill_ratio, const at::Device& dev) {
  if (!live_fill_ratio.has_value()) return;
  check_on(*live_fill_ratio, "live_fill_ratio", at::kDouble, dev);
  TORCH_CHECK(live_fill_ratio->numel() == 1, "live_fill_ratio must have one entry, got ", live_fill_ratio->numel());
}

// The fill work list on `dev` (fill_src, fill_dst [F] int32; counts int32 holding counts[stat::fills])
// and, bank by bank, source and destination of the same row shape and dtype, contiguous.
// Returns each bank's row size in bytes. Where the banks live is the caller's rule.
inline std::vector<int64_t> check_bank_copy_args(const std::vector<at::Tensor>& src_banks,
                                                 const std::vector<at::Tensor>& dst_banks, const at::Tensor& fill_src,
                                                 const at::Tensor& fill_dst, const at::Tensor& counts,
                                                 const at::Device& dev) {
  TORCH_CHECK(src_banks.size() == dst_banks.size(), "src_banks and dst_banks must have the same length, got ",
              src_banks.size(), " and ", dst_banks.size());
  check_on(fill_src, "fill_src", at::kInt, dev);
  check_on(fill_dst, "fill_dst", at::kInt, dev);
  check_on(counts, "counts", at::kInt, dev);
  const int64_t F = fill_src.numel();
  TORCH_CHECK(fill_dst.numel() == F, "fill_dst must have fill_src's ", F, " entries, got ", fill_dst.numel());
  TORCH_CHECK(F <= std::numeric_limits<int32_t>::max(), "fill lists too long");
  TORCH_CHECK(counts.numel() > stat::fills, "counts must have at least ", stat::fills + 1, " entries");
  std::vector<int64_t> row_bytes(src_banks.size());
  for (size_t b = 0; b < src_banks.size(); ++b) {
    const at::Tensor& s = src_banks[b];
    const at::Tensor& d = dst_banks[b];
    TORCH_CHECK(s.dim() >= 1 && d.dim() == s.dim() && s.sizes().slice(1) == d.sizes().slice(1), "bank ", b,
                ": src and dst must have the same row shape, got ", s.sizes(), " and ", d.sizes());
    TORCH_CHECK(s.scalar_type() == d.scalar_type(), "bank ", b, ": dtypes differ (", s.scalar_type(), " vs ",
                d.scalar_type(), ")");
    TORCH_CHECK(s.is_contiguous() && d.is_contiguous(), "bank ", b, ": src and dst must be contiguous");
    int64_t row_elems = 1;
    for (int64_t k = 1; k < s.dim(); ++k) row_elems *= s.size(k);
    row_bytes[b] = row_elems * static_cast<int64_t>(s.element_size());
  }
  return row_bytes;
}

}  // namespace sglk::expert_cache
