// Fixed-address calls of the CPU executor, for a CUDA stream (FreeToken §4, "Graph-resident
// CPU execution").
//
// A plan holds four staging tensors (page-locked CPU memory in practice: hidden [Tmax, H] bf16,
// topk weights [Tmax, K] f32, expert rows [Tmax, K] i32, output [Tmax, H] f32) and the host banks.
// The CUDA op moe_experts_cpu_enqueue (csrc/cuda/cpu_branch_binding.cpp) copies a layer call's
// inputs into the staging tensors, launches a host function that runs the plan on the first
// `tokens` rows, and copies the output back, all on one stream: no host synchronization, and the
// addresses never change, so the three steps can be captured in a CUDA graph and replayed.
//
// Plans live until the process exits (a captured graph may replay one at any time); a process
// makes one per expert-slot cache. A failed run raises the executor's error; inside a host
// function, which cannot raise, the CUDA side aborts the process with that message.
#include <ATen/ATen.h>

#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "ops.h"

namespace sglk {

namespace {

struct MoePlan {
  at::Tensor hidden, weights, rows, out;
  std::vector<at::Tensor> w13, w2;
  int64_t format = 0;
  std::vector<at::Tensor> w13_scale, w2_scale, w13_scale_2, w2_scale_2;
  std::optional<std::vector<at::Tensor>> w13_bias, w2_bias;  // the epilogue (cpu_executor.cpp)
  int64_t activation = 0;
  double alpha = 1.702, limit = 7.0;
};

// Leaked on purpose, like ExpertPool::get(): a plan holds tensors (pinned staging, banks)
// whose deleters need the CUDA runtime and the interpreter, both gone when static
// destructors run at exit.
std::mutex& g_plans_mu = *new std::mutex;
std::vector<std::unique_ptr<MoePlan>>& g_plans = *new std::vector<std::unique_ptr<MoePlan>>;

MoePlan& plan_at(int64_t plan) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  TORCH_CHECK(plan >= 0 && plan < static_cast<int64_t>(g_plans.size()), "moe_experts_cpu plan ", plan,
              " does not exist (make one with moe_experts_cpu_plan)");
  return *g_plans[plan];
}

}  // namespace

int64_t moe_experts_cpu_plan(const at::Tensor& staging_hidden, const at::Tensor& staging_weights,
                             const at::Tensor& staging_rows, at::TensorList w13, at::TensorList w2,
                             const at::Tensor& staging_out, int64_t format, const OptTensorList& w13_scale,
                             const OptTensorList& w2_scale, const OptTensorList& w13_scale_2,
                             const OptTensorList& w2_scale_2, const OptTensorList& w13_bias,
                             const OptTensorList& w2_bias, int64_t activation, double alpha, double limit) {
  TORCH_CHECK(
      staging_hidden.dim() == 2 && staging_weights.dim() == 2 && staging_rows.dim() == 2 && staging_out.dim() == 2,
      "moe_experts_cpu_plan: staging tensors must be 2-D ([Tmax, H], [Tmax, K], [Tmax, K], [Tmax, H])");
  const int64_t T = staging_hidden.size(0);
  TORCH_CHECK(staging_weights.size(0) == T && staging_rows.size(0) == T && staging_out.size(0) == T,
              "moe_experts_cpu_plan: staging tensors must have the same number of rows (Tmax = ", T, "), got ",
              staging_weights.size(0), ", ", staging_rows.size(0), ", ", staging_out.size(0));
  for (const at::Tensor* t : {&staging_hidden, &staging_weights, &staging_rows, &staging_out})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                "moe_experts_cpu_plan: staging tensors must be contiguous CPU tensors (pinned for CUDA copies)");
  TORCH_CHECK(w13.size() == 1, "moe_experts_cpu_plan: one bank set (the host pool), got ", w13.size());
  // Validate shapes and dtypes with the executor's own checks on zero tokens.
  {
    std::vector<at::Tensor> rows{staging_rows.narrow(0, 0, 0)};
    moe_experts_cpu(staging_hidden.narrow(0, 0, 0), staging_weights.narrow(0, 0, 0), rows, w13, w2,
                    staging_out.narrow(0, 0, 0), false, format, w13_scale, w2_scale, w13_scale_2, w2_scale_2, w13_bias,
                    w2_bias, activation, alpha, limit);
  }
  auto p = std::make_unique<MoePlan>();
  p->hidden = staging_hidden;
  p->weights = staging_weights;
  p->rows = staging_rows;
  p->out = staging_out;
  p->w13 = w13.vec();
  p->w2 = w2.vec();
  p->format = format;
  auto vec = [](const OptTensorList& l) { return l ? l->vec() : std::vector<at::Tensor>{}; };
  p->w13_scale = vec(w13_scale);
  p->w2_scale = vec(w2_scale);
  p->w13_scale_2 = vec(w13_scale_2);
  p->w2_scale_2 = vec(w2_scale_2);
  if (w13_bias) p->w13_bias = w13_bias->vec();
  if (w2_bias) p->w2_bias = w2_bias->vec();
  p->activation = activation;
  p->alpha = alpha;
  p->limit = limit;
  std::lock_guard<std::mutex> lock(g_plans_mu);
  g_plans.push_back(std::move(p));
  return static_cast<int64_t>(g_plans.size()) - 1;
}

void moe_experts_cpu_run_plan(int64_t plan, int64_t tokens) {
  MoePlan& p = plan_at(plan);
  TORCH_CHECK(tokens >= 0 && tokens <= p.hidden.size(0), "moe_experts_cpu_run_plan: tokens must be in [0, ",
              p.hidden.size(0), "] (the plan's staging rows), got ", tokens);
  std::vector<at::Tensor> rows{p.rows.narrow(0, 0, tokens)};
  moe_experts_cpu(p.hidden.narrow(0, 0, tokens), p.weights.narrow(0, 0, tokens), rows, p.w13, p.w2,
                  p.out.narrow(0, 0, tokens), false, p.format, p.w13_scale, p.w2_scale, p.w13_scale_2, p.w2_scale_2,
                  p.w13_bias ? OptTensorList(*p.w13_bias) : std::nullopt,
                  p.w2_bias ? OptTensorList(*p.w2_bias) : std::nullopt, p.activation, p.alpha, p.limit);
}

}  // namespace sglk
