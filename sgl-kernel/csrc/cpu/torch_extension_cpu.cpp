// Operator registration for the sgl_kernel CPU extension.
//
// Schemas keep upstream sgl-kernel's CPU names, argument names and order where
// upstream calls them (so keyword calls from sglang resolve); extensions are
// trailing arguments with defaults. The Python docs of every op are in
// python/sgl_kernel_fork/ops.py.
#include <Python.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "common.h"
#include "ops.h"

namespace sglk {
std::tuple<at::Tensor, at::Tensor> fused_gdn_gating_cpu(const at::Tensor& A_log, const at::Tensor& a,
                                                        const at::Tensor& b, const at::Tensor& dt_bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_gated_delta_rule_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& g,
    const at::Tensor& beta, const c10::optional<at::Tensor>& initial_state, bool output_final_state,
    const c10::optional<at::Tensor>& cu_seqlens, bool head_first, bool use_qk_l2norm_in_kernel,
    const c10::optional<at::Tensor>& initial_state_indices, double eps, bool output_chunk_states,
    c10::optional<double> scale, bool inplace_update, const c10::optional<at::Tensor>& state_emit_indices);
at::Tensor fused_sigmoid_gating_delta_rule_update_cpu(
    const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& initial_state_source,
    const at::Tensor& initial_state_indices, const c10::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm_in_kernel,
    double softplus_beta, double softplus_threshold);
at::Tensor causal_conv1d_fwd_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                 const c10::optional<at::Tensor>& conv_states,
                                 const c10::optional<at::Tensor>& query_start_loc,
                                 const c10::optional<at::Tensor>& cache_indices,
                                 const c10::optional<at::Tensor>& has_initial_state, bool silu_activation,
                                 int64_t pad_slot_id);
at::Tensor causal_conv1d_update_cpu(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& bias, bool silu_activation,
                                    const c10::optional<at::Tensor>& cache_seqlens,
                                    const c10::optional<at::Tensor>& conv_state_indices, int64_t pad_slot_id);
at::Tensor fused_rmsnorm_gated_cpu(const at::Tensor& input, const c10::optional<at::Tensor>& weight,
                                   const c10::optional<at::Tensor>& gate, double eps);
void fused_sigmoid_mul_cpu(const at::Tensor& x, const at::Tensor& gate);
std::tuple<at::Tensor, at::Tensor> fused_qk_gemma_rmsnorm_cpu(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& q_weight, const at::Tensor& k_weight,
                                                              double eps, int64_t head_dim);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_qk_gemma_rmsnorm_with_gate_cpu(
    const at::Tensor& q_gate, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
    int64_t head_dim, int64_t num_head);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_qkvzba_split_reshape_cat_contiguous_cpu(
    const at::Tensor& mixed_qkvz, const at::Tensor& mixed_ba, int64_t num_heads_qk, int64_t num_heads_v,
    int64_t head_qk, int64_t head_v);
void assign_req_to_token_pool_cpu(const at::Tensor& req_pool_indices, const at::Tensor& req_to_token,
                                  const at::Tensor& start_offset, const at::Tensor& end_offset,
                                  const at::Tensor& out_cache_loc, int64_t pool_len);
void copy_all_layer_kv_cache_cpu(const at::Tensor& data_ptrs, const at::Tensor& data_strides, const at::Tensor& tgt_loc,
                                 const at::Tensor& src_loc);
at::Tensor murmur_hash32_cpu(const at::Tensor& seed, const at::Tensor& positions, const at::Tensor& col_indices);
int64_t moe_experts_cpu_submit(const at::Tensor& hidden, const at::Tensor& topk_weights, at::TensorList expert_rows,
                               at::TensorList w13, at::TensorList w2, const at::Tensor& out, bool accumulate,
                               int64_t format, const OptTensorList& w13_scale, const OptTensorList& w2_scale,
                               const OptTensorList& w13_scale_2, const OptTensorList& w2_scale_2,
                               const OptTensorList& w13_bias, const OptTensorList& w2_bias, int64_t activation,
                               double alpha, double limit);
