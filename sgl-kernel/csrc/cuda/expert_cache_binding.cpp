// CUDA implementations of torch.ops.sgl_kernel.expert_cache_control / expert_bank_copy (the
// schemas and the CPU implementations are in csrc/cpu/expert_cache.cpp). Checks the tensors on
// the host from their metadata only, with the CPU op's checks (csrc/shared/expert_cache_checks.h)
// plus the kernel's limits (no device sync, so the calls can be captured in a CUDA graph), and
// calls the plain launchers of expert_cache.cu on the current stream.
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
#include "shared/expert_cache_checks.h"

namespace sglk_cuda {
namespace {

namespace ec = sglk::expert_cache;

void expert_cache_control_cuda(const at::Tensor& topk_ids, int64_t layer, int64_t num_experts,
                               const at::Tensor& slot_of_id, const at::Tensor& id_of_slot,
                               const at::Tensor& slot_last_use, const at::Tensor& clock, const at::Tensor& slot_ids,
                               const at::Tensor& cpu_ids, const at::Tensor& fill_src, const at::Tensor& fill_dst,
                               const at::Tensor& counts, const at::Tensor& stats, double fill_ratio, int64_t policy,
                               const c10::optional<at::Tensor>& live_slots,
                               const c10::optional<at::Tensor>& live_fill_ratio) {
  TORCH_CHECK(topk_ids.is_cuda(), "topk_ids must be a CUDA tensor, got ", topk_ids.device());
  const at::Device dev = topk_ids.device();
  const ec::ControlShape shape =
      ec::check_control_args(topk_ids, layer, num_experts, slot_of_id, id_of_slot, slot_last_use, clock, slot_ids,
                             cpu_ids, fill_src, fill_dst, counts, stats, fill_ratio, policy, dev);
  ec::check_live_slots(live_slots, dev);
  ec::check_live_fill_ratio(live_fill_ratio, dev);
  TORCH_CHECK(num_experts <= kControlMaxExperts, "num_experts must be in [1, ", kControlMaxExperts, "] on CUDA, got ",
              num_experts);
  TORCH_CHECK(shape.num_fill <= kControlMaxFill, "fill lists of at most ", kControlMaxFill, " entries on CUDA, got ",
              shape.num_fill);
  const int64_t n_ids = shape.n_ids, S = shape.num_slots, F = shape.num_fill;

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
  a.live_slots = live_slots.has_value() ? live_slots->data_ptr<int32_t>() : nullptr;
  a.clock = clock.data_ptr<int64_t>();
  a.slot_ids = slot_ids.data_ptr<int32_t>();
  a.cpu_ids = cpu_ids.data_ptr<int32_t>();
  a.fill_src = fill_src.data_ptr<int32_t>();
  a.fill_dst = fill_dst.data_ptr<int32_t>();
  a.num_fill = static_cast<int32_t>(F);
  a.counts = counts.data_ptr<int32_t>();
  a.stats = stats.data_ptr<int64_t>();
  a.fill_ratio = fill_ratio;
  a.live_fill_ratio = live_fill_ratio.has_value() ? live_fill_ratio->data_ptr<double>() : nullptr;
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
  TORCH_CHECK(counts.is_cuda(), "counts must be a CUDA tensor, got ", counts.device());
  const at::Device dev = counts.device();
  const std::vector<int64_t> row_bytes =
      ec::check_bank_copy_args(src_banks, dst_banks, fill_src, fill_dst, counts, dev);
  const int64_t F = fill_src.numel();
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
      a.src[j] = device_readable(s, b, dev);
      a.dst[j] = static_cast<char*>(d.data_ptr());
      a.row_bytes[j] = row_bytes[b];
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
