// RMSNorm, add + RMSNorm and per-head q/k RMSNorm (+ rotary) as one op each, under the names and
// schemas upstream sglang's CPU path calls:
//
//   rmsnorm_cpu               y = rmsnorm(x) * w                      (layernorm.py RMSNorm)
//   fused_add_rmsnorm_cpu     r = x + r; x = rmsnorm(r) * w, in place (layernorm.py RMSNorm)
//   fused_qk_norm_cpu         per-head rmsnorm of q and k, in place   (models/utils.py apply_qk_norm)
//   fused_qk_norm_rope_cpu    the same, then rotary on the first      (models/qwen3_moe.py
//                             rotary_dim of every head, in place       apply_qk_norm_rope)
//
// Why: without them a CPU decode step ran each norm as ~10 torch ops (to / pow / mean / add /
// rsqrt / mul / to) and each rotary as ~15 (index_select / chunk / mul / sub / cat), ~270 of the
// ~550 small ops of a 4-layer Qwen3-MoE step plus the Python between them (issue 18).
//
// Numerics: the formulas of upstream's torch-native paths, with their roundings, so the fused
// and unfused paths agree to the last bit except for the order of the fp32 sum of squares:
//   RMSNorm.forward_native (srt/layers/layernorm.py): x in fp32 (plus the residual in fp32, the
//     new residual rounded once to the input dtype), var = mean(x^2), y = T((x * rsqrt(var + eps))
//     * w), the normalised value taken from the unrounded fp32 sum;
//   rotary_embedding/utils.py apply_rotary_emb: cos and sin rounded to T, and every product and
//     sum rounded to T as torch's elementwise ops in T do: o1 = T(T(x1 c) - T(x2 s)),
//     o2 = T(T(x2 c) + T(x1 s)); neox (halves) or GPT-J (even / odd pairs) pairing.
// T is the input dtype (bfloat16, float16 or float32); the computation is fp32 throughout.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "common.h"

namespace sglk {
namespace {

template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// 1 / sqrt(mean(x^2) + eps) of n fp32 values.
inline float inv_rms(const float* x, int64_t n, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// y[i] = T((x[i] * r) * w[i]) for fp32 x, written to out (T).
template <typename T>
inline void scale_store(const float* x, float r, const float* w, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>((x[i] * r) * w[i]);
}

at::Tensor rows_view(const at::Tensor& t, int64_t n, const char* what) {
  SGLK_CHECK_CPU(t);
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == n, what, " must have last dimension ", n, ", got ", t.sizes());
  return t.dim() == 2 ? t : t.reshape({-1, n});
}

void check_float_dtype(const at::Tensor& t, const char* what) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, what,
              " must be float32, bfloat16 or float16, got ", st);
}

// Grain of at::parallel_for over rows of n elements: one task below ~16K elements, so a decode
// step (one or a few rows) runs inline on the caller's thread.
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// Per-head RMSNorm of `heads` heads of head_dim at p (row of T), in place, then (when cs is
// given: cos[rot/2] then sin[rot/2], fp32) rotary on the first rot elements of each head.
template <typename T>
void head_norm_rope(T* p, int64_t heads, int64_t head_dim, const float* w, float eps, const float* cs, int64_t rot,
                    bool neox, float* buf) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = p + h * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) buf[i] = static_cast<float>(x[i]);
    const float r = inv_rms(buf, head_dim, eps);
    for (int64_t i = 0; i < head_dim; ++i) buf[i] = rnd<T>((buf[i] * r) * w[i]);
    if (cs != nullptr) {
      for (int64_t j = 0; j < half; ++j) {
        const int64_t i1 = neox ? j : 2 * j, i2 = neox ? j + half : 2 * j + 1;
        const float x1 = buf[i1], x2 = buf[i2], c = cs[j], s = cs[half + j];
        const float o1 = rnd<T>(rnd<T>(x1 * c) - rnd<T>(x2 * s));
        const float o2 = rnd<T>(rnd<T>(x2 * c) + rnd<T>(x1 * s));
        buf[i1] = o1;
        buf[i2] = o2;
      }
    }
    for (int64_t i = 0; i < head_dim; ++i) x[i] = static_cast<T>(buf[i]);
  }
}

