// C++ entry points of the fork's CPU ops that other ops call directly (no dispatcher):
// decode_layers.cpp runs a whole decode pass from them, cpu_executor_plan.cpp and
// torch_extension_cpu.cpp bind or wrap moe_experts_cpu. Each is defined (and documented) in
// the file named beside it and registered there or in torch_extension_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include "common.h"

namespace sglk {

// norm_rope.cpp
at::Tensor rmsnorm_cpu(const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rmsnorm_cpu(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight, double eps);
void fused_qk_norm_rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                            const at::Tensor& k_weight, double eps, bool is_neox, const at::Tensor& positions,
                            const at::Tensor& cos_sin_cache, int64_t rotary_dim);
// dense_linear.cpp
at::Tensor dense_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// extend_attention.cpp
void extend_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                          int64_t q_pos0, double scale, bool causal, const c10::optional<at::Tensor>& kv_index);
// cpu_executor.cpp
void moe_experts_cpu(const at::Tensor& hidden, const at::Tensor& topk_weights, at::TensorList expert_rows,
                     at::TensorList w13, at::TensorList w2, const at::Tensor& out, bool accumulate, int64_t format,
                     const OptTensorList& w13_scale, const OptTensorList& w2_scale, const OptTensorList& w13_scale_2,
                     const OptTensorList& w2_scale_2, const OptTensorList& w13_bias, const OptTensorList& w2_bias,
                     int64_t activation, double alpha, double limit);

}  // namespace sglk
