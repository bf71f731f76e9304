// Small CPU operators upstream sglang calls on its CPU path:
//
//   fused_rmsnorm_gated_cpu        y = rmsnorm(x) * w * silu(z)   (GDN output norm)
//   fused_sigmoid_mul_cpu          x *= sigmoid(gate), in place   (attention output gate)
//   assign_req_to_token_pool_cpu   scatter new KV slots into req_to_token rows
//   copy_all_layer_kv_cache_cpu    move KV rows between slots in every layer buffer
//   murmur_hash32_cpu              per-(row, column) hash for seeded sampling
#include <algorithm>
#include <cstring>

#include "common.h"

namespace sglk {

// x: [..., n]; weight: [n] or None (ones); gate (z): x's shape or None. Returns x's shape and
// dtype. Formula of upstream's layernorm_gated.py (is_rms_norm,
// norm_before_gate, swish): y = x * rsqrt(mean(x^2) + eps) * weight * silu(z),
// computed in fp32 and rounded once.
at::Tensor fused_rmsnorm_gated_cpu(const at::Tensor& input, const c10::optional<at::Tensor>& weight_opt,
                                   const c10::optional<at::Tensor>& gate, double eps) {
  SGLK_CHECK_CPU(input);
  TORCH_CHECK(input.dim() >= 1, "input must have at least one dimension");
  const int64_t n = input.size(-1);
  const bool has_w = weight_opt.has_value() && weight_opt->defined();
  if (has_w) {
    SGLK_CHECK_CPU(*weight_opt);
    TORCH_CHECK(weight_opt->numel() == n, "weight must have ", n, " elements, got ", weight_opt->sizes());
  }
  const DT xdt = dt_of(input, "input");
  at::Tensor x2 = input.reshape({-1, n});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  at::Tensor z2;
  DT zdt = DT::F32;
  const bool has_z = gate.has_value() && gate->defined();
  if (has_z) {
    SGLK_CHECK_CPU(*gate);
    TORCH_CHECK(gate->sizes() == input.sizes(), "gate must have the shape of input ", input.sizes(), ", got ",
                gate->sizes());
    zdt = dt_of(*gate, "gate");
    z2 = gate->reshape({-1, n});
    if (z2.stride(1) != 1) z2 = z2.contiguous();
  }
  const at::Tensor wf = has_w ? as_float_contig(*weight_opt) : at::ones({n}, input.options().dtype(at::kFloat));
  at::Tensor out = at::empty(input.sizes(), input.options());
  const int64_t rows = x2.size(0);
  RmsNormGatedArgs a{};
  a.n = n;
  a.x_dt = xdt;
  a.x = x2.data_ptr();
  a.x_rs = x2.stride(0);
  a.z_dt = zdt;
  a.z = has_z ? z2.data_ptr() : nullptr;
  a.z_rs = has_z ? z2.stride(0) : 0;
  a.weight = wf.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.out = out.data_ptr();
  a.out_rs = n;
  const IsaKernels& kern = kernels();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) { kern.rmsnorm_gated(a, r0, r1); });
  return out;
}

// x: [rows, hidden] (in place); gate: x's shape, or [rows, heads, head_dim]
// with heads * head_dim == hidden (strided view allowed). Upstream formula:
// kernels/ops/elementwise/elementwise.py fused_sigmoid_mul.
void fused_sigmoid_mul_cpu(const at::Tensor& x, const at::Tensor& gate) {
  SGLK_CHECK_CPU(x);
  SGLK_CHECK_CPU(gate);
  const DT xdt = dt_of(x, "x"), gdt = dt_of(gate, "gate");
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
  const int64_t hidden = x.size(-1);
  at::Tensor x2 = x.dim() == 2 ? x : x.view({-1, hidden});
  TORCH_CHECK(x2.stride(-1) == 1, "x must be contiguous in its last dimension");
  at::Tensor g3;
  if (gate.dim() == 3 && x.dim() == 2) {
    TORCH_CHECK(gate.size(0) == x.size(0) && gate.size(1) * gate.size(2) == hidden, "gate [", gate.sizes(),
                "] does not match x [", x.sizes(), "]");
    g3 = gate.stride(2) == 1 ? gate : gate.contiguous();
  } else {
    TORCH_CHECK(gate.sizes() == x.sizes(), "gate must have the shape of x ", x.sizes(), ", got ", gate.sizes());
    at::Tensor g2 = gate.reshape({-1, hidden});
    if (g2.stride(1) != 1) g2 = g2.contiguous();
    g3 = g2.unsqueeze(1);
  }
  SigmoidMulArgs a{};
  a.heads = g3.size(1);
  a.head_dim = g3.size(2);
  a.x_dt = xdt;
  a.x = x2.data_ptr();
  a.x_rs = x2.stride(0);
  a.g_dt = gdt;
  a.gate = g3.data_ptr();
  a.g_rs = g3.stride(0);
  a.g_hs = g3.stride(1);
  const IsaKernels& kern = kernels();
  at::parallel_for(0, x2.size(0), std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)),
                   [&](int64_t r0, int64_t r1) { kern.sigmoid_mul(a, r0, r1); });
}