void moe_experts_cpu_wait(int64_t handle);
int64_t expert_pool_set_threads(int64_t n);
std::string expert_pool_info();
int64_t moe_experts_cpu_plan(const at::Tensor& staging_hidden, const at::Tensor& staging_weights,
                             const at::Tensor& staging_rows, at::TensorList w13, at::TensorList w2,
                             const at::Tensor& staging_out, int64_t format, const OptTensorList& w13_scale,
                             const OptTensorList& w2_scale, const OptTensorList& w13_scale_2,
                             const OptTensorList& w2_scale_2, const OptTensorList& w13_bias,
                             const OptTensorList& w2_bias, int64_t activation, double alpha, double limit);
void moe_experts_cpu_run_plan(int64_t plan, int64_t tokens);
double expert_pool_read_bandwidth(const at::Tensor& buffer, int64_t passes);

namespace {
std::string cpu_isa() { return current_isa(); }
std::string set_cpu_isa(std::string name) { return select_isa(name); }
}  // namespace
}  // namespace sglk

// A fragment, not TORCH_LIBRARY: on a CUDA machine upstream's sglang-kernel registers its own
// ops in the same namespace, in the same process.
TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  // gated delta net
  m.def("fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)");
  m.def(
      "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
      "Tensor(a!)? initial_state, bool output_final_state, Tensor? cu_seqlens, bool head_first, "
      "bool use_qk_l2norm_in_kernel, Tensor? initial_state_indices=None, float eps=1e-6, "
      "bool output_chunk_states=False, float? scale=None, bool inplace_update=True, "
      "Tensor? state_emit_indices=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, "
      "Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor? cu_seqlens, "
      "bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor");

  // causal conv1d
  m.def(
      "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, "
      "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation, "
      "int pad_slot_id=-1) -> Tensor");
  m.def(
      "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
      "bool silu_activation, Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id=-1) -> Tensor");

  // norms / elementwise
  m.def("fused_rmsnorm_gated_cpu(Tensor input, Tensor? weight, Tensor? gate, float eps) -> Tensor");
  m.def("fused_sigmoid_mul_cpu(Tensor(a!) x, Tensor gate) -> ()");
  // Qwen3.5 (csrc/cpu/qwen3_5.cpp)
  m.def(
      "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) "
      "-> (Tensor, Tensor)");
  m.def(
      "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
      "int head_dim, int num_head) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
      "int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)");

  // memory management
  m.def(
      "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
      "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()");
  m.def("copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor data_strides, Tensor tgt_loc, Tensor src_loc) -> ()");

  // sampling
  m.def("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor");

  // CPU executor (python/sgl_kernel_fork/cpu_executor.py); `format` is a code of
  // SGLK_EXPERT_FORMATS (isa/cpu_executor_args.h), expert_cache_enum("expert_format") its names;
  // `activation` one of SGLK_EXPERT_ACTIVATIONS, expert_cache_enum("expert_activation")
  m.def(
      "moe_experts_cpu(Tensor hidden, Tensor topk_weights, Tensor[] expert_rows, Tensor[] w13, Tensor[] w2, "
      "Tensor(a!) out, bool accumulate, int format=0, Tensor[]? w13_scale=None, Tensor[]? w2_scale=None, "
      "Tensor[]? w13_scale_2=None, Tensor[]? w2_scale_2=None, Tensor[]? w13_bias=None, Tensor[]? w2_bias=None, "
      "int activation=0, float alpha=1.702, float limit=7.0) -> ()");
  m.def(
      "moe_experts_cpu_submit(Tensor hidden, Tensor topk_weights, Tensor[] expert_rows, Tensor[] w13, Tensor[] w2, "
      "Tensor(a!) out, bool accumulate, int format=0, Tensor[]? w13_scale=None, Tensor[]? w2_scale=None, "
      "Tensor[]? w13_scale_2=None, Tensor[]? w2_scale_2=None, Tensor[]? w13_bias=None, Tensor[]? w2_bias=None, "
      "int activation=0, float alpha=1.702, float limit=7.0) -> int");
  m.def("moe_experts_cpu_wait(int handle) -> ()", &sglk::moe_experts_cpu_wait);
  m.def("expert_pool_set_threads(int n) -> int", &sglk::expert_pool_set_threads);
  m.def("expert_pool_info() -> str", &sglk::expert_pool_info);
  m.def("expert_pool_read_bandwidth(Tensor buffer, int passes) -> float");
  // fixed-address plans for the CUDA stream branch (csrc/cpu/cpu_executor_plan.cpp)
  m.def(
      "moe_experts_cpu_plan(Tensor staging_hidden, Tensor staging_weights, Tensor staging_rows, Tensor[] w13, "
      "Tensor[] w2, Tensor staging_out, int format=0, Tensor[]? w13_scale=None, Tensor[]? w2_scale=None, "
      "Tensor[]? w13_scale_2=None, Tensor[]? w2_scale_2=None, Tensor[]? w13_bias=None, Tensor[]? w2_bias=None, "
      "int activation=0, float alpha=1.702, float limit=7.0) -> int");
  m.def("moe_experts_cpu_run_plan(int plan, int tokens) -> ()", &sglk::moe_experts_cpu_run_plan);
  m.def(
      "moe_experts_cpu_enqueue(Tensor hidden, Tensor topk_weights, Tensor cpu_rows, int plan, Tensor(b!) "
      "staging_hidden, "
      "Tensor(c!) staging_weights, Tensor(d!) staging_rows, Tensor(e!) staging_out, Tensor(a!) out) -> ()");

  // kernel ISA selection (diagnostics / tests)
  m.def("cpu_isa() -> str", &sglk::cpu_isa);
  m.def("set_cpu_isa(str name) -> str", &sglk::set_cpu_isa);
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("fused_gdn_gating_cpu", &sglk::fused_gdn_gating_cpu);
  m.impl("chunk_gated_delta_rule_cpu", &sglk::chunk_gated_delta_rule_cpu);
  m.impl("fused_sigmoid_gating_delta_rule_update_cpu", &sglk::fused_sigmoid_gating_delta_rule_update_cpu);
  m.impl("causal_conv1d_fwd_cpu", &sglk::causal_conv1d_fwd_cpu);
  m.impl("causal_conv1d_update_cpu", &sglk::causal_conv1d_update_cpu);
  m.impl("fused_rmsnorm_gated_cpu", &sglk::fused_rmsnorm_gated_cpu);
  m.impl("fused_sigmoid_mul_cpu", &sglk::fused_sigmoid_mul_cpu);
  m.impl("fused_qk_gemma_rmsnorm_cpu", &sglk::fused_qk_gemma_rmsnorm_cpu);
  m.impl("fused_qk_gemma_rmsnorm_with_gate_cpu", &sglk::fused_qk_gemma_rmsnorm_with_gate_cpu);
  m.impl("fused_qkvzba_split_reshape_cat_contiguous_cpu", &sglk::fused_qkvzba_split_reshape_cat_contiguous_cpu);
  m.impl("assign_req_to_token_pool_cpu", &sglk::assign_req_to_token_pool_cpu);
  m.impl("copy_all_layer_kv_cache_cpu", &sglk::copy_all_layer_kv_cache_cpu);
  m.impl("murmur_hash32_cpu", &sglk::murmur_hash32_cpu);
  m.impl("moe_experts_cpu", &sglk::moe_experts_cpu);
  m.impl("moe_experts_cpu_submit", &sglk::moe_experts_cpu_submit);
  m.impl("expert_pool_read_bandwidth", &sglk::expert_pool_read_bandwidth);
  m.impl("moe_experts_cpu_plan", &sglk::moe_experts_cpu_plan);
}

// The extension is imported as the Python module sgl_kernel_fork._C; importing it
// runs the static registrations above.
static struct PyModuleDef sglk_module = {PyModuleDef_HEAD_INIT, "_C",
                                         "sgl_kernel_fork CPU operators (torch.ops.sgl_kernel)", -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&sglk_module); }
