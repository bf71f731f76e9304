// Depthwise causal conv1d with a rolling per-slot conv state (Mamba / GDN).
//
//   causal_conv1d_fwd_cpu     prefill: varlen batch, optional initial states
//   causal_conv1d_update_cpu  decode: 1..n new tokens per sequence
//
// Semantics follow upstream sglang's kernels/ops/mamba/causal_conv1d_triton.py
// (causal_conv1d_fn / causal_conv1d_update, non-speculative paths): the conv
// state of a slot is conv_states[slot, :, :W-1] (any strides), oldest column
// first; a cache index equal to pad_slot_id skips the sequence (its output is
// zero here, left unwritten by Triton).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"

namespace sglk {
namespace {

constexpr int64_t kChannelBlock = 256;

inline const char* elem_ptr(const at::Tensor& t, int64_t off) {
  return static_cast<const char*>(t.data_ptr()) + off * static_cast<int64_t>(t.element_size());
}
inline char* elem_ptr_mut(const at::Tensor& t, int64_t off) {
  return static_cast<char*>(t.data_ptr()) + off * static_cast<int64_t>(t.element_size());
}

struct ConvWeights {
  at::Tensor wT;    // [W][dim] fp32
  at::Tensor bias;  // [dim] fp32 or undefined
  int64_t width;
};

ConvWeights prepare_weights(const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t dim) {
  SGLK_CHECK_CPU(weight);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == dim, "weight must be [dim=", dim,
              ", width] (plain depthwise weight; packed weights are not supported), got ", weight.sizes());
  const int64_t width = weight.size(1);
  TORCH_CHECK(width >= 1 && width <= 16, "conv width must be in [1, 16], got ", width);
  ConvWeights w;
  w.wT = weight.to(at::kFloat).t().contiguous();
  w.width = width;
  if (bias.has_value() && bias->defined()) {
    SGLK_CHECK_CPU(*bias);
    TORCH_CHECK(bias->numel() == dim, "bias must have ", dim, " elements, got ", bias->sizes());
    w.bias = as_float_contig(*bias);
  }
  return w;
}

void check_conv_states(const at::Tensor& s, int64_t dim, int64_t width, const char* name) {
  SGLK_CHECK_CPU(s);
  TORCH_CHECK(s.dim() == 3 && s.size(1) == dim && s.size(2) >= width - 1, name, " must be [num_slots, dim=", dim,
              ", >= ", width - 1, "], got ", s.sizes());
  dt_of(s, name);
}

struct ConvSeq {
  const char* x;  // token 0, channel 0
  int64_t x_ts;
  char* out;
  int64_t out_ts;
  int64_t len;
  int64_t slot;  // -1: no state
  bool load_state;
  bool skip;  // padded entry: output zeros, state untouched
};

void run_conv(const std::vector<ConvSeq>& seqs, const ConvWeights& w, int64_t dim, DT xdt, bool silu,
              const at::Tensor* states) {
  const IsaKernels& kern = kernels();
  const int64_t nblk = (dim + kChannelBlock - 1) / kChannelBlock;
  const int64_t n = static_cast<int64_t>(seqs.size());
  const DT sdt = states != nullptr ? dt_of(*states, "conv_states") : DT::F32;
  at::parallel_for(0, n * nblk, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> ws(conv1d_workspace_floats(w.width, 0, kChannelBlock));
    for (int64_t it = w0; it < w1; ++it) {
      const ConvSeq& s = seqs[it / nblk];
      const int64_t c0 = (it % nblk) * kChannelBlock;
      const int64_t c1 = std::min(dim, c0 + kChannelBlock);
      if (s.skip) {
        const int64_t esz = xdt == DT::F32 ? 4 : 2;
        for (int64_t t = 0; t < s.len; ++t) std::memset(s.out + (t * s.out_ts + c0) * esz, 0, (c1 - c0) * esz);
        continue;
      }
      Conv1dArgs a{};
      a.len = s.len;
      a.c0 = c0;
      a.c1 = c1;
      a.width = w.width;
      a.dim = dim;
      a.x_dt = xdt;
      a.x = s.x;
      a.x_ts = s.x_ts;
      a.out = s.out;
      a.out_ts = s.out_ts;
      a.wT = w.wT.data_ptr<float>();
      a.bias = w.bias.defined() ? w.bias.data_ptr<float>() : nullptr;
      a.silu = silu;
      a.state = nullptr;
      if (states != nullptr && s.slot >= 0) {
        a.st_dt = sdt;
        a.state = elem_ptr_mut(*states, s.slot * states->stride(0));
        a.st_cs = states->stride(1);
        a.st_ts = states->stride(2);
        a.load_state = s.load_state;
        a.store_state = 1;
      }
      kern.conv1d(a, ws.data());
    }
  });
}

}  // namespace