// For each request i (tokens packed in request order in out_cache_loc):
//   req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
//       out_cache_loc[sum_{j<i} (end_offset[j] - start_offset[j]) : ...]
// as upstream's Triton assign_req_to_token_pool (srt/mem_cache/allocation.py).
void assign_req_to_token_pool_cpu(const at::Tensor& req_pool_indices, const at::Tensor& req_to_token,
                                  const at::Tensor& start_offset, const at::Tensor& end_offset,
                                  const at::Tensor& out_cache_loc, int64_t pool_len) {
  SGLK_CHECK_CPU(req_to_token);
  SGLK_CHECK_CPU(out_cache_loc);
  SGLK_CHECK_DIM(req_to_token, 2);
  TORCH_CHECK(pool_len <= req_to_token.size(1), "pool_len ", pool_len, " exceeds req_to_token width ",
              req_to_token.size(1));
  const std::vector<int64_t> rows = to_int64_vector(req_pool_indices, "req_pool_indices");
  const std::vector<int64_t> st = to_int64_vector(start_offset, "start_offset");
  const std::vector<int64_t> en = to_int64_vector(end_offset, "end_offset");
  const int64_t bs = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(st.size()) >= bs && static_cast<int64_t>(en.size()) >= bs,
              "start_offset/end_offset must have one entry per request");
  std::vector<int64_t> src_off(bs + 1, 0);
  for (int64_t i = 0; i < bs; ++i) {
    TORCH_CHECK(0 <= rows[i] && rows[i] < req_to_token.size(0), "req_pool_indices[", i, "] = ", rows[i],
                " out of range");
    TORCH_CHECK(0 <= st[i] && st[i] <= en[i] && en[i] <= pool_len, "request ", i, ": token range [", st[i], ", ", en[i],
                ") is not within [0, pool_len=", pool_len, "]");
    src_off[i + 1] = src_off[i] + (en[i] - st[i]);
  }
  TORCH_CHECK(src_off[bs] <= out_cache_loc.numel(), "out_cache_loc has ", out_cache_loc.numel(), " entries, need ",
              src_off[bs]);
  const at::Tensor src = out_cache_loc.reshape({-1});
  AT_DISPATCH_INTEGRAL_TYPES(req_to_token.scalar_type(), "assign_req_to_token_pool_cpu", [&] {
    using dst_t = scalar_t;
    const int64_t rs = req_to_token.stride(0), cs = req_to_token.stride(1);
    dst_t* dst = req_to_token.data_ptr<dst_t>();
    AT_DISPATCH_INTEGRAL_TYPES(src.scalar_type(), "assign_req_to_token_pool_cpu_src", [&] {
      const scalar_t* sp = src.data_ptr<scalar_t>();
      const int64_t ss = src.stride(0);
      for (int64_t i = 0; i < bs; ++i) {
        dst_t* row = dst + rows[i] * rs;
        for (int64_t t = st[i], j = src_off[i]; t < en[i]; ++t, ++j) row[t * cs] = static_cast<dst_t>(sp[j * ss]);
      }
    });
  });
}

