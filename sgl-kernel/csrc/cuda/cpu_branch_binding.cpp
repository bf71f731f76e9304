// CUDA implementation of torch.ops.sgl_kernel.moe_experts_cpu_enqueue: the expert-slot cache's
// CPU branch as three steps on the current stream (FreeToken §4, "Graph-resident CPU execution"):
//
//   1. copy hidden [T, H] bf16, topk_weights [T, K] f32 and cpu_rows [T, K] i32 from the device
//      into the plan's page-locked staging rows 0..T-1;
//   2. a host function (cudaLaunchHostFunc) runs the CPU executor on those rows
//      (sgl_kernel::moe_experts_cpu_run_plan, csrc/cpu/cpu_executor_plan.cpp), writing the
//      staging output;
//   3. copy the staging output [T, H] f32 into `out` on the device.
//
// Nothing waits on the host, and every address is fixed by the plan, so a decode step that calls
// this inside torch.cuda.graph() captures the CPU branch as copy + host node + copy and replays it.
// The caller runs it on a side stream (fork/join with events) so the device computes the slot
// experts meanwhile. A host function must not call CUDA: the executor is CPU-only. An executor
// error inside the host function aborts the process with its message (see run_host_call).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace sglk_cuda {
namespace {

using RunPlanFn = void(int64_t, int64_t);

// One record per (plan, tokens) ever enqueued: the host function's argument must outlive every
// replay of a graph that captured it, so records are never freed (their number is bounded by
// the distinct token counts the caller uses, at most the plan's rows).
struct HostCall {
  int64_t plan;
  int64_t tokens;
};

// Leaked on purpose (never destroyed at exit), like the plans they name: a graph replay may
// still read a record while static destructors run.
std::mutex& g_calls_mu = *new std::mutex;
auto& g_calls = *new std::map<std::pair<int64_t, int64_t>, std::unique_ptr<HostCall>>;

const HostCall* host_call(int64_t plan, int64_t tokens) {
  std::lock_guard<std::mutex> lock(g_calls_mu);
  auto& slot = g_calls[{plan, tokens}];
  if (!slot) slot.reset(new HostCall{plan, tokens});
  return slot.get();
}

const c10::TypedOperatorHandle<RunPlanFn>& run_plan_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("sgl_kernel::moe_experts_cpu_run_plan", "").typed<RunPlanFn>();
  return op;
}

// A host function cannot raise, and a stream (or a replayed graph) that went on would serve
// wrong tokens: an executor error (an internal bug, e.g. a row outside the host pool) aborts the
// process with its message.
void CUDART_CB run_host_call(void* arg) {
  const HostCall* c = static_cast<const HostCall*>(arg);
  try {
    run_plan_op().call(c->plan, c->tokens);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sgl_kernel: the expert cache's CPU branch failed in a host function: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "sgl_kernel: the expert cache's CPU branch failed in a host function\n");
    std::abort();
  }
}

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, bool on_cuda) {
  TORCH_CHECK(t.is_cuda() == on_cuda, "moe_experts_cpu_enqueue: ", name, " must be on ",
              on_cuda ? "the CUDA device" : "the CPU (page-locked)", ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "moe_experts_cpu_enqueue: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.dim() == 2, "moe_experts_cpu_enqueue: ", name,
              " must be a contiguous 2-D tensor, got shape ", t.sizes());
}

void copy_rows(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  if (bytes > 0) C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream));
}

void moe_experts_cpu_enqueue_cuda(const at::Tensor& hidden, const at::Tensor& topk_weights, const at::Tensor& cpu_rows,
                                  int64_t plan, const at::Tensor& staging_hidden, const at::Tensor& staging_weights,
                                  const at::Tensor& staging_rows, const at::Tensor& staging_out,
                                  const at::Tensor& out) {
  check(hidden, "hidden", at::kBFloat16, true);
  check(topk_weights, "topk_weights", at::kFloat, true);
  check(cpu_rows, "cpu_rows", at::kInt, true);
  check(out, "out", at::kFloat, true);
  check(staging_hidden, "staging_hidden", at::kBFloat16, false);
  check(staging_weights, "staging_weights", at::kFloat, false);
  check(staging_rows, "staging_rows", at::kInt, false);
  check(staging_out, "staging_out", at::kFloat, false);
  for (const at::Tensor* t : {&staging_hidden, &staging_weights, &staging_rows, &staging_out})
    TORCH_CHECK(t->is_pinned(), "moe_experts_cpu_enqueue: staging tensors must be page-locked (pin_memory=True): ",
                "a copy from pageable memory is staged when enqueued and would read stale rows");
  const int64_t T = hidden.size(0), H = hidden.size(1), K = topk_weights.size(1);
  TORCH_CHECK(topk_weights.size(0) == T && cpu_rows.size(0) == T && cpu_rows.size(1) == K && out.size(0) == T &&
                  out.size(1) == H,
              "moe_experts_cpu_enqueue: hidden [T, H], topk_weights and cpu_rows [T, K], out [T, H] disagree: ",
              hidden.sizes(), ", ", topk_weights.sizes(), ", ", cpu_rows.sizes(), ", ", out.sizes());
  TORCH_CHECK(T <= staging_hidden.size(0), "moe_experts_cpu_enqueue: ", T, " tokens exceed the plan's ",
              staging_hidden.size(0), " staging rows (use the synchronous path for larger batches)");
  TORCH_CHECK(staging_hidden.size(1) == H && staging_out.size(1) == H && staging_weights.size(1) == K &&
                  staging_rows.size(1) == K,
              "moe_experts_cpu_enqueue: staging tensors must be [Tmax, ", H, "], [Tmax, ", K, "], [Tmax, ", K,
              "], [Tmax, ", H, "]");
  TORCH_CHECK(hidden.device() == topk_weights.device() && hidden.device() == cpu_rows.device() &&
                  hidden.device() == out.device(),
              "moe_experts_cpu_enqueue: device tensors must be on one device");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(hidden.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(hidden.device().index()).stream();
  (void)run_plan_op();  // resolve the CPU op now, never inside the host function for the first time
  copy_rows(staging_hidden.data_ptr(), hidden.data_ptr(), T * H * 2, cudaMemcpyDeviceToHost, stream);
  copy_rows(staging_weights.data_ptr(), topk_weights.data_ptr(), T * K * 4, cudaMemcpyDeviceToHost, stream);
  copy_rows(staging_rows.data_ptr(), cpu_rows.data_ptr(), T * K * 4, cudaMemcpyDeviceToHost, stream);
  C10_CUDA_CHECK(cudaLaunchHostFunc(stream, run_host_call, const_cast<HostCall*>(host_call(plan, T))));
  copy_rows(out.data_ptr(), staging_out.data_ptr(), T * H * 4, cudaMemcpyHostToDevice, stream);
}

}  // namespace
}  // namespace sglk_cuda

TORCH_LIBRARY_IMPL(sgl_kernel, CUDA, m) { m.impl("moe_experts_cpu_enqueue", &sglk_cuda::moe_experts_cpu_enqueue_cuda); }
