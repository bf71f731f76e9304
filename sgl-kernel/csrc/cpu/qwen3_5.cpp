// The CPU operators upstream's Qwen3.5 model calls on its CPU path (srt/models/qwen3_5.py, the
// `_is_cpu` block, and srt/layers/attention/linear/gdn_backend.py):
//
//   fused_qk_gemma_rmsnorm_cpu                  per-head GemmaRMSNorm of q and k
//   fused_qk_gemma_rmsnorm_with_gate_cpu        the same, q read from the per-head [q | gate]
//                                               layout of an output-gated attention; gate copied
//   fused_qkvzba_split_reshape_cat_contiguous_cpu  split of the GDN input projections
//
// Formulas of upstream's Triton kernels (srt/models/utils.py _fused_qk_gemma_rmsnorm_kernel,
// _fused_qk_gemma_rmsnorm_gate_kernel; kernels/ops/attention/triton_gdn_fused_proj.py
// fused_qkvzba_split_reshape_cat_contiguous): y = x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32,
// rounded once to x's dtype. The norm itself is the rmsnorm_gated kernel of misc.cpp with the
// weight (1 + w) and no gate.
#include <cstring>

#include "common.h"

namespace sglk {
namespace {

// out[t * heads + h, :] = gemma_rmsnorm(x[t, h * head_stride : h * head_stride + head_dim]).
// x: [T, >= heads * head_stride] with unit last stride (a column slice of a wider row is fine);
// out: [T * heads, head_dim] contiguous, x's dtype. When `gate_out` is given, it receives
// x[t, h * head_stride + head_dim : ... + 2 * head_dim] (the gate half of a [q | gate] head).
void head_gemma_rmsnorm(const at::Tensor& x, int64_t heads, int64_t head_stride, int64_t head_dim,
                        const at::Tensor& weight, double eps, const at::Tensor& out, const at::Tensor* gate_out) {
  TORCH_CHECK(weight.numel() == head_dim, "norm weight must have head_dim = ", head_dim, " elements, got ",
              weight.sizes());
  SGLK_CHECK_CPU(weight);
  const at::Tensor w1 = weight.to(at::kFloat).add(1.0).contiguous();  // Gemma: x * (1 + w)
  const int64_t T = x.size(0);
  const size_t es = x.element_size();
  RmsNormGatedArgs base{};
  base.n = head_dim;
  base.x_dt = dt_of(x, "x");
  base.x_rs = head_stride;
  base.z_dt = DT::F32;
  base.z = nullptr;
  base.weight = w1.data_ptr<float>();
  base.eps = static_cast<float>(eps);
  base.out_rs = head_dim;
  const char* x0 = static_cast<const char*>(x.data_ptr());
  char* o0 = static_cast<char*>(out.data_ptr());
  char* g0 = gate_out != nullptr ? static_cast<char*>(gate_out->data_ptr()) : nullptr;
  const IsaKernels& kern = kernels();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * head_dim, 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      RmsNormGatedArgs a = base;
      a.x = x0 + t * x.stride(0) * es;
      a.out = o0 + t * heads * head_dim * es;
      kern.rmsnorm_gated(a, 0, heads);
      if (g0 != nullptr) {
        for (int64_t h = 0; h < heads; ++h) {
          std::memcpy(g0 + (t * heads + h) * head_dim * es, x0 + (t * x.stride(0) + h * head_stride + head_dim) * es,
                      head_dim * es);
        }
      }
    }
  });
}

// x viewed as [T, width] rows with unit last stride (a 2-D column slice stays a view).
at::Tensor as_rows(const at::Tensor& x, const char* what) {
  SGLK_CHECK_CPU(x);
  TORCH_CHECK(x.dim() >= 1, what, " must have at least one dimension");
  at::Tensor r = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  if (r.stride(1) != 1) r = r.contiguous();
  return r;
}

}  // namespace

// q: [T, nh * head_dim] (or any shape whose last dimension is a whole number of heads; a column
// slice of the qkv projection is read in place), k likewise with nkv heads; weights [head_dim].
// Returns (q_out [T * nh, head_dim], k_out [T * nkv, head_dim]), contiguous, the inputs' dtypes.
std::tuple<at::Tensor, at::Tensor> fused_qk_gemma_rmsnorm_cpu(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& q_weight, const at::Tensor& k_weight,
                                                              double eps, int64_t head_dim) {
  TORCH_CHECK(head_dim > 0, "head_dim must be positive, got ", head_dim);
  const at::Tensor q2 = as_rows(q, "q"), k2 = as_rows(k, "k");
  TORCH_CHECK(q2.size(1) % head_dim == 0 && k2.size(1) % head_dim == 0, "q [", q.sizes(), "] and k [", k.sizes(),
              "] must hold whole heads of head_dim ", head_dim);
  const int64_t qh = q2.size(1) / head_dim, kh = k2.size(1) / head_dim;
  at::Tensor q_out = at::empty({q2.size(0) * qh, head_dim}, q.options());
  at::Tensor k_out = at::empty({k2.size(0) * kh, head_dim}, k.options());
  head_gemma_rmsnorm(q2, qh, head_dim, head_dim, q_weight, eps, q_out, nullptr);
  head_gemma_rmsnorm(k2, kh, head_dim, head_dim, k_weight, eps, k_out, nullptr);
  return {q_out, k_out};
}

