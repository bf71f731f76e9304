// Gated DeltaNet operators (Qwen3-Next style linear attention) for CPU.
//
//   fused_gdn_gating_cpu                       prefill gates g, beta
//   chunk_gated_delta_rule_cpu                 chunked prefill (FLA WY form)
//   fused_sigmoid_gating_delta_rule_update_cpu decode: gating + recurrent step
//
// Semantics follow upstream sglang's GPU kernels (file names relative to the
// sglang package): kernels/ops/attention/linear/fused_gdn_gating.py,
// kernels/ops/attention/fla/chunk.py (+ chunk_delta_h.py),
// kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py. The state
// pool layout is theirs: [num_slots, HV, V, K] (K contiguous), slot index per
// sequence, negative index = padding (zero initial state, no write-back).
#include <cmath>
#include <tuple>

#include "common.h"

namespace sglk {
namespace {

constexpr int64_t kChunk = 64;  // FLA / upstream CHUNK_SIZE
constexpr int64_t kMaxHeadDimK = 1024;

inline const char* elem_ptr(const at::Tensor& t, int64_t off) {
  return static_cast<const char*>(t.data_ptr()) + off * static_cast<int64_t>(t.element_size());
}
inline char* elem_ptr_mut(const at::Tensor& t, int64_t off) {
  return static_cast<char*>(t.data_ptr()) + off * static_cast<int64_t>(t.element_size());
}

// [B, T, H, D] activation with a contiguous last dim (copied if needed).
at::Tensor bthd(const at::Tensor& t, const char* name) {
  SGLK_CHECK_CPU(t);
  TORCH_CHECK(t.dim() == 4, name, " must be [B, T, H, D], got shape ", t.sizes());
  return t.stride(3) == 1 ? t : t.contiguous();
}

// Per-token, per-head tensor viewed as [B, T, HV] with a contiguous last dim.
at::Tensor bth(const at::Tensor& t, int64_t B, int64_t T, int64_t HV, const char* name) {
  SGLK_CHECK_CPU(t);
  at::Tensor r = t;
  if (r.dim() == 2) {
    TORCH_CHECK(r.size(0) == B * T && r.size(1) == HV, name, " must be [", B * T, ", ", HV, "] or [", B, ", ", T, ", ",
                HV, "], got ", t.sizes());
    r = r.unflatten(0, {B, T});
  }
  TORCH_CHECK(r.dim() == 3 && r.size(0) == B && r.size(1) == T && r.size(2) == HV, name, " must be [", B, ", ", T, ", ",
              HV, "], got ", t.sizes());
  if (r.stride(2) != 1) r = r.contiguous();
  return r;
}

void check_state_pool(const at::Tensor& s, int64_t HV, int64_t V, int64_t K, const char* name) {
  SGLK_CHECK_CPU(s);
  TORCH_CHECK(s.dim() == 4 && s.size(1) == HV && s.size(2) == V && s.size(3) == K, name, " must be [num_slots, ", HV,
              ", ", V, ", ", K, "] (HV, V, K), got ", s.sizes());
  TORCH_CHECK(s.stride(3) == 1 && s.stride(2) == K && s.stride(1) == V * K, name,
              " must be contiguous inside a slot ([HV, V, K] row-major), got strides ", s.strides());
  dt_of(s, name);
}

struct Seq {
  int64_t b;    // batch row
  int64_t t0;   // first token (within the batch row)
  int64_t len;  // tokens
};

std::vector<Seq> make_seqs(const c10::optional<at::Tensor>& cu_seqlens, int64_t B, int64_t T) {
  std::vector<Seq> seqs;
  if (cu_seqlens.has_value() && cu_seqlens->defined()) {
    TORCH_CHECK(B == 1, "with cu_seqlens the batch dim must be 1 (flattened varlen batch), got ", B);
    std::vector<int64_t> cu = to_int64_vector(*cu_seqlens, "cu_seqlens");
    TORCH_CHECK(cu.size() >= 1, "cu_seqlens must have at least one element");
    for (size_t i = 0; i + 1 < cu.size(); ++i) {
      TORCH_CHECK(0 <= cu[i] && cu[i] <= cu[i + 1] && cu[i + 1] <= T, "cu_seqlens must be non-decreasing within [0, ",
                  T, "], got ", cu[i], ", ", cu[i + 1], " at ", i);
      seqs.push_back({0, cu[i], cu[i + 1] - cu[i]});
    }
  } else {
    for (int64_t b = 0; b < B; ++b) seqs.push_back({b, 0, T});
  }
  return seqs;
}

// Output of shape [B, T, HV, V]; tokens not covered by any sequence are zero.
at::Tensor make_output(const std::vector<Seq>& seqs, int64_t B, int64_t T, int64_t HV, int64_t V,
                       const at::TensorOptions& opts) {
  int64_t covered = 0;
  for (const Seq& s : seqs) covered += s.len;
  return covered == B * T ? at::empty({B, T, HV, V}, opts) : at::zeros({B, T, HV, V}, opts);
}

std::vector<int64_t> slot_indices(const c10::optional<at::Tensor>& idx, size_t n, int64_t num_slots, const char* name) {
  std::vector<int64_t> v = to_int64_vector(*idx, name);
  TORCH_CHECK(v.size() >= n, name, " must have one entry per sequence (", n, "), got ", v.size());
  v.resize(n);
  for (int64_t s : v) TORCH_CHECK(s < num_slots, name, " entry ", s, " is out of range for ", num_slots, " slots");
  return v;
}

}  // namespace

// g = -exp(A_log) * softplus(a + dt_bias)  (softplus beta 1, threshold 20)
// beta = sigmoid(b)
// A_log, dt_bias: [H]; a, b: [batch, H] (rows may be strided).
// Returns g [1, batch, H] float32 and beta [1, batch, H] in b's dtype, like
// upstream's CPU op (the Triton version returns beta in float32).
std::tuple<at::Tensor, at::Tensor> fused_gdn_gating_cpu(const at::Tensor& A_log, const at::Tensor& a,
                                                        const at::Tensor& b, const at::Tensor& dt_bias) {
  SGLK_CHECK_CPU(A_log);
  SGLK_CHECK_CPU(a);
  SGLK_CHECK_CPU(b);
  SGLK_CHECK_CPU(dt_bias);
  TORCH_CHECK(a.dim() >= 1 && a.sizes() == b.sizes(), "a and b must have the same shape, got ", a.sizes(), " and ",
              b.sizes());
  const int64_t H = a.size(-1);
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == H, "A_log and dt_bias must have ", H, " elements");
  at::Tensor a2 = a.reshape({-1, H});
  at::Tensor b2 = b.reshape({-1, H});
  if (a2.stride(1) != 1) a2 = a2.contiguous();
  if (b2.stride(1) != 1) b2 = b2.contiguous();
  const int64_t rows = a2.size(0);
  at::Tensor Af = as_float_contig(A_log), dtf = as_float_contig(dt_bias);
  std::vector<float> negA(H);
  for (int64_t h = 0; h < H; ++h) negA[h] = -std::exp(Af.data_ptr<float>()[h]);
  const float* dtb = dtf.data_ptr<float>();