// data_ptrs: [n_buf] uint64/int64 addresses of KV buffers (slot-major);
// data_strides: [n_buf] bytes per slot. For every buffer, the rows at
// src_loc are copied onto the rows at tgt_loc; all sources are read before
// any target is written, so overlapping src/tgt sets behave like upstream's
// tiled Triton kernel (kernels/ops/kvcache/cache_move.py). The addresses are
// trusted: nothing here can check them.
void copy_all_layer_kv_cache_cpu(const at::Tensor& data_ptrs, const at::Tensor& data_strides, const at::Tensor& tgt_loc,
                                 const at::Tensor& src_loc) {
  SGLK_CHECK_CPU(data_ptrs);
  SGLK_CHECK_CPU(data_strides);
  TORCH_CHECK(data_ptrs.element_size() == 8, "data_ptrs must hold 64-bit addresses, got ", data_ptrs.scalar_type());
  const at::Tensor ptrs = data_ptrs.contiguous();
  const std::vector<int64_t> strides = to_int64_vector(data_strides, "data_strides");
  const std::vector<int64_t> tgt = to_int64_vector(tgt_loc, "tgt_loc");
  const std::vector<int64_t> src = to_int64_vector(src_loc, "src_loc");
  TORCH_CHECK(tgt.size() == src.size(), "tgt_loc and src_loc must have the same length");
  const int64_t nbuf = ptrs.numel(), nloc = static_cast<int64_t>(src.size());
  TORCH_CHECK(static_cast<int64_t>(strides.size()) == nbuf, "data_strides must have one entry per buffer");
  if (nloc == 0 || nbuf == 0) return;
  const uint64_t* addr = static_cast<const uint64_t*>(ptrs.data_ptr());
  for (int64_t i = 0; i < nloc; ++i) TORCH_CHECK(src[i] >= 0 && tgt[i] >= 0, "negative KV slot index");
  at::parallel_for(0, nbuf, 1, [&](int64_t b0, int64_t b1) {
    std::vector<char> tmp;
    for (int64_t b = b0; b < b1; ++b) {
      char* base = reinterpret_cast<char*>(static_cast<uintptr_t>(addr[b]));
      const int64_t row = strides[b];
      tmp.resize(static_cast<size_t>(row * nloc));
      for (int64_t i = 0; i < nloc; ++i) std::memcpy(tmp.data() + i * row, base + src[i] * row, row);
      for (int64_t i = 0; i < nloc; ++i) std::memcpy(base + tgt[i] * row, tmp.data() + i * row, row);
    }
  });
}

namespace {
inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }
inline uint32_t murmur3_mix(uint32_t h, uint32_t k) {
  k *= 0xCC9E2D51u;
  k = rotl32(k, 15);
  k *= 0x1B873593u;
  h ^= k;
  h = rotl32(h, 13);
  return h * 5u + 0xE6546B64u;
}
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
}  // namespace

// MurmurHash3 (32-bit) of the 16-byte key (seed lo, seed hi, position, column)
// with hash seed 0, for every (row, column): out[n, m] uint32. Mirrors
// upstream's kernels/ops/sampling/murmur_hash.py (positions and columns are
// truncated to 32 bits there too).
at::Tensor murmur_hash32_cpu(const at::Tensor& seed, const at::Tensor& positions, const at::Tensor& col_indices) {
  SGLK_CHECK_CPU(seed);
  TORCH_CHECK(seed.dim() == 1 && positions.sizes() == seed.sizes() && col_indices.dim() == 1,
              "seed and positions must be 1-D of the same length and col_indices 1-D");
  TORCH_CHECK(seed.element_size() == 8 || !at::isFloatingType(seed.scalar_type()), "seed must be an integer tensor");
  const int64_t n = seed.size(0), m = col_indices.size(0);
  std::vector<uint64_t> sd(n);
  {
    at::Tensor s = seed.contiguous();
    if (s.element_size() == 8) {
      std::memcpy(sd.data(), s.data_ptr(), n * 8);
    } else {
      const std::vector<int64_t> v = to_int64_vector(s, "seed");
      for (int64_t i = 0; i < n; ++i) sd[i] = static_cast<uint64_t>(v[i]);
    }
  }
  const std::vector<int64_t> pos = to_int64_vector(positions, "positions");
  const std::vector<int64_t> col = to_int64_vector(col_indices, "col_indices");
  at::Tensor out = at::empty({n, m}, seed.options().dtype(at::kUInt32));
  uint32_t* o = static_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint32_t h = murmur3_mix(0u, static_cast<uint32_t>(sd[r] & 0xFFFFFFFFu));
      h = murmur3_mix(h, static_cast<uint32_t>(sd[r] >> 32));
      h = murmur3_mix(h, static_cast<uint32_t>(pos[r]));
      for (int64_t c = 0; c < m; ++c) o[r * m + c] = fmix32(murmur3_mix(h, static_cast<uint32_t>(col[c])) ^ 16u);
    }
  });
  return out;
}

}  // namespace sglk