// q_gate: [T, num_head * 2 * head_dim], per head [q_h | gate_h] (a column slice of qkv is read in
// place); k: [T, nkv * head_dim]. Returns (q_out [T * num_head, head_dim], k_out [T * nkv,
// head_dim], gate_out [T * num_head, head_dim]): q and k GemmaRMSNorm-ed, the gate copied.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_qk_gemma_rmsnorm_with_gate_cpu(
    const at::Tensor& q_gate, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
    int64_t head_dim, int64_t num_head) {
  TORCH_CHECK(head_dim > 0 && num_head > 0, "head_dim and num_head must be positive");
  const at::Tensor qg = as_rows(q_gate, "q_gate"), k2 = as_rows(k, "k");
  TORCH_CHECK(qg.size(1) == num_head * 2 * head_dim,
              "q_gate must have num_head * 2 * head_dim = ", num_head * 2 * head_dim, " columns, got ", q_gate.sizes());
  TORCH_CHECK(k2.size(1) % head_dim == 0, "k [", k.sizes(), "] must hold whole heads of head_dim ", head_dim);
  TORCH_CHECK(qg.size(0) == k2.size(0), "q_gate and k must have the same tokens");
  const int64_t kh = k2.size(1) / head_dim;
  at::Tensor q_out = at::empty({qg.size(0) * num_head, head_dim}, q_gate.options());
  at::Tensor gate_out = at::empty({qg.size(0) * num_head, head_dim}, q_gate.options());
  at::Tensor k_out = at::empty({k2.size(0) * kh, head_dim}, k.options());
  head_gemma_rmsnorm(qg, num_head, 2 * head_dim, head_dim, q_weight, eps, q_out, &gate_out);
  head_gemma_rmsnorm(k2, kh, head_dim, head_dim, k_weight, eps, k_out, nullptr);
  return {q_out, k_out, gate_out};
}

// mixed_qkvz: [B, >= qkv_dim + nv * hv] laid out [all_q | all_k | all_v | all_z] (Qwen3.5's
// separate in_proj_qkv / in_proj_z, merged); mixed_ba: [B, >= 2 * nv] laid out [all_b | all_a].
// qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v. Returns new tensors (never views of
// the inputs): mixed_qkv [B, qkv_dim], z [B, nv, hv], b [B, nv], a [B, nv].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_qkvzba_split_reshape_cat_contiguous_cpu(
    const at::Tensor& mixed_qkvz, const at::Tensor& mixed_ba, int64_t num_heads_qk, int64_t num_heads_v,
    int64_t head_qk, int64_t head_v) {
  SGLK_CHECK_CPU(mixed_qkvz);
  SGLK_CHECK_CPU(mixed_ba);
  SGLK_CHECK_DIM(mixed_qkvz, 2);
  SGLK_CHECK_DIM(mixed_ba, 2);
  TORCH_CHECK(num_heads_qk > 0 && num_heads_v % num_heads_qk == 0, "num_heads_v (", num_heads_v,
              ") must be a multiple of num_heads_qk (", num_heads_qk, ")");
  const int64_t B = mixed_qkvz.size(0);
  const int64_t qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v;
  const int64_t z_dim = num_heads_v * head_v;
  TORCH_CHECK(mixed_qkvz.size(1) >= qkv_dim + z_dim, "mixed_qkvz must have at least ", qkv_dim + z_dim,
              " columns, got ", mixed_qkvz.sizes());
  TORCH_CHECK(mixed_ba.size(0) == B && mixed_ba.size(1) >= 2 * num_heads_v, "mixed_ba must be [", B,
              ", >= ", 2 * num_heads_v, "], got ", mixed_ba.sizes());
  at::Tensor qkv = at::empty({B, qkv_dim}, mixed_qkvz.options());
  at::Tensor z = at::empty({B, num_heads_v, head_v}, mixed_qkvz.options());
  at::Tensor b = at::empty({B, num_heads_v}, mixed_ba.options());
  at::Tensor a = at::empty({B, num_heads_v}, mixed_ba.options());
  qkv.copy_(mixed_qkvz.narrow(1, 0, qkv_dim));
  z.view({B, z_dim}).copy_(mixed_qkvz.narrow(1, qkv_dim, z_dim));
  b.copy_(mixed_ba.narrow(1, 0, num_heads_v));
  a.copy_(mixed_ba.narrow(1, num_heads_v, num_heads_v));
  return {qkv, z, b, a};
}

}  // namespace sglk
