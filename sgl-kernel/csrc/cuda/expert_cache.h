// Plain launchers of the expert-cache CUDA kernels (no torch headers): expert_cache.cu defines
// them, expert_cache_binding.cpp checks torch tensors and calls them.
//
// Semantics: python/sglang/srt/layers/moe/expert_cache/reference.py (steps 1-9), identical to
// the CPU op in csrc/cpu/expert_cache.cpp except that routed ids outside [-1, E) count as
// padding here (a kernel cannot raise without a host sync).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "shared/expert_cache.h"

namespace sglk_cuda {

// Limits of the single-block control kernel (csrc/shared/expert_cache.h).
constexpr int kControlMaxExperts = sglk::expert_cache::kCudaMaxExperts;
constexpr int kControlMaxFill = sglk::expert_cache::kCudaMaxFill;
constexpr int kBankCopyMaxBanks = 16;  // banks per launch (more banks: one launch per 16)

struct ControlArgs {
  const int32_t* topk_ids;  // [n_entries]
  int64_t n_entries;        // T * K
  int32_t layer;
  int32_t num_experts;  // E
  int32_t* slot_of_id;  // [n_ids]
  int64_t n_ids;
  int32_t* id_of_slot;        // [num_slots]
  int64_t* slot_last_use;     // [num_slots]
  int32_t num_slots;          // S, the tables' capacity
  const int32_t* live_slots;  // [1] slots in the cache (<= S; the rest is a released tail), or null = S
  int64_t* clock;             // [1]
  int32_t* slot_ids;          // [n_entries]
  int32_t* cpu_ids;           // [n_entries]
  int32_t* fill_src;          // [num_fill]
  int32_t* fill_dst;          // [num_fill]
  int32_t num_fill;           // F <= kControlMaxFill
  int32_t* counts;            // [stat::count] this call's counters (csrc/shared/expert_cache.h)
  int64_t* stats;             // [stat::count] their running sums
  double fill_ratio;
  const double* live_fill_ratio;  // [1] B_P / B_H as device data (replaces fill_ratio), or null
  int32_t policy;                 // a sglk::expert_cache::MissPolicy
};

// One block; enqueued on `stream`, no host synchronization. Returns the launch error.
cudaError_t launch_expert_cache_control(const ControlArgs& args, cudaStream_t stream);

struct BankCopyArgs {
  int32_t num_banks;                   // <= kBankCopyMaxBanks
  const char* src[kBankCopyMaxBanks];  // device-accessible (UVA of pinned host memory, or device)
  char* dst[kBankCopyMaxBanks];
  int64_t row_bytes[kBankCopyMaxBanks];
  int64_t src_rows[kBankCopyMaxBanks];
  int64_t dst_rows[kBankCopyMaxBanks];
  const int32_t* fill_src;  // [num_fill]
  const int32_t* fill_dst;  // [num_fill]
  const int32_t* counts;    // counts[stat::fills] = valid fills
  int32_t num_fill;
};

// Grid (num_fill, num_banks, chunks), masked on the device by counts[stat::fills]. No host sync.
cudaError_t launch_expert_bank_copy(const BankCopyArgs& args, cudaStream_t stream);

}  // namespace sglk_cuda