// q: [T, nh * head_dim], k: [T, nkv * head_dim], each row dense (a column slice of qkv is fine),
// changed in place. cos_sin: [T, rot] fp32 rows already gathered by position, or undefined.
void qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                  double eps, int64_t head_dim, const at::Tensor& cos_sin, int64_t rot, bool neox) {
  SGLK_CHECK_CPU(q);
  SGLK_CHECK_CPU(k);
  SGLK_CHECK_DIM(q, 2);
  SGLK_CHECK_DIM(k, 2);
  check_float_dtype(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have q's dtype ", q.scalar_type(), ", got ", k.scalar_type());
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1, "q and k must be dense in their last dimension");
  TORCH_CHECK(q.size(0) == k.size(0), "q and k must have the same tokens, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(head_dim > 0 && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0, "q ", q.sizes(), " and k ",
              k.sizes(), " must hold whole heads of ", head_dim);
  TORCH_CHECK(q_weight.numel() == head_dim && k_weight.numel() == head_dim, "q_weight and k_weight must have ",
              head_dim, " elements, got ", q_weight.sizes(), " and ", k_weight.sizes());
  const at::Tensor qw = as_float_contig(q_weight), kw = as_float_contig(k_weight);
  const int64_t T_ = q.size(0), qh = q.size(1) / head_dim, kh = k.size(1) / head_dim;
  const float* cs = cos_sin.defined() ? cos_sin.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "qk_norm_rope", [&] {
    scalar_t* q0 = q.data_ptr<scalar_t>();
    scalar_t* k0 = k.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0), ks = k.stride(0);
    at::parallel_for(0, T_, row_grain((qh + kh) * head_dim), [&](int64_t t0, int64_t t1) {
      std::vector<float> buf(head_dim);
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = cs != nullptr ? cs + t * rot : nullptr;
        head_norm_rope<scalar_t>(q0 + t * qs, qh, head_dim, qw.data_ptr<float>(), static_cast<float>(eps), c, rot, neox,
                                 buf.data());
        head_norm_rope<scalar_t>(k0 + t * ks, kh, head_dim, kw.data_ptr<float>(), static_cast<float>(eps), c, rot, neox,
                                 buf.data());
      }
    });
  });
}

}  // namespace

// input: [..., n] (rows dense or not), weight: [n]. Returns a new contiguous tensor of input's
// shape and dtype: RMSNorm.forward_native without a residual.
at::Tensor rmsnorm_cpu(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_float_dtype(input, "input");
  const int64_t n = input.size(-1);
  TORCH_CHECK(weight.numel() == n, "weight must have ", n, " elements, got ", weight.sizes());
  at::Tensor x2 = rows_view(input, n, "input");
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const at::Tensor wf = as_float_contig(weight);
  at::Tensor out = at::empty(input.sizes(), input.options());
  const int64_t rows = x2.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rmsnorm_cpu", [&] {
    const scalar_t* x0 = x2.data_ptr<scalar_t>();
    scalar_t* o0 = out.data_ptr<scalar_t>();
    const int64_t xs = x2.stride(0);
    at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(n);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* x = x0 + r * xs;
        for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(x[i]);
        scale_store<scalar_t>(buf.data(), inv_rms(buf.data(), n, static_cast<float>(eps)), wf.data_ptr<float>(), n,
                              o0 + r * n);
      }
    });
  });
  return out;
}

// input, residual: [..., n], same shape and dtype, rows dense. In place: residual <- T(input +
// residual) and input <- rmsnorm(the fp32 sum) * weight (RMSNorm.forward_native with a
// residual, which returns the pair (input, residual) this op leaves behind).
void fused_add_rmsnorm_cpu(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float_dtype(input, "input");
  const int64_t n = input.size(-1);
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.scalar_type() == input.scalar_type(),
              "residual must have input's shape ", input.sizes(), " and dtype ", input.scalar_type(), ", got ",
              residual.sizes(), " ", residual.scalar_type());
  TORCH_CHECK(weight.numel() == n, "weight must have ", n, " elements, got ", weight.sizes());
  const at::Tensor x2 = rows_view(input, n, "input"), r2 = rows_view(residual, n, "residual");
  TORCH_CHECK(x2.stride(1) == 1 && r2.stride(1) == 1 && x2.is_alias_of(input) && r2.is_alias_of(residual),
              "input and residual must be views with dense rows (they are written in place)");
  const at::Tensor wf = as_float_contig(weight);
  const int64_t rows = x2.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "fused_add_rmsnorm_cpu", [&] {
    scalar_t* x0 = x2.data_ptr<scalar_t>();
    scalar_t* res0 = r2.data_ptr<scalar_t>();
    const int64_t xs = x2.stride(0), rs = r2.stride(0);
    at::parallel_for(0, rows, row_grain(n), [&](int64_t a, int64_t b) {
      std::vector<float> buf(n);
      for (int64_t r = a; r < b; ++r) {
        scalar_t* x = x0 + r * xs;
        scalar_t* res = res0 + r * rs;
        for (int64_t i = 0; i < n; ++i) {
          buf[i] = static_cast<float>(x[i]) + static_cast<float>(res[i]);
          res[i] = static_cast<scalar_t>(buf[i]);
        }
        scale_store<scalar_t>(buf.data(), inv_rms(buf.data(), n, static_cast<float>(eps)), wf.data_ptr<float>(), n, x);
      }
    });
  });
}