// Prefill. x: (dim, total_tokens) varlen batch (channel-last view of a
// (total_tokens, dim) tensor, like upstream) or (batch, dim, seqlen).
// Returns a tensor of x's shape whose memory is token-major (channel-last).
at::Tensor causal_conv1d_fwd_cpu(const at::Tensor& x_in, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& conv_states,
                                 const c10::optional<at::Tensor>& query_start_loc,
                                 const c10::optional<at::Tensor>& cache_indices,
                                 const c10::optional<at::Tensor>& has_initial_state, bool silu_activation,
                                 int64_t pad_slot_id) {
  SGLK_CHECK_CPU(x_in);
  TORCH_CHECK(x_in.dim() == 2 || x_in.dim() == 3, "x must be (dim, total_tokens) or (batch, dim, seqlen), got ",
              x_in.sizes());
  const DT xdt = dt_of(x_in, "x");
  const bool batched = x_in.dim() == 3;
  const int64_t dim = x_in.size(-2), L = x_in.size(-1), Bx = batched ? x_in.size(0) : 1;
  // channel-last: element (c, t) at c + t * x_ts
  at::Tensor x = x_in;
  if (x.stride(-2) != 1 && x.size(-2) > 1) x = x_in.transpose(-1, -2).contiguous().transpose(-1, -2);
  const ConvWeights w = prepare_weights(weight, bias, dim);
  const at::Tensor* states = nullptr;
  if (conv_states.has_value() && conv_states->defined()) {
    check_conv_states(*conv_states, dim, w.width, "conv_states");
    states = &*conv_states;
  }

  at::Tensor out =
      batched ? at::empty({Bx, L, dim}, x_in.options()).transpose(1, 2) : at::empty({L, dim}, x_in.options()).t();

  // sequences
  std::vector<int64_t> starts;
  if (batched) {
    TORCH_CHECK(!(query_start_loc.has_value() && query_start_loc->defined()),
                "query_start_loc is only supported with 2-D x (dim, total_tokens)");
    for (int64_t b = 0; b <= Bx; ++b) starts.push_back(b * L);
  } else if (query_start_loc.has_value() && query_start_loc->defined()) {
    starts = to_int64_vector(*query_start_loc, "query_start_loc");
    TORCH_CHECK(!starts.empty(), "query_start_loc must not be empty");
  } else {
    starts = {0, L};
  }
  const int64_t n = static_cast<int64_t>(starts.size()) - 1;
  std::vector<int64_t> idx;
  if (cache_indices.has_value() && cache_indices->defined()) {
    idx = to_int64_vector(*cache_indices, "cache_indices");
    TORCH_CHECK(static_cast<int64_t>(idx.size()) >= n, "cache_indices must have one entry per sequence (", n, ")");
  }
  std::vector<int64_t> has_init;
  if (has_initial_state.has_value() && has_initial_state->defined()) {
    has_init = to_int64_vector(has_initial_state->to(at::kLong), "has_initial_state");
    TORCH_CHECK(static_cast<int64_t>(has_init.size()) >= n, "has_initial_state must have one entry per sequence (", n,
                ")");
  }

  std::vector<ConvSeq> seqs;
  int64_t covered = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s0 = starts[i], s1 = starts[i + 1];
    TORCH_CHECK(0 <= s0 && s0 <= s1 && s1 <= Bx * L, "query_start_loc must be non-decreasing within [0, ", L, "]");
    ConvSeq s{};
    const int64_t b = batched ? i : 0, t0 = batched ? 0 : s0;
    s.x = elem_ptr(x, b * (batched ? x.stride(0) : 0) + t0 * x.stride(-1));
    s.x_ts = x.stride(-1);
    s.out = elem_ptr_mut(out, b * (batched ? out.stride(0) : 0) + t0 * out.stride(-1));
    s.out_ts = out.stride(-1);
    s.len = s1 - s0;
    covered += s.len;
    s.slot = -1;
    s.skip = false;
    if (states != nullptr) {
      const int64_t slot = idx.empty() ? i : idx[i];
      if (slot == pad_slot_id) {
        s.skip = true;
      } else {
        TORCH_CHECK(0 <= slot && slot < states->size(0), "cache index ", slot, " out of range for ", states->size(0),
                    " conv state slots");
        s.slot = slot;
        s.load_state = has_init.empty() ? false : has_init[i] != 0;
      }
    } else if (!idx.empty() && idx[i] == pad_slot_id) {
      s.skip = true;
    }
    seqs.push_back(s);
  }
  if (covered != Bx * L) out.zero_();
  run_conv(seqs, w, dim, xdt, silu_activation, states);
  return out;
}

