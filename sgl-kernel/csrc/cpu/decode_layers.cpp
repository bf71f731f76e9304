// Every Qwen3-MoE decoder layer of one CPU decode pass as one op (issue 18):
//
//   decode_layers_plan_cpu(tensors, ints, floats) -> plan id
//   decode_layers_cpu(plan, hidden [B, H] bf16, positions [B] int, out_cache_loc [B] int,
//                     caches [3L]: (k_cache, v_cache, cos_sin_cache) per layer,
//                     kv_index [B]: each request's KV slots) -> [B, H] bf16
//   decode_layers_plan_free_cpu(plan)
//
// python/sglang/srt/models/qwen3_moe_cpu_decode.py runs the same ops in the same order from
// Python (norm -> qkv -> q/k norm + rotary -> KV write -> attention -> o_proj -> add + norm
// -> router -> softmax top-k -> experts -> ... -> final add + norm). Here they are called
// straight from C++ (the fork's ops by their C++ functions, top-k by the ATen ops
// fused_topk_torch_native calls), with the GIL released for the whole pass: about 190 Python
// op calls and their argument conversion per step become one. The outputs are bit-identical
// to the Python sequence's (test/e2e/test_cpu_decode_layers.py).
//
// A plan holds the layers' weights (by reference: a weight updated in place is seen, a
// replaced one is not; the Python side frees and rebuilds the plan then). The KV caches and
// rotary caches travel with each call, since the KV pool may be resized between passes.
//
// Plan layout, per layer, in order:
//   tensors: in_norm_w, post_norm_w, qkv_w, qkv_b (numel 0: none), q_norm_w, k_norm_w, o_w,
//            o_b (numel 0: none), gate_w, w13, w2; then, once, the final norm weight.
//   ints:    q_size, kv_size, num_heads, num_kv_heads, head_dim, rotary_dim, is_neox, top_k,
//            renormalize.
//   floats:  in_eps, post_eps, qk_eps, attention scale; then, once, the final norm's eps.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "cpu_executor_pool.h"
#include "ops.h"

namespace sglk {

namespace {

#define DLY_CHECK(cond, ...) TORCH_CHECK(cond, "decode_layers_cpu: ", __VA_ARGS__)

constexpr int kTensorsPerLayer = 11, kIntsPerLayer = 9, kFloatsPerLayer = 4;
// fused_topk_torch_native's _RENORMALIZE_SUM_EPSILON (python/sglang/srt/layers/moe/topk.py)
constexpr double kRenormalizeEps = 1e-20;
// moe_experts_cpu's schema defaults (torch_extension_cpu.cpp): bf16, SiLU
constexpr int64_t kFormatBf16 = 0, kActivationSilu = 0;
constexpr double kAlphaDefault = 1.702, kLimitDefault = 7.0;

struct Layer {
  at::Tensor in_w, post_w, qkv_w, q_norm_w, k_norm_w, o_w, gate_w, w13, w2;
  c10::optional<at::Tensor> qkv_b, o_b;
  int64_t q_size, kv_size, heads, kv_heads, head_dim, rotary_dim, top_k;
  bool neox, renormalize;
  double in_eps, post_eps, qk_eps, scale;
};

struct Plan {
  std::vector<Layer> layers;
  at::Tensor final_w;
  double final_eps = 0.0;
  int64_t hidden = 0;
};

std::mutex g_mu;
std::unordered_map<int64_t, std::shared_ptr<Plan>> g_plans;
int64_t g_next = 1;

std::shared_ptr<Plan> find_plan(int64_t id) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_plans.find(id);
  DLY_CHECK(it != g_plans.end(), "unknown plan ", id, " (never returned by decode_layers_plan_cpu, or freed)");
  return it->second;
}

void check_bf16_matrix(const at::Tensor& t, int64_t rows, int64_t cols, const char* what, int64_t layer) {
  DLY_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.size(0) == rows &&
                t.size(1) == cols && t.stride(1) == 1,
            "layer ", layer, "'s ", what, " must be a CPU bf16 [", rows, ", ", cols,
            "] matrix with unit inner stride, got ", t.scalar_type(), " ", t.sizes());
}

// k_cache[loc[r]] = k[r] (and v), the KV pool's naive set_kv_buffer for a bf16 pool:
// one [kv_heads, head_dim] row per token, copied as is.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& loc, int64_t layer) {
  const int64_t rows = k.size(0), row_elems = k.size(1) * k.size(2);
  for (const at::Tensor* c : {&k_cache, &v_cache})
    DLY_CHECK(c->device().is_cpu() && c->scalar_type() == at::kBFloat16 && c->dim() == 3 &&
                  c->size(1) * c->size(2) == row_elems && c->stride(2) == 1 && c->stride(1) == c->size(2),
              "layer ", layer, "'s KV cache must be a CPU bf16 [slots, ", k.size(1), ", ", k.size(2),
              "] tensor with contiguous rows, got ", c->scalar_type(), " ", c->sizes());
  const int64_t slots = k_cache.size(0);
  DLY_CHECK(v_cache.size(0) == slots, "layer ", layer, "'s K and V caches have different slot counts");
  const int64_t* l = loc.data_ptr<int64_t>();
  auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr());
  auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    DLY_CHECK(l[r] >= 0 && l[r] < slots, "out_cache_loc ", l[r], " of row ", r, " outside the KV pool [0, ", slots,
              ")");
    std::memcpy(kc + l[r] * k_cache.stride(0), kp + r * k.stride(0), size_t(row_elems) * 2);
    std::memcpy(vc + l[r] * v_cache.stride(0), vp + r * v.stride(0), size_t(row_elems) * 2);
  }
}

}  // namespace