  at::Tensor g = at::empty({1, rows, H}, a.options().dtype(at::kFloat));
  at::Tensor beta = at::empty({1, rows, H}, b.options());
  float* gp = g.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a2.scalar_type(), "fused_gdn_gating_cpu_a", [&] {
    using a_t = scalar_t;
    const a_t* ap = a2.data_ptr<a_t>();
    const int64_t as = a2.stride(0);
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t h = 0; h < H; ++h) {
          const float x = static_cast<float>(ap[r * as + h]) + dtb[h];
          const float sp = x <= 20.0f ? std::log1p(std::exp(x)) : x;
          gp[r * H + h] = negA[h] * sp;
        }
    });
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, b2.scalar_type(), "fused_gdn_gating_cpu_b", [&] {
    const scalar_t* bp = b2.data_ptr<scalar_t>();
    scalar_t* op = beta.data_ptr<scalar_t>();
    const int64_t bs = b2.stride(0);
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t h = 0; h < H; ++h) {
          const float x = static_cast<float>(bp[r * bs + h]);
          op[r * H + h] = static_cast<scalar_t>(1.0f / (1.0f + std::exp(-x)));
        }
    });
  });
  return {g, beta};
}

// Chunked gated delta rule (prefill). See ops.py for the documented contract.
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_gated_delta_rule_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& g,
    const at::Tensor& beta, const c10::optional<at::Tensor>& initial_state, bool output_final_state,
    const c10::optional<at::Tensor>& cu_seqlens, bool head_first, bool use_qk_l2norm_in_kernel,
    const c10::optional<at::Tensor>& initial_state_indices, double eps, bool output_chunk_states,
    c10::optional<double> scale_opt, bool inplace_update, const c10::optional<at::Tensor>& state_emit_indices) {
  TORCH_CHECK(!head_first, "chunk_gated_delta_rule_cpu: head_first=True is not supported (deprecated upstream)");
  const at::Tensor q = bthd(query, "query"), k = bthd(key, "key"), v = bthd(value, "value");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes(), "key must have the shape of query ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.size(0) == B && v.size(1) == T, "value must be [", B, ", ", T, ", HV, V], got ", v.sizes());
  TORCH_CHECK(H > 0 && HV % H == 0, "num value heads (", HV, ") must be a multiple of num key heads (", H, ")");
  TORCH_CHECK(K <= kMaxHeadDimK, "key head dim ", K, " > ", kMaxHeadDimK, " is not supported");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "query, key and value must share a dtype");
  const DT io = dt_of(q, "query");
  const at::Tensor g3 = bth(g, B, T, HV, "g");
  const at::Tensor b3 = bth(beta, B, T, HV, "beta");
  const DT gdt = dt_of(g3, "g"), bdt = dt_of(b3, "beta");

  const std::vector<Seq> seqs = make_seqs(cu_seqlens, B, T);
  const int64_t N = static_cast<int64_t>(seqs.size());
  const bool varlen = cu_seqlens.has_value() && cu_seqlens->defined();

  const bool has_state = initial_state.has_value() && initial_state->defined();
  const bool has_idx = initial_state_indices.has_value() && initial_state_indices->defined();
  std::vector<int64_t> slots(N, -1);
  DT sdt = DT::F32;
  if (has_state) {
    check_state_pool(*initial_state, HV, V, K, "initial_state");
    sdt = dt_of(*initial_state, "initial_state");
    if (has_idx) {
      slots = slot_indices(initial_state_indices, N, initial_state->size(0), "initial_state_indices");
    } else {
      TORCH_CHECK(initial_state->size(0) == N, "initial_state must have one slot per sequence (", N,
                  ") when initial_state_indices is not given, got ", initial_state->size(0));
      for (int64_t i = 0; i < N; ++i) slots[i] = i;
    }
  } else {
    TORCH_CHECK(!has_idx, "initial_state_indices needs initial_state");
  }
  const bool write_back = has_state && has_idx && inplace_update;

  at::Tensor out = make_output(seqs, B, T, HV, V, q.options());
  at::Tensor final_state = output_final_state ? at::empty({N, HV, V, K}, q.options().dtype(at::kFloat))
                                              : at::empty({0}, q.options().dtype(at::kFloat));
  std::vector<int64_t> chunk_off(N + 1, 0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t nc = (seqs[i].len + kChunk - 1) / kChunk;
    chunk_off[i + 1] = varlen ? chunk_off[i] + nc : 0;
  }
  const int64_t NT = varlen ? chunk_off[N] : (T + kChunk - 1) / kChunk;
  at::Tensor h = output_chunk_states ? at::empty({B, NT, HV, V, K}, q.options()) : at::empty({0}, q.options());

  // Chunk-start states emitted into pool slots (anchor checkpoints inside the pass): one entry
  // per chunk, indexed like h; -1 = none.
  std::vector<int64_t> emit;
  const bool has_emit = state_emit_indices.has_value() && state_emit_indices->defined();
  if (has_emit) {
    TORCH_CHECK(has_state && has_idx, "state_emit_indices needs initial_state and initial_state_indices (the pool)");
    emit = to_int64_vector(*state_emit_indices, "state_emit_indices");
    const int64_t want = varlen ? NT : B * NT;
    TORCH_CHECK(static_cast<int64_t>(emit.size()) == want,
                "state_emit_indices must have one entry per 64-token chunk (", want, "), got ", emit.size());
    std::vector<char> used(initial_state->size(0), 0);
    for (int64_t sl : slots)
      if (sl >= 0) used[sl] = 1;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t nc = (seqs[i].len + kChunk - 1) / kChunk;
      const int64_t c0 = varlen ? chunk_off[i] : i * NT;
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t d = emit[c0 + c];
        if (d < 0) continue;
        TORCH_CHECK(c > 0, "state_emit_indices: chunk 0 of sequence ", i, " is its initial state; pass -1");
        TORCH_CHECK(slots[i] >= 0, "state_emit_indices: sequence ", i, " has no state slot (padding)");
        TORCH_CHECK(d < initial_state->size(0), "state_emit_indices entry ", d, " is out of range for ",
                    initial_state->size(0), " slots");
        TORCH_CHECK(!used[d], "state_emit_indices: slot ", d,
                    " is written twice (a sequence's own slot or another emitted state)");
        used[d] = 1;
      }
    }
  }

  const IsaKernels& kern = kernels();
  const int64_t ws_floats = chunk_gdn_workspace_floats(K, V, kChunk);
  const int64_t group = HV / H;
  const float scale = scale_opt.has_value() ? static_cast<float>(*scale_opt) : 1.0f / std::sqrt(static_cast<float>(K));

  at::parallel_for(0, N * HV, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> ws(ws_floats);
    std::vector<void*> emit_ptrs;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t n = w / HV, hv = w % HV, hk = hv / group;
      const Seq& s = seqs[n];
      ChunkGdnArgs a{};
      a.emit = nullptr;
      if (has_emit) {
        const int64_t nc = (s.len + kChunk - 1) / kChunk;
        const int64_t c0 = varlen ? chunk_off[n] : n * NT;
        emit_ptrs.assign(nc, nullptr);
        bool any = false;
        for (int64_t c = 1; c < nc; ++c) {
          const int64_t d = emit[c0 + c];
          if (d < 0) continue;
          emit_ptrs[c] = elem_ptr_mut(*initial_state, d * initial_state->stride(0) + hv * V * K);
          any = true;
        }
        if (any) a.emit = emit_ptrs.data();
      }
      a.len = s.len;
      a.K = K;
      a.V = V;
      a.chunk = kChunk;
      a.scale = scale;
      a.l2_eps = static_cast<float>(eps);
      a.l2norm = use_qk_l2norm_in_kernel;
      a.io_dt = io;
      a.q = elem_ptr(q, s.b * q.stride(0) + s.t0 * q.stride(1) + hk * q.stride(2));
      a.q_ts = q.stride(1);
      a.k = elem_ptr(k, s.b * k.stride(0) + s.t0 * k.stride(1) + hk * k.stride(2));
      a.k_ts = k.stride(1);
      a.v = elem_ptr(v, s.b * v.stride(0) + s.t0 * v.stride(1) + hv * v.stride(2));
      a.v_ts = v.stride(1);
      a.out = elem_ptr_mut(out, s.b * out.stride(0) + s.t0 * out.stride(1) + hv * out.stride(2));
      a.out_ts = out.stride(1);
      a.g_dt = gdt;
      a.g = elem_ptr(g3, s.b * g3.stride(0) + s.t0 * g3.stride(1) + hv);
      a.g_ts = g3.stride(1);
      a.beta_dt = bdt;
      a.beta = elem_ptr(b3, s.b * b3.stride(0) + s.t0 * b3.stride(1) + hv);
      a.beta_ts = b3.stride(1);
      a.state_dt = sdt;
      a.state = nullptr;
      if (has_state && slots[n] >= 0) {
        a.state = elem_ptr_mut(*initial_state, slots[n] * initial_state->stride(0) + hv * V * K);
        a.load_state = 1;
        a.store_state = write_back;
      }
      a.final_state = output_final_state ? final_state.data_ptr<float>() + (n * HV + hv) * V * K : nullptr;
      a.h = nullptr;
      if (output_chunk_states) {
        const int64_t c0 = varlen ? chunk_off[n] : 0;
        a.h = elem_ptr_mut(h, s.b * h.stride(0) + c0 * h.stride(1) + hv * V * K);
        a.h_cs = h.stride(1);
      }
      kern.chunk_gdn(a, ws.data());
    }
  });
  return {out, final_state, h};
}

