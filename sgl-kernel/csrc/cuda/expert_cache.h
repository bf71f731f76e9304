// Plain launchers of the expert-cache CUDA kernels (no torch headers): expert_cache.cu defines
// them, expert_cache_binding.cpp checks torch tensors and calls them.
//
// Semantics: python/sglang/srt/layers/moe/expert_cache/reference.py (steps 1-9), identical to
// the CPU op in csrc/cpu/expert_cache.cpp except that routed ids outside [-1, E) count as
// padding here (a kernel cannot raise without a host sync).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sglk_cuda {

// Limits of the single-block control kernel.
constexpr int kControlMaxExperts = 4096;  // E: per-expert token counts live in shared memory
constexpr int kControlMaxFill = 32;       // F: the sorted victim / fill lists are one warp wide
constexpr int kBankCopyMaxBanks = 16;     // banks per launch (more banks: one launch per 16)

struct ControlArgs {
  const int32_t* topk_ids;  // [n_entries]
  int64_t n_entries;        // T * K
  int32_t layer;
  int32_t num_experts;  // E
  int32_t* slot_of_id;  // [n_ids]
  int64_t n_ids;
  int32_t* id_of_slot;     // [num_slots]
  int64_t* slot_last_use;  // [num_slots]
  int32_t num_slots;
  int64_t* clock;     // [1]
  int32_t* slot_ids;  // [n_entries]
  int32_t* cpu_ids;   // [n_entries]
  int32_t* fill_src;  // [num_fill]
  int32_t* fill_dst;  // [num_fill]
  int32_t num_fill;   // F <= kControlMaxFill
  int32_t* counts;    // [4]
  int64_t* stats;     // [4]
  double fill_ratio;
  int32_t policy;  // 0 qstar, 1 fill, 2 cpu
};

// One block; enqueued on `stream`, no host synchronization. Returns the launch error.
cudaError_t launch_expert_cache_control(const ControlArgs& args, cudaStream_t stream);

struct BankCopyArgs {
  int32_t num_banks;  // <= kBankCopyMaxBanks
  const char* src[kBankCopyMaxBanks];  // device-accessible (UVA of pinned host memory, or device)
  char* dst[kBankCopyMaxBanks];
  int64_t row_bytes[kBankCopyMaxBanks];
  int64_t src_rows[kBankCopyMaxBanks];
  int64_t dst_rows[kBankCopyMaxBanks];
  const int32_t* fill_src;  // [num_fill]
  const int32_t* fill_dst;  // [num_fill]
  const int32_t* counts;    // counts[0] = valid fills
  int32_t num_fill;
};

// Grid (num_fill, num_banks, chunks), masked on the device by counts[0]. No host sync.
cudaError_t launch_expert_bank_copy(const BankCopyArgs& args, cudaStream_t stream);

}  // namespace sglk_cuda