// Decode. x: (batch, dim) or (batch, dim, seqlen); conv_state: (num_slots,
// dim, >= W-1) updated in place. Returns a tensor of x's shape.
at::Tensor causal_conv1d_update_cpu(const at::Tensor& x_in, const at::Tensor& conv_state, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& bias, bool silu_activation,
                                    const c10::optional<at::Tensor>& cache_seqlens,
                                    const c10::optional<at::Tensor>& conv_state_indices, int64_t pad_slot_id) {
  SGLK_CHECK_CPU(x_in);
  TORCH_CHECK(!(cache_seqlens.has_value() && cache_seqlens->defined()),
              "causal_conv1d_update_cpu: cache_seqlens (circular conv state) is not supported");
  TORCH_CHECK(x_in.dim() == 2 || x_in.dim() == 3, "x must be (batch, dim) or (batch, dim, seqlen), got ", x_in.sizes());
  const DT xdt = dt_of(x_in, "x");
  const bool two_d = x_in.dim() == 2;
  at::Tensor x3 = two_d ? x_in.unsqueeze(-1) : x_in;
  const int64_t Bx = x3.size(0), dim = x3.size(1), L = x3.size(2);
  if (x3.stride(1) != 1) x3 = x3.transpose(1, 2).contiguous().transpose(1, 2);
  const ConvWeights w = prepare_weights(weight, bias, dim);
  check_conv_states(conv_state, dim, w.width, "conv_state");

  at::Tensor out3 = at::empty({Bx, L, dim}, x_in.options()).transpose(1, 2);
  std::vector<int64_t> idx;
  if (conv_state_indices.has_value() && conv_state_indices->defined()) {
    idx = to_int64_vector(*conv_state_indices, "conv_state_indices");
    TORCH_CHECK(static_cast<int64_t>(idx.size()) >= Bx, "conv_state_indices must have one entry per sequence (", Bx,
                ")");
  }
  std::vector<ConvSeq> seqs;
  for (int64_t b = 0; b < Bx; ++b) {
    ConvSeq s{};
    s.x = elem_ptr(x3, b * x3.stride(0));
    s.x_ts = x3.stride(2);
    s.out = elem_ptr_mut(out3, b * out3.stride(0));
    s.out_ts = out3.stride(2);
    s.len = L;
    const int64_t slot = idx.empty() ? b : idx[b];
    s.skip = slot == pad_slot_id;
    s.slot = -1;
    if (!s.skip) {
      TORCH_CHECK(0 <= slot && slot < conv_state.size(0), "conv state index ", slot, " out of range for ",
                  conv_state.size(0), " slots");
      s.slot = slot;
      s.load_state = true;
    }
    seqs.push_back(s);
  }
  run_conv(seqs, w, dim, xdt, silu_activation, &conv_state);
  return two_d ? out3.squeeze(-1) : out3;
}

}  // namespace sglk