// Decode step(s): gating fused with the recurrent gated delta rule, updating
// the state pool in place. See ops.py for the documented contract.
at::Tensor fused_sigmoid_gating_delta_rule_update_cpu(
    const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& initial_state_source,
    const at::Tensor& initial_state_indices, const c10::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm_in_kernel,
    double softplus_beta, double softplus_threshold) {
  const at::Tensor q = bthd(q_in, "q"), k = bthd(k_in, "k"), v = bthd(v_in, "v");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have the shape of q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.size(0) == B && v.size(1) == T, "v must be [", B, ", ", T, ", HV, V], got ", v.sizes());
  TORCH_CHECK(H > 0 && HV % H == 0, "num value heads (", HV, ") must be a multiple of num key heads (", H, ")");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(softplus_beta > 0, "softplus_beta must be positive");
  const DT io = dt_of(q, "q");
  const at::Tensor a3 = bth(a_in, B, T, HV, "a");
  const at::Tensor b3 = bth(b_in, B, T, HV, "b");
  const DT adt = dt_of(a3, "a"), bdt = dt_of(b3, "b");
  TORCH_CHECK(A_log.numel() == HV && dt_bias.numel() == HV, "A_log and dt_bias must have ", HV,
              " elements (per value head)");
  const at::Tensor Af = as_float_contig(A_log), dtf = as_float_contig(dt_bias);

  check_state_pool(initial_state_source, HV, V, K, "initial_state_source");
  const DT sdt = dt_of(initial_state_source, "initial_state_source");
  const std::vector<Seq> seqs = make_seqs(cu_seqlens, B, T);
  const int64_t N = static_cast<int64_t>(seqs.size());
  const c10::optional<at::Tensor> idx_opt(initial_state_indices);
  const std::vector<int64_t> slots = slot_indices(idx_opt, N, initial_state_source.size(0), "initial_state_indices");

  at::Tensor out = make_output(seqs, B, T, HV, V, q.options());
  int64_t tmax = 0;
  for (const Seq& s : seqs) tmax = std::max(tmax, s.len);

  const IsaKernels& kern = kernels();
  const int64_t ws_floats = recurrent_gdn_workspace_floats(tmax, K, V);
  const int64_t group = HV / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));

  at::parallel_for(0, N * HV, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> ws(ws_floats);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t n = w / HV, hv = w % HV, hk = hv / group;
      const Seq& s = seqs[n];
      if (s.len == 0) continue;
      RecurrentGdnArgs a{};
      a.T = s.len;
      a.K = K;
      a.V = V;
      a.scale = scale;
      a.l2_eps = 1e-6f;
      a.l2norm = use_qk_l2norm_in_kernel;
      a.io_dt = io;
      a.q = elem_ptr(q, s.b * q.stride(0) + s.t0 * q.stride(1) + hk * q.stride(2));
      a.q_ts = q.stride(1);
      a.k = elem_ptr(k, s.b * k.stride(0) + s.t0 * k.stride(1) + hk * k.stride(2));
      a.k_ts = k.stride(1);
      a.v = elem_ptr(v, s.b * v.stride(0) + s.t0 * v.stride(1) + hv * v.stride(2));
      a.v_ts = v.stride(1);
      a.out = elem_ptr_mut(out, s.b * out.stride(0) + s.t0 * out.stride(1) + hv * out.stride(2));
      a.out_ts = out.stride(1);
      a.A_log = Af.data_ptr<float>()[hv];
      a.dt_bias = dtf.data_ptr<float>()[hv];
      a.softplus_beta = static_cast<float>(softplus_beta);
      a.softplus_threshold = static_cast<float>(softplus_threshold);
      a.a_dt = adt;
      a.a = elem_ptr(a3, s.b * a3.stride(0) + s.t0 * a3.stride(1) + hv);
      a.a_ts = a3.stride(1);
      a.b_dt = bdt;
      a.b = elem_ptr(b3, s.b * b3.stride(0) + s.t0 * b3.stride(1) + hv);
      a.b_ts = b3.stride(1);
      a.state_dt = sdt;
      a.state = nullptr;
      if (slots[n] >= 0) {
        a.state = elem_ptr_mut(initial_state_source, slots[n] * initial_state_source.stride(0) + hv * V * K);
        a.load_state = 1;
        a.store_state = 1;
      }
      kern.recurrent_gdn(a, ws.data());
    }
  });
  return out;
}

}  // namespace sglk