// q: [T, nh * head_dim], k: [T, nkv * head_dim] (dense rows: column slices of qkv are fine),
// weights [head_dim]. In place: every head of q and k RMSNorm-ed (apply_qk_norm's per-head
// q_norm / k_norm; head_dim from the weight).
void fused_qk_norm_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                       double eps) {
  qk_norm_rope(q, k, q_weight, k_weight, eps, q_weight.numel(), at::Tensor(), 0, false);
}

// q, k, weights: as fused_qk_norm_cpu; positions: [T] integer; cos_sin_cache: [max_pos,
// rotary_dim] (cos half, then sin half; any float dtype), rotary_dim even and <= head_dim. In
// place: the per-head norm, then rotary on the first rotary_dim elements of every head at the
// token's position (RotaryEmbedding.forward_native). Positions out of the cache's range raise.
void fused_qk_norm_rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                            const at::Tensor& k_weight, double eps, bool is_neox, const at::Tensor& positions,
                            const at::Tensor& cos_sin_cache, int64_t rotary_dim) {
  const int64_t head_dim = q_weight.numel();
  SGLK_CHECK_CPU(positions);
  SGLK_CHECK_CPU(cos_sin_cache);
  SGLK_CHECK_DIM(cos_sin_cache, 2);
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rotary_dim must be even and in (0, ",
              head_dim, "], got ", rotary_dim);
  TORCH_CHECK(cos_sin_cache.size(1) == rotary_dim, "cos_sin_cache must have rotary_dim = ", rotary_dim,
              " columns, got ", cos_sin_cache.sizes());
  TORCH_CHECK(positions.numel() == q.size(0), "positions must have one entry per token (", q.size(0), "), got ",
              positions.sizes());
  const at::Tensor pos = positions.reshape({-1}).to(at::kLong).contiguous();
  const int64_t T_ = pos.numel(), max_pos = cos_sin_cache.size(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  // The cache rows of the tokens' positions, cos / sin rounded to q's dtype first
  // (apply_rotary_emb's .to(x.dtype)), held as fp32 [T, rotary_dim].
  at::Tensor cs = at::empty({T_, rotary_dim}, q.options().dtype(at::kFloat));
  float* c0 = cs.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cos_sin_cache.scalar_type(), "rope_cache", [&] {
    const scalar_t* cache = cos_sin_cache.data_ptr<scalar_t>();
    const int64_t s0 = cos_sin_cache.stride(0), s1 = cos_sin_cache.stride(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_round", [&] {
      using qt = scalar_t;
      for (int64_t t = 0; t < T_; ++t) {
        TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "position ", p[t], " of token ", t, " outside the cache [0, ", max_pos,
                    ")");
        const auto* row = cache + p[t] * s0;
        for (int64_t i = 0; i < rotary_dim; ++i) c0[t * rotary_dim + i] = rnd<qt>(static_cast<float>(row[i * s1]));
      }
    });
  });
  qk_norm_rope(q, k, q_weight, k_weight, eps, head_dim, cs, rotary_dim, is_neox);
}

// SGLANG_CPU_FUSED_NORM=0 in the environment when the library loads: the ops below are not
// registered, so upstream's callers (which check that they exist) keep their torch paths.
static bool fused_norm_off() {
  const char* v = std::getenv("SGLANG_CPU_FUSED_NORM");
  return v != nullptr && std::string(v) == "0";
}

}  // namespace sglk

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  if (sglk::fused_norm_off()) return;
  m.def("rmsnorm_cpu(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rmsnorm_cpu(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("fused_qk_norm_cpu(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, float eps) -> ()");
  m.def(
      "fused_qk_norm_rope_cpu(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, float eps, bool is_neox, "
      "Tensor positions, Tensor cos_sin_cache, int rotary_dim) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  if (sglk::fused_norm_off()) return;
  m.impl("rmsnorm_cpu", &sglk::rmsnorm_cpu);
  m.impl("fused_add_rmsnorm_cpu", &sglk::fused_add_rmsnorm_cpu);
  m.impl("fused_qk_norm_cpu", &sglk::fused_qk_norm_cpu);
  m.impl("fused_qk_norm_rope_cpu", &sglk::fused_qk_norm_rope_cpu);
}
