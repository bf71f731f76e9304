// Plain-data interface between the torch-facing operators (compiled for the
// baseline x86-64 ISA) and the SIMD kernels (compiled once per ISA level: the
// units of isa_units.h).
//
// Rules that keep the per-ISA translation units safe to link together:
//  * this header holds only POD structs, enums and `static` helpers (internal
//    linkage), never a non-static inline function: an inline function compiled
//    with AVX-512 enabled could otherwise be picked by the linker for a caller
//    on an AVX2-only machine;
//  * the ISA translation units include no torch and no STL header.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace sglk {

// Element types the kernels read and write. bf16 is handled as raw uint16_t
// bits (round-to-nearest-even on store, NaN kept quiet), like c10::BFloat16.
enum class DT : int32_t { F32 = 0, BF16 = 1 };

// One (sequence, value-head) work item of the chunked gated delta rule.
// Pointers are already offset to token 0 of the sequence and to the head;
// *_ts are token strides in elements; the last dimension is contiguous.
struct ChunkGdnArgs {
  int64_t len;     // tokens in this sequence
  int64_t K;       // key head dim
  int64_t V;       // value head dim
  int64_t chunk;   // chunk size BT (64 like FLA)
  float scale;     // query scale (K ** -0.5)
  float l2_eps;    // eps of the q/k L2 norm: x / sqrt(sum(x^2) + eps)
  int32_t l2norm;  // apply the q/k L2 norm

  DT io_dt;  // dtype of q, k, v, out and h
  const void* q;
  int64_t q_ts;
  const void* k;
  int64_t k_ts;
  const void* v;
  int64_t v_ts;
  void* out;
  int64_t out_ts;

  DT g_dt;  // log-space decay g: [len] with stride g_ts
  const void* g;
  int64_t g_ts;
  DT beta_dt;  // beta: [len] with stride beta_ts
  const void* beta;
  int64_t beta_ts;

  DT state_dt;  // recurrent state slot, [V][K] (K contiguous), may be null
  void* state;
  int32_t load_state;   // start from *state (else from zeros)
  int32_t store_state;  // write the final state back to *state
  float* final_state;   // optional [V][K] fp32 copy of the final state
  void* h;              // optional chunk-start states, io_dt, [n_chunks][V][K]
  int64_t h_cs;         // stride between chunks of h, in elements
  // Optional [n_chunks] destinations of the chunk-start states in state_dt ([V][K] each,
  // rounded once like the final write-back); a null entry (and entry 0) is skipped.
  void* const* emit;
};

// One (sequence, value-head) work item of the fused sigmoid-gating recurrent
// (token-by-token) gated delta rule.
struct RecurrentGdnArgs {
  int64_t T;  // tokens of this sequence
  int64_t K;
  int64_t V;
  float scale;
  float l2_eps;
  int32_t l2norm;

  DT io_dt;  // q, k, v, out
  const void* q;
  int64_t q_ts;
  const void* k;
  int64_t k_ts;
  const void* v;
  int64_t v_ts;
  void* out;
  int64_t out_ts;

  // gating: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
  float A_log;
  float dt_bias;
  float softplus_beta;
  float softplus_threshold;
  DT a_dt;
  const void* a;
  int64_t a_ts;
  DT b_dt;
  const void* b;
  int64_t b_ts;

  DT state_dt;  // [V][K], may be null
  void* state;
  int32_t load_state;
  int32_t store_state;
};

// One (sequence, channel block) work item of the depthwise causal conv1d.
// Activations are channel-last: element (c, t) of x is x[t * x_ts + c].
struct Conv1dArgs {
  int64_t len;  // tokens
  int64_t c0;   // channel block [c0, c1)
  int64_t c1;
  int64_t width;  // kernel width W; the conv state keeps W - 1 columns
  int64_t dim;
  DT x_dt;  // dtype of x and out
  const void* x;
  int64_t x_ts;
  void* out;
  int64_t out_ts;
  const float* wT;    // [W][dim] fp32 (transposed weight)
  const float* bias;  // [dim] fp32 or null
  int32_t silu;
  DT st_dt;     // conv state of this sequence's slot, or null
  void* state;  // element (c, i) at state[c * st_cs + i * st_ts]
  int64_t st_cs;
  int64_t st_ts;
  int32_t load_state;   // prior tokens come from the state (else zeros)
  int32_t store_state;  // write the last W - 1 inputs back to the state
};

// Rows [r0, r1) of y = rmsnorm(x) * weight * silu(z).
struct RmsNormGatedArgs {
  int64_t n;  // hidden size of one row
  DT x_dt;    // x and out
  const void* x;
  int64_t x_rs;
  DT z_dt;
  const void* z;  // may be null (no gate)
  int64_t z_rs;
  const float* weight;  // [n] fp32
  float eps;
  void* out;
  int64_t out_rs;
};

// Rows [r0, r1) of x *= sigmoid(gate), gate viewed as [rows][heads][head_dim].
struct SigmoidMulArgs {
  int64_t heads;
  int64_t head_dim;
  DT x_dt;
  void* x;
  int64_t x_rs;
  DT g_dt;
  const void* gate;
  int64_t g_rs;
  int64_t g_hs;
};

// Table of the kernels of one ISA level.
struct IsaKernels {
  const char* name;
  void (*chunk_gdn)(const ChunkGdnArgs& a, float* ws);
  void (*recurrent_gdn)(const RecurrentGdnArgs& a, float* ws);
  void (*conv1d)(const Conv1dArgs& a, float* ws);
  void (*rmsnorm_gated)(const RmsNormGatedArgs& a, int64_t r0, int64_t r1);
  void (*sigmoid_mul)(const SigmoidMulArgs& a, int64_t r0, int64_t r1);
};

// Workspace sizes (in floats) the kernels above expect. Vectors are padded by
// 16 floats so the kernels may round row lengths up to a vector multiple.
static inline int64_t sglk_pad16(int64_t n) { return (n + 15) / 16 * 16; }

static inline int64_t chunk_gdn_workspace_floats(int64_t K, int64_t V, int64_t chunk) {
  const int64_t L = sglk_pad16(chunk), Kp = sglk_pad16(K), Vp = sglk_pad16(V);
  // Qs, Kn, KbG, W: L x K | KnT, KdT: K x L | Vb/U, WS, O: L x V | S: K x V
  // KK/T, A: L x L | G, Gamma, beta, tmp: L
  return 4 * L * Kp + 2 * Kp * L + 3 * L * Vp + Kp * Vp + 2 * L * L + 4 * L + 64;
}

static inline int64_t recurrent_gdn_workspace_floats(int64_t T, int64_t K, int64_t V) {
  return 2 * T * sglk_pad16(K) + sglk_pad16(K) + 2 * T + 64 + 0 * V;
}

static inline int64_t conv1d_workspace_floats(int64_t width, int64_t c0, int64_t c1) {
  return (width + 1) * sglk_pad16(c1 - c0) + 64;
}

}  // namespace sglk