int64_t decode_layers_plan_cpu(at::TensorList tensors, at::IntArrayRef ints, at::ArrayRef<double> floats) {
  DLY_CHECK(tensors.size() >= 1 && (tensors.size() - 1) % kTensorsPerLayer == 0, "tensors must hold ", kTensorsPerLayer,
            " per layer and the final norm weight, got ", tensors.size());
  const int64_t L = static_cast<int64_t>((tensors.size() - 1) / kTensorsPerLayer);
  DLY_CHECK(L >= 1, "a plan needs at least one layer");
  DLY_CHECK(static_cast<int64_t>(ints.size()) == L * kIntsPerLayer, "ints must hold ", kIntsPerLayer, " per layer (",
            L * kIntsPerLayer, "), got ", ints.size());
  DLY_CHECK(static_cast<int64_t>(floats.size()) == L * kFloatsPerLayer + 1, "floats must hold ", kFloatsPerLayer,
            " per layer and the final eps (", L * kFloatsPerLayer + 1, "), got ", floats.size());
  auto plan = std::make_shared<Plan>();
  plan->final_w = tensors.back();
  plan->final_eps = floats.back();
  const int64_t H = plan->final_w.numel();
  plan->hidden = H;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* t = tensors.data() + i * kTensorsPerLayer;
    const int64_t* n = ints.data() + i * kIntsPerLayer;
    const double* f = floats.data() + i * kFloatsPerLayer;
    Layer y;
    y.in_w = t[0];
    y.post_w = t[1];
    y.qkv_w = t[2];
    if (t[3].numel() > 0) y.qkv_b = t[3];
    y.q_norm_w = t[4];
    y.k_norm_w = t[5];
    y.o_w = t[6];
    if (t[7].numel() > 0) y.o_b = t[7];
    y.gate_w = t[8];
    y.w13 = t[9];
    y.w2 = t[10];
    y.q_size = n[0];
    y.kv_size = n[1];
    y.heads = n[2];
    y.kv_heads = n[3];
    y.head_dim = n[4];
    y.rotary_dim = n[5];
    y.neox = n[6] != 0;
    y.top_k = n[7];
    y.renormalize = n[8] != 0;
    y.in_eps = f[0];
    y.post_eps = f[1];
    y.qk_eps = f[2];
    y.scale = f[3];
    DLY_CHECK(y.heads > 0 && y.kv_heads > 0 && y.heads % y.kv_heads == 0 && y.q_size == y.heads * y.head_dim &&
                  y.kv_size == y.kv_heads * y.head_dim,
              "layer ", i, ": q_size / kv_size must be heads x head_dim with heads a multiple of kv_heads, got ",
              y.q_size, " / ", y.kv_size, " for ", y.heads, " / ", y.kv_heads, " heads of ", y.head_dim);
    check_bf16_matrix(y.qkv_w, y.q_size + 2 * y.kv_size, H, "qkv weight", i);
    check_bf16_matrix(y.o_w, H, y.q_size, "o_proj weight", i);
    DLY_CHECK(y.gate_w.dim() == 2 && y.gate_w.size(1) == H, "layer ", i, "'s router weight must be [experts, ", H,
              "], got ", y.gate_w.sizes());
    DLY_CHECK(y.top_k >= 1 && y.top_k <= y.gate_w.size(0), "layer ", i, ": top_k ", y.top_k, " outside [1, ",
              y.gate_w.size(0), "]");
    DLY_CHECK(y.in_w.numel() == H && y.post_w.numel() == H, "layer ", i, "'s norm weights must have ", H, " elements");
    plan->layers.push_back(std::move(y));
  }
  std::lock_guard<std::mutex> lk(g_mu);
  const int64_t id = g_next++;
  g_plans.emplace(id, std::move(plan));
  return id;
}

void decode_layers_plan_free_cpu(int64_t plan) {
  std::shared_ptr<Plan> keep;  // freed after the lock
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_plans.find(plan);
  if (it != g_plans.end()) {
    keep = std::move(it->second);
    g_plans.erase(it);
  }
}

