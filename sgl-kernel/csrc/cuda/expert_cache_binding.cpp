// CUDA implementations of torch.ops.sgl_kernel.expert_cache_control / expert_bank_copy (the
// schemas and the CPU implementations are in csrc/cpu/expert_cache.cpp). Checks the tensors on
// the host from their metadata only (no device sync, so the calls can be captured in a CUDA
// graph) and calls the plain launchers of expert_cache.cu on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "expert_cache.h"

namespace sglk_cuda {
namespace {

void check_on(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& dev) {
  TORCH_CHECK(t.device() == dev, name, " must be on ", dev, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void expert_cache_control_cuda(const at::Tensor& topk_ids, int64_t layer, int64_t num_experts,
                               const at::Tensor& slot_of_id, const at::Tensor& id_of_slot,
                               const at::Tensor& slot_last_use, const at::Tensor& clock, const at::Tensor& slot_ids,
                               const at::Tensor& cpu_ids, const at::Tensor& fill_src, const at::Tensor& fill_dst,
                               const at::Tensor& counts, const at::Tensor& stats, double fill_ratio, int64_t policy) {
  TORCH_CHECK(topk_ids.is_cuda(), "topk_ids must be a CUDA tensor, got ", topk_ids.device());
  const at::Device dev = topk_ids.device();
  check_on(topk_ids, "topk_ids", at::kInt, dev);
  TORCH_CHECK(topk_ids.dim() == 2, "topk_ids must be [T, K], got shape ", topk_ids.sizes());
  check_on(slot_ids, "slot_ids", at::kInt, dev);
  check_on(cpu_ids, "cpu_ids", at::kInt, dev);
  TORCH_CHECK(slot_ids.sizes() == topk_ids.sizes() && cpu_ids.sizes() == topk_ids.sizes(),
              "slot_ids and cpu_ids must have topk_ids' shape ", topk_ids.sizes(), ", got ", slot_ids.sizes(),
              " and ", cpu_ids.sizes());
  check_on(slot_of_id, "slot_of_id", at::kInt, dev);
  check_on(id_of_slot, "id_of_slot", at::kInt, dev);
  check_on(slot_last_use, "slot_last_use", at::kLong, dev);
  check_on(clock, "clock", at::kLong, dev);
  check_on(fill_src, "fill_src", at::kInt, dev);
  check_on(fill_dst, "fill_dst", at::kInt, dev);
  check_on(counts, "counts", at::kInt, dev);
  check_on(stats, "stats", at::kLong, dev);
  TORCH_CHECK(num_experts >= 1 && num_experts <= kControlMaxExperts, "num_experts must be in [1, ",
              kControlMaxExperts, "] on CUDA, got ", num_experts);
  TORCH_CHECK(layer >= 0, "layer must be >= 0, got ", layer);
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
  TORCH_CHECK(F <= kControlMaxFill, "fill lists of at most ", kControlMaxFill, " entries on CUDA, got ", F);
  TORCH_CHECK(counts.numel() == 4, "counts must have 4 entries, got ", counts.numel());
  TORCH_CHECK(stats.numel() == 4, "stats must have 4 entries, got ", stats.numel());
  TORCH_CHECK(policy >= 0 && policy <= 2, "policy must be 0 (qstar), 1 (fill) or 2 (cpu), got ", policy);
  TORCH_CHECK(std::isfinite(fill_ratio) && fill_ratio >= 0.0, "fill_ratio must be finite and >= 0, got ",
              fill_ratio);

  ControlArgs a{};
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.n_entries = topk_ids.numel();
  a.layer = static_cast<int32_t>(layer);
  a.num_experts = static_cast<int32_t>(num_experts);
  a.slot_of_id = slot_of_id.data_ptr<int32_t>();
  a.n_ids = n_ids;
  a.id_of_slot = id_of_slot.data_ptr<int32_t>();
  a.slot_last_use = slot_last_use.data_ptr<int64_t>();
  a.num_slots = static_cast<int32_t>(S);
  a.clock = clock.data_ptr<int64_t>();
  a.slot_ids = slot_ids.data_ptr<int32_t>();
  a.cpu_ids = cpu_ids.data_ptr<int32_t>();
  a.fill_src = fill_src.data_ptr<int32_t>();
  a.fill_dst = fill_dst.data_ptr<int32_t>();
  a.num_fill = static_cast<int32_t>(F);
  a.counts = counts.data_ptr<int32_t>();
  a.stats = stats.data_ptr<int64_t>();
  a.fill_ratio = fill_ratio;
  a.policy = static_cast<int32_t>(policy);
  const c10::cuda::CUDAGuard guard(dev);
  C10_CUDA_CHECK(launch_expert_cache_control(a, c10::cuda::getCurrentCUDAStream(dev.index()).stream()));
}

// Device-readable address of a source bank: a CUDA tensor's own pointer, or the mapped device
// pointer of a pinned host tensor (UVA; cudaHostGetDevicePointer is not a stream operation).
const char* device_readable(const at::Tensor& t, int64_t b, const at::Device& dev) {
  if (t.is_cuda()) {
    TORCH_CHECK(t.device() == dev, "src bank ", b, " is on ", t.device(), ", the destination on ", dev);
    return static_cast<const char*>(t.data_ptr());
  }
  TORCH_CHECK(t.device().is_cpu() && t.is_pinned(), "src bank ", b,
              " must be a CUDA tensor or a pinned CPU tensor (pin_memory())");
  void* p = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&p, t.data_ptr(), 0));
  return static_cast<const char*>(p);
}

void expert_bank_copy_cuda(const std::vector<at::Tensor>& src_banks, const std::vector<at::Tensor>& dst_banks,
                           const at::Tensor& fill_src, const at::Tensor& fill_dst, const at::Tensor& counts) {
  TORCH_CHECK(src_banks.size() == dst_banks.size(), "src_banks and dst_banks must have the same length, got ",
              src_banks.size(), " and ", dst_banks.size());
  TORCH_CHECK(counts.is_cuda(), "counts must be a CUDA tensor, got ", counts.device());
  const at::Device dev = counts.device();
  check_on(fill_src, "fill_src", at::kInt, dev);
  check_on(fill_dst, "fill_dst", at::kInt, dev);
  check_on(counts, "counts", at::kInt, dev);
  const int64_t F = fill_src.numel();
  TORCH_CHECK(fill_dst.numel() == F, "fill_dst must have fill_src's ", F, " entries, got ", fill_dst.numel());
  TORCH_CHECK(F <= std::numeric_limits<int32_t>::max(), "fill lists too long");
  TORCH_CHECK(counts.numel() >= 1, "counts must have at least one entry");
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const int64_t nb = static_cast<int64_t>(src_banks.size());
  for (int64_t b0 = 0; b0 < nb; b0 += kBankCopyMaxBanks) {
    BankCopyArgs a{};
    a.num_banks = static_cast<int32_t>(std::min<int64_t>(kBankCopyMaxBanks, nb - b0));
    for (int j = 0; j < a.num_banks; ++j) {
      const int64_t b = b0 + j;
      const at::Tensor& s = src_banks[b];
      const at::Tensor& d = dst_banks[b];
      TORCH_CHECK(d.device() == dev, "dst bank ", b, " must be on ", dev, ", got ", d.device());
      TORCH_CHECK(s.dim() >= 1 && d.dim() == s.dim() && s.sizes().slice(1) == d.sizes().slice(1), "bank ", b,
                  ": src and dst must have the same row shape, got ", s.sizes(), " and ", d.sizes());
      TORCH_CHECK(s.scalar_type() == d.scalar_type(), "bank ", b, ": dtypes differ (", s.scalar_type(), " vs ",
                  d.scalar_type(), ")");
      TORCH_CHECK(s.is_contiguous() && d.is_contiguous(), "bank ", b, ": src and dst must be contiguous");
      int64_t row_elems = 1;
      for (int64_t k = 1; k < s.dim(); ++k) row_elems *= s.size(k);
      a.src[j] = device_readable(s, b, dev);
      a.dst[j] = static_cast<char*>(d.data_ptr());
      a.row_bytes[j] = row_elems * static_cast<int64_t>(s.element_size());
      a.src_rows[j] = s.size(0);
      a.dst_rows[j] = d.size(0);
    }
    a.fill_src = fill_src.data_ptr<int32_t>();
    a.fill_dst = fill_dst.data_ptr<int32_t>();
    a.counts = counts.data_ptr<int32_t>();
    a.num_fill = static_cast<int32_t>(F);
    C10_CUDA_CHECK(launch_expert_bank_copy(a, stream));
  }
}

}  // namespace
}  // namespace sglk_cuda

TORCH_LIBRARY_IMPL(sgl_kernel, CUDA, m) {
  m.impl("expert_cache_control", &sglk_cuda::expert_cache_control_cuda);
  m.impl("expert_bank_copy", &sglk_cuda::expert_bank_copy_cuda);
}