at::Tensor decode_layers_cpu(int64_t plan_id, const at::Tensor& hidden, const at::Tensor& positions,
                             const at::Tensor& out_cache_loc, at::TensorList caches, at::TensorList kv_index) {
  const std::shared_ptr<Plan> plan = find_plan(plan_id);
  const int64_t L = static_cast<int64_t>(plan->layers.size());
  DLY_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2 &&
                hidden.size(1) == plan->hidden && hidden.is_contiguous(),
            "hidden must be a contiguous CPU bf16 [rows, ", plan->hidden, "] tensor, got ", hidden.scalar_type(), " ",
            hidden.sizes());
  const int64_t rows = hidden.size(0);
  DLY_CHECK(rows >= 1, "no rows");
  DLY_CHECK(positions.numel() == rows && out_cache_loc.numel() == rows,
            "positions and out_cache_loc need one entry per row (", rows, "), got ", positions.numel(), " and ",
            out_cache_loc.numel());
  DLY_CHECK(static_cast<int64_t>(caches.size()) == 3 * L, "caches must hold (k_cache, v_cache, cos_sin_cache) for ",
            "each of the ", L, " layers, got ", caches.size(), " tensors");
  DLY_CHECK(static_cast<int64_t>(kv_index.size()) == rows, "kv_index needs one tensor per row (", rows, "), got ",
            kv_index.size());
  GilRelease nogil;  // nothing below touches Python
  const at::Tensor pos = positions.reshape({-1});
  const at::Tensor loc = out_cache_loc.reshape({-1}).to(at::kLong).contiguous();
  const c10::optional<at::Tensor> no_bias;
  at::Tensor h = hidden, residual;
  for (int64_t i = 0; i < L; ++i) {
    const Layer& p = plan->layers[size_t(i)];
    if (!residual.defined()) {
      residual = h;
      h = rmsnorm_cpu(h, p.in_w, p.in_eps);
    } else {
      fused_add_rmsnorm_cpu(h, residual, p.in_w, p.in_eps);
    }
    const at::Tensor qkv = dense_linear_cpu(h, p.qkv_w, p.qkv_b);
    const at::Tensor q = qkv.narrow(1, 0, p.q_size);
    const at::Tensor k = qkv.narrow(1, p.q_size, p.kv_size);
    const at::Tensor v = qkv.narrow(1, p.q_size + p.kv_size, p.kv_size);
    const at::Tensor& k_cache = caches[size_t(3 * i)];
    const at::Tensor& v_cache = caches[size_t(3 * i + 1)];
    fused_qk_norm_rope_cpu(q, k, p.q_norm_w, p.k_norm_w, p.qk_eps, p.neox, pos, caches[size_t(3 * i + 2)],
                           p.rotary_dim);
    const at::Tensor k3 = k.view({rows, p.kv_heads, p.head_dim});
    const at::Tensor v3 = v.view({rows, p.kv_heads, p.head_dim});
    write_kv(k3, v3, k_cache, v_cache, loc, i);
    at::Tensor o = at::empty({rows, p.q_size}, hidden.options());
    const at::Tensor q3 = q.view({rows, p.heads, p.head_dim});
    const at::Tensor o3 = o.view({rows, p.heads, p.head_dim});
    for (int64_t r = 0; r < rows; ++r) {
      at::Tensor o_r = o3.narrow(0, r, 1);
      extend_attention_cpu(q3.narrow(0, r, 1), k_cache, v_cache, o_r, 0, p.scale, false, kv_index[size_t(r)]);
    }
    h = dense_linear_cpu(o, p.o_w, p.o_b);
    fused_add_rmsnorm_cpu(h, residual, p.post_w, p.post_eps);
    // fused_topk_torch_native (python/sglang/srt/layers/moe/topk.py), softmax without a
    // correction bias: the same ATen ops, so the same weights and ids.
    const at::Tensor logits = dense_linear_cpu(h, p.gate_w, no_bias);
    auto top = at::topk(logits.to(at::kFloat).softmax(-1), p.top_k, -1);
    at::Tensor weights = std::get<0>(top);
    if (p.renormalize) weights = weights / (weights.sum({-1}, true, at::kFloat) + kRenormalizeEps);
    const at::Tensor ids = std::get<1>(top).to(at::kInt).contiguous();
    at::Tensor out = at::empty({rows, p.w2.size(1)}, hidden.options().dtype(at::kFloat));
    moe_experts_cpu(h, weights.to(at::kFloat).contiguous(), {ids}, {p.w13}, {p.w2}, out, false, kFormatBf16,
                    c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, kActivationSilu,
                    kAlphaDefault, kLimitDefault);
    h = out.to(at::kBFloat16);
  }
  fused_add_rmsnorm_cpu(h, residual, plan->final_w, plan->final_eps);
  return h;
}

}  // namespace sglk

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("decode_layers_plan_cpu(Tensor[] tensors, int[] ints, float[] floats) -> int", &sglk::decode_layers_plan_cpu);
  m.def("decode_layers_plan_free_cpu(int plan) -> ()", &sglk::decode_layers_plan_free_cpu);
  m.def(
      "decode_layers_cpu(int plan, Tensor(a!) hidden, Tensor positions, Tensor out_cache_loc, Tensor[] caches, "
      "Tensor[] kv_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) { m.impl("decode_layers_cpu", &sglk::decode_layers_cpu); }
