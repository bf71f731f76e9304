// SIMD kernels of the general CPU ops, compiled once per ISA level: the units
// of family `kernels` in isa_units.h, each generated from isa_unit.h, which
// defines
//   SGLK_ISA_LEVEL  0 | 1 | 2
//   SGLK_ISA_NAME   "scalar" | "avx2" | "avx512"
// and switches the target ISA before including this file. Everything below has
// internal linkage; isa_unit.h exports sglk::kTable through a getter defined
// after it restores the baseline ISA. No torch/STL header is used (see
// kernel_args.h for why).
//
// Formulas:
//  * gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks:
//    Improving Mamba2 with Delta Rule", arXiv:2412.06464), per head with state
//    S in R^{K x V}:  S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);
//    S <- S + k_t u_t^T;  o_t = S^T (scale * q_t), with q, k L2-normalised
//    (eps 1e-6) when requested. This mirrors upstream's Triton kernels
//    sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py
//    (token by token) and sglang/kernels/ops/attention/fla/chunk*.py (chunked,
//    FLA "WY"/UT form, chunk size 64), and transformers'
//    torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule.
//  * depthwise causal conv1d with a (W-1)-column rolling state, as
//    sglang/kernels/ops/mamba/causal_conv1d_triton.py.

#include "kernel_args.h"

namespace sglk {
namespace {

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#include "vec.h"

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

// ---------------------------------------------------------------- scalar I/O
static inline float ld(DT dt, const void* p, int64_t i) {
  return dt == DT::F32 ? static_cast<const float*>(p)[i] : bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}
static inline void st(DT dt, void* p, int64_t i, float x) {
  if (dt == DT::F32)
    static_cast<float*>(p)[i] = x;
  else
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
}

static inline vf vld(const float* p) { return v_load(p); }
static inline vf vld(const uint16_t* p) { return v_load_bf16(p); }
static inline void vst(float* p, vf x) { v_store(p, x); }
static inline void vst(uint16_t* p, vf x) { v_store_bf16(p, x); }
static inline float sld(const float* p) { return *p; }
static inline float sld(const uint16_t* p) { return bf16_to_f32(*p); }
static inline void sst(float* p, float x) { *p = x; }
static inline void sst(uint16_t* p, float x) { *p = f32_to_bf16(x); }

template <typename T>
static inline void load_row_t(const T* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) v_store(d + i, vld(s + i));
  for (; i < n; ++i) d[i] = sld(s + i);
}
template <typename T>
static inline void store_row_t(T* d, const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) vst(d + i, v_load(s + i));
  for (; i < n; ++i) sst(d + i, s[i]);
}
static inline void load_row(DT dt, const void* p, float* d, int64_t n) {
  if (dt == DT::F32)
    load_row_t(static_cast<const float*>(p), d, n);
  else
    load_row_t(static_cast<const uint16_t*>(p), d, n);
}
static inline void store_row(DT dt, void* p, const float* s, int64_t n) {
  if (dt == DT::F32)
    store_row_t(static_cast<float*>(p), s, n);
  else
    store_row_t(static_cast<uint16_t*>(p), s, n);
}
static inline const void* offset(DT dt, const void* p, int64_t i) {
  return dt == DT::F32 ? static_cast<const void*>(static_cast<const float*>(p) + i)
                       : static_cast<const void*>(static_cast<const uint16_t*>(p) + i);
}
static inline void* offset(DT dt, void* p, int64_t i) {
  return dt == DT::F32 ? static_cast<void*>(static_cast<float*>(p) + i)
                       : static_cast<void*>(static_cast<uint16_t*>(p) + i);
}

// ------------------------------------------------------------- vector helpers
static inline void fill(float* d, float x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = x;
}
static inline float dot(const float* a, const float* b, int64_t n) {
  vf acc0 = v_zero(), acc1 = v_zero();
  int64_t i = 0;
  for (; i + 2 * VW <= n; i += 2 * VW) {
    acc0 = v_fma(v_load(a + i), v_load(b + i), acc0);
    acc1 = v_fma(v_load(a + i + VW), v_load(b + i + VW), acc1);
  }
  for (; i + VW <= n; i += VW) acc0 = v_fma(v_load(a + i), v_load(b + i), acc0);
  float s = v_hsum(v_add(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
static inline void scale_row(float* d, float x, int64_t n) {
  const vf vx = v_set1(x);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) v_store(d + i, v_mul(v_load(d + i), vx));
  for (; i < n; ++i) d[i] *= x;
}
// d += x * s
static inline void axpy(float* d, float x, const float* s, int64_t n) {
  const vf vx = v_set1(x);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) v_store(d + i, v_fma(vx, v_load(s + i), v_load(d + i)));
  for (; i < n; ++i) d[i] += x * s[i];
}
// q / sqrt(sum(q^2) + eps), the FLA / transformers l2norm
static inline void l2normalize(float* d, int64_t n, float eps) {
  const float ss = dot(d, d, n);
  scale_row(d, 1.0f / __builtin_sqrtf(ss + eps), n);
}

// ----------------------------------------------------------------------- GEMM
// C[M][N] (+)= A[M][P] * B[P][N], all row-major fp32 with leading dims.
// With a_lower, A is lower triangular (A[i][p] == 0 for p > i, stored as
// zeros) and only p < i + 1 is visited, rounded up to the row tile.
static constexpr int MR = 4;
static constexpr int NV = VW == 8 ? 2 : 4;

template <int R, int NC, bool ACC>
static inline __attribute__((always_inline)) void gemm_tile(int64_t P, const float* A, int64_t lda, const float* B,
                                                            int64_t ldb, float* C, int64_t ldc) {
  vf acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = ACC ? v_load(C + r * ldc + c * VW) : v_zero();
  for (int64_t p = 0; p < P; ++p) {
    vf b[NC];
    for (int c = 0; c < NC; ++c) b[c] = v_load(B + p * ldb + c * VW);
    for (int r = 0; r < R; ++r) {
      const vf a = v_set1(A[r * lda + p]);
      for (int c = 0; c < NC; ++c) acc[r][c] = v_fma(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) v_store(C + r * ldc + c * VW, acc[r][c]);
}

template <int NC, bool ACC>
static inline void gemm_cols(int64_t M, int64_t P, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                             int64_t ldc, bool a_lower) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    const int64_t pl = a_lower ? imin(P, i + MR) : P;
    gemm_tile<MR, NC, ACC>(pl, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  }
  for (; i < M; ++i) {
    const int64_t pl = a_lower ? imin(P, i + 1) : P;
    gemm_tile<1, NC, ACC>(pl, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  }
}

template <bool ACC>
static void gemm(int64_t M, int64_t N, int64_t P, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool a_lower) {
  int64_t j = 0;
  for (; j + NV * VW <= N; j += NV * VW) gemm_cols<NV, ACC>(M, P, A, lda, B + j, ldb, C + j, ldc, a_lower);
  for (; j + VW <= N; j += VW) gemm_cols<1, ACC>(M, P, A, lda, B + j, ldb, C + j, ldc, a_lower);
  for (; j < N; ++j) {
    for (int64_t i = 0; i < M; ++i) {
      const int64_t pl = a_lower ? imin(P, i + 1) : P;
      float s = ACC ? C[i * ldc + j] : 0.0f;
      for (int64_t p = 0; p < pl; ++p) s += A[i * lda + p] * B[p * ldb + j];
      C[i * ldc + j] = s;
    }
  }
}

// -------------------------------------------------- chunked gated delta rule
// See the header comment for the recurrence. Within a chunk of L tokens
// starting from state S0 (K x V), with G_i = sum_{j<=i} g_j, Gam_i = exp(G_i):
//   M[i][j]  = beta_i exp(G_i - G_j) k_i.k_j          (j < i)
//   T        = (I + M)^-1                             (forward substitution)
//   u        = T (beta v) - T (beta Gam k) S0          (the delta-rule "new values")
//   o_i      = Gam_i q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j
//   S_L      = Gam_{L-1} S0 + sum_j exp(G_{L-1} - G_j) k_j u_j^T
// which is the UT-transform form of FLA's chunk_gated_delta_rule and of
// transformers' torch_chunk_gated_delta_rule.
static void chunk_gdn(const ChunkGdnArgs& a, float* ws) {
  const int64_t K = a.K, V = a.V, BT = a.chunk;
  const int64_t L = pad16(BT), Kp = pad16(K), Vp = pad16(V);
  float* Qs = ws;             // [BT][Kp] normalised, scaled queries
  float* Kn = Qs + L * Kp;    // [BT][Kp] normalised keys
  float* KbG = Kn + L * Kp;   // [BT][Kp] -beta_j Gam_j k_j
  float* Wm = KbG + L * Kp;   // [BT][Kp] T @ KbG
  float* KnT = Wm + L * Kp;   // [K][L]
  float* KdT = KnT + Kp * L;  // [K][L] exp(G_last - G_j) k_j, transposed
  float* Ub = KdT + Kp * L;   // [BT][Vp] beta_j v_j
  float* Ob = Ub + L * Vp;    // [BT][Vp] output accumulator
  float* Un = Ob + L * Vp;    // [BT][Vp] u (new values)
  float* S = Un + L * Vp;     // [K][Vp] running state, fp32
  float* Tm = S + Kp * Vp;    // [BT][L] k.k, then T
  float* Am = Tm + L * L;     // [BT][L] decayed causal q.k
  float* G = Am + L * L;      // [L]
  float* Gam = G + L;         // [L]
  float* bt = Gam + L;        // [L]
  float* tmp = bt + L;        // [L]

  const bool has_state = a.state != nullptr;
  bool state_zero = true;
  for (int64_t kk = 0; kk < K; ++kk) fill(S + kk * Vp, 0.0f, Vp);
  // Un (L x Vp floats) doubles as a scratch row of length K or L before it
  // holds u: L * Vp >= 64 * 16 >= max(K, L), as gdn.cpp rejects K > 1024.
  if (has_state && a.load_state) {
    for (int64_t vv = 0; vv < V; ++vv) {
      load_row(a.state_dt, offset(a.state_dt, a.state, vv * K), Un, K);
      for (int64_t kk = 0; kk < K; ++kk) S[kk * Vp + vv] = Un[kk];
    }
    state_zero = false;
  }

  const int64_t n_chunks = (a.len + BT - 1) / BT;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t t0 = c * BT;
    const int64_t Lc = imin(BT, a.len - t0);

    if (a.emit != nullptr && c > 0 && a.emit[c] != nullptr) {  // the state after t0 tokens
      for (int64_t vv = 0; vv < V; ++vv) {
        for (int64_t kk = 0; kk < K; ++kk) Un[kk] = S[kk * Vp + vv];
        store_row(a.state_dt, offset(a.state_dt, a.emit[c], vv * K), Un, K);
      }
    }
    if (a.h != nullptr) {  // state at the start of this chunk, [V][K]
      void* hc = offset(a.io_dt, a.h, c * a.h_cs);
      for (int64_t vv = 0; vv < V; ++vv) {
        for (int64_t kk = 0; kk < K; ++kk) Un[kk] = S[kk * Vp + vv];
        store_row(a.io_dt, offset(a.io_dt, hc, vv * K), Un, K);
      }
    }

    // 1. inputs of the chunk
    float gsum = 0.0f;
    for (int64_t i = 0; i < Lc; ++i) {
      const int64_t t = t0 + i;
      load_row(a.io_dt, offset(a.io_dt, a.q, t * a.q_ts), Qs + i * Kp, K);
      load_row(a.io_dt, offset(a.io_dt, a.k, t * a.k_ts), Kn + i * Kp, K);
      load_row(a.io_dt, offset(a.io_dt, a.v, t * a.v_ts), Ub + i * Vp, V);
      if (a.l2norm) {
        l2normalize(Qs + i * Kp, K, a.l2_eps);
        l2normalize(Kn + i * Kp, K, a.l2_eps);
      }
      scale_row(Qs + i * Kp, a.scale, K);
      gsum += ld(a.g_dt, a.g, t * a.g_ts);
      G[i] = gsum;
      bt[i] = ld(a.beta_dt, a.beta, t * a.beta_ts);
    }
    for (int64_t i = Lc; i < L; ++i) {
      G[i] = gsum;
      bt[i] = 0.0f;
    }
    for (int64_t i = 0; i < L; ++i) Gam[i] = __builtin_expf(G[i]);
    const float g_last = G[Lc - 1];

    // 2. K^T and the two L x L products
    for (int64_t kk = 0; kk < K; ++kk) {
      float* row = KnT + kk * L;
      for (int64_t i = 0; i < Lc; ++i) row[i] = Kn[i * Kp + kk];
      for (int64_t i = Lc; i < L; ++i) row[i] = 0.0f;
    }
    gemm<false>(Lc, Lc, K, Kn, Kp, KnT, L, Tm, L, false);
    gemm<false>(Lc, Lc, K, Qs, Kp, KnT, L, Am, L, false);

    // 3. causal decay mask on q.k; T = (I + M)^-1 row by row
    for (int64_t i = 0; i < Lc; ++i) {
      float* arow = Am + i * L;
      float* krow = Tm + i * L;
      const vf gi = v_set1(G[i]);
      int64_t j = 0;
      for (; j + VW <= i + 1; j += VW) {
        const vf d = v_exp(v_sub(gi, v_load(G + j)));
        v_store(arow + j, v_mul(v_load(arow + j), d));
        v_store(tmp + j, d);
      }
      for (; j <= i; ++j) {
        const float d = __builtin_expf(G[i] - G[j]);
        arow[j] *= d;
        tmp[j] = d;
      }
      for (j = i + 1; j < L; ++j) arow[j] = 0.0f;

      // row i of T: e_i - sum_{m<i} M[i][m] T[m][:]
      const float bi = bt[i];
      for (int64_t m = 0; m < i; ++m) tmp[m] = -bi * tmp[m] * krow[m];  // -M[i][m]
      float* trow = Un;                                                 // scratch row of length L
      fill(trow, 0.0f, L);
      for (int64_t m = 0; m < i; ++m) axpy(trow, tmp[m], Tm + m * L, imin(L, (m / VW + 1) * VW));
      for (j = 0; j < i; ++j) krow[j] = trow[j];
      krow[i] = 1.0f;
      for (j = i + 1; j < L; ++j) krow[j] = 0.0f;
    }

    // 4. beta-scaled keys (negated, with decay from the chunk start) and values
    for (int64_t j = 0; j < Lc; ++j) {
      const float* kr = Kn + j * Kp;
      float* kb = KbG + j * Kp;
      const float f = -bt[j] * Gam[j];
      for (int64_t kk = 0; kk < K; ++kk) kb[kk] = f * kr[kk];
      scale_row(Ub + j * Vp, bt[j], V);
    }

    // 5. u = T (beta v) + T (-beta Gam k) S0
    gemm<false>(Lc, V, Lc, Tm, L, Ub, Vp, Un, Vp, true);
    if (!state_zero) {
      gemm<false>(Lc, K, Lc, Tm, L, KbG, Kp, Wm, Kp, true);
      gemm<true>(Lc, V, K, Wm, Kp, S, Vp, Un, Vp, false);
    }

    // 6. o = Gam * (q S0) + A u
    if (!state_zero) {
      gemm<false>(Lc, V, K, Qs, Kp, S, Vp, Ob, Vp, false);
      for (int64_t i = 0; i < Lc; ++i) scale_row(Ob + i * Vp, Gam[i], V);
      gemm<true>(Lc, V, Lc, Am, L, Un, Vp, Ob, Vp, true);
    } else {
      gemm<false>(Lc, V, Lc, Am, L, Un, Vp, Ob, Vp, true);
    }
    for (int64_t i = 0; i < Lc; ++i) store_row(a.io_dt, offset(a.io_dt, a.out, (t0 + i) * a.out_ts), Ob + i * Vp, V);

    // 7. S = Gam_last S0 + sum_j exp(G_last - G_j) k_j u_j^T
    for (int64_t j = 0; j < Lc; ++j) tmp[j] = __builtin_expf(g_last - G[j]);
    for (int64_t kk = 0; kk < K; ++kk) {
      float* row = KdT + kk * L;
      for (int64_t j = 0; j < Lc; ++j) row[j] = KnT[kk * L + j] * tmp[j];
    }
    if (state_zero) {
      gemm<false>(K, V, Lc, KdT, L, Un, Vp, S, Vp, false);
    } else {
      const float gl = __builtin_expf(g_last);
      for (int64_t kk = 0; kk < K; ++kk) scale_row(S + kk * Vp, gl, V);
      gemm<true>(K, V, Lc, KdT, L, Un, Vp, S, Vp, false);
    }
    state_zero = false;
  }

  if ((has_state && a.store_state) || a.final_state != nullptr) {
    for (int64_t vv = 0; vv < V; ++vv) {
      for (int64_t kk = 0; kk < K; ++kk) Un[kk] = S[kk * Vp + vv];
      if (has_state && a.store_state) store_row(a.state_dt, offset(a.state_dt, a.state, vv * K), Un, K);
      if (a.final_state != nullptr)
        for (int64_t kk = 0; kk < K; ++kk) a.final_state[vv * K + kk] = Un[kk];
    }
  }
}

// ----------------------------------------- recurrent (decode) gated delta rule
// Token by token, one state row (fixed v) at a time: every row of S evolves
// independently given (q_t, k_t, g_t, beta_t, v_t[v]), so each row is loaded
// once, advanced over all tokens, and stored once.
static void recurrent_gdn(const RecurrentGdnArgs& a, float* ws) {
  const int64_t T = a.T, K = a.K, V = a.V, Kp = pad16(K);
  float* qn = ws;            // [T][Kp]
  float* kn = qn + T * Kp;   // [T][Kp]
  float* row = kn + T * Kp;  // [Kp]
  float* dec = row + Kp;     // [T] exp(g_t)
  float* bet = dec + T;      // [T] beta_t

  const float A = __builtin_expf(a.A_log);
  for (int64_t t = 0; t < T; ++t) {
    load_row(a.io_dt, offset(a.io_dt, a.q, t * a.q_ts), qn + t * Kp, K);
    load_row(a.io_dt, offset(a.io_dt, a.k, t * a.k_ts), kn + t * Kp, K);
    if (a.l2norm) {
      l2normalize(qn + t * Kp, K, a.l2_eps);
      l2normalize(kn + t * Kp, K, a.l2_eps);
    }
    scale_row(qn + t * Kp, a.scale, K);
    // softplus with beta / threshold as torch.nn.functional.softplus
    const float x = ld(a.a_dt, a.a, t * a.a_ts) + a.dt_bias;
    const float bx = a.softplus_beta * x;
    const float sp = bx <= a.softplus_threshold ? __builtin_log1pf(__builtin_expf(bx)) / a.softplus_beta : x;
    dec[t] = __builtin_expf(-A * sp);
    bet[t] = 1.0f / (1.0f + __builtin_expf(-ld(a.b_dt, a.b, t * a.b_ts)));
  }

  const bool has_state = a.state != nullptr;
  for (int64_t vv = 0; vv < V; ++vv) {
    if (has_state && a.load_state)
      load_row(a.state_dt, offset(a.state_dt, a.state, vv * K), row, K);
    else
      fill(row, 0.0f, K);
    for (int64_t t = 0; t < T; ++t) {
      const float* kt = kn + t * Kp;
      const float* qt = qn + t * Kp;
      // pass 1: decay and read the memory at k_t
      const vf d = v_set1(dec[t]);
      vf acc = v_zero();
      int64_t i = 0;
      for (; i + VW <= K; i += VW) {
        const vf r = v_mul(v_load(row + i), d);
        v_store(row + i, r);
        acc = v_fma(r, v_load(kt + i), acc);
      }
      float kv = v_hsum(acc);
      for (; i < K; ++i) {
        row[i] *= dec[t];
        kv += row[i] * kt[i];
      }
      // pass 2: delta update and read-out at q_t
      const float delta = (ld(a.io_dt, a.v, t * a.v_ts + vv) - kv) * bet[t];
      const vf dv = v_set1(delta);
      acc = v_zero();
      for (i = 0; i + VW <= K; i += VW) {
        const vf r = v_fma(dv, v_load(kt + i), v_load(row + i));
        v_store(row + i, r);
        acc = v_fma(r, v_load(qt + i), acc);
      }
      float o = v_hsum(acc);
      for (; i < K; ++i) {
        row[i] += delta * kt[i];
        o += row[i] * qt[i];
      }
      st(a.io_dt, a.out, t * a.out_ts + vv, o);
    }
    if (has_state && a.store_state) store_row(a.state_dt, offset(a.state_dt, a.state, vv * K), row, K);
  }
}

// ------------------------------------------------------------ causal conv1d
// out[t][c] = act(bias[c] + sum_{w<W} weight[c][w] * win[t + w][c]) where
// win = (W-1 prior columns: the conv state, or zeros) ++ x; afterwards the
// state holds the last W-1 columns of win.
template <typename XT>
static void conv1d_t(const Conv1dArgs& a, float* ws) {
  const int64_t W = a.width, SL = W - 1, c0 = a.c0, cb = a.c1 - a.c0, cbp = pad16(cb);
  const XT* x = static_cast<const XT*>(a.x);
  XT* out = static_cast<XT*>(a.out);
  float* prior = ws;  // [SL][cbp]
  const bool has_state = a.state != nullptr;

  for (int64_t i = 0; i < SL; ++i) {
    float* pr = prior + i * cbp;
    if (has_state && a.load_state) {
      for (int64_t c = 0; c < cb; ++c) pr[c] = ld(a.st_dt, a.state, (c0 + c) * a.st_cs + i * a.st_ts);
    } else {
      fill(pr, 0.0f, cb);
    }
  }

  const vf one = v_set1(1.0f);
  for (int64_t t = 0; t < a.len; ++t) {
    int64_t c = 0;
    for (; c + VW <= cb; c += VW) {
      vf s = a.bias != nullptr ? v_load(a.bias + c0 + c) : v_zero();
      for (int64_t w = 0; w < W; ++w) {
        const int64_t idx = t + w - SL;
        const vf xv = idx < 0 ? v_load(prior + (SL + idx) * cbp + c) : vld(x + idx * a.x_ts + c0 + c);
        s = v_fma(v_load(a.wT + w * a.dim + c0 + c), xv, s);
      }
      if (a.silu) s = v_div(s, v_add(one, v_exp(v_sub(v_zero(), s))));
      vst(out + t * a.out_ts + c0 + c, s);
    }
    for (; c < cb; ++c) {
      float s = a.bias != nullptr ? a.bias[c0 + c] : 0.0f;
      for (int64_t w = 0; w < W; ++w) {
        const int64_t idx = t + w - SL;
        const float xv = idx < 0 ? prior[(SL + idx) * cbp + c] : sld(x + idx * a.x_ts + c0 + c);
        s += a.wT[w * a.dim + c0 + c] * xv;
      }
      if (a.silu) s = s / (1.0f + __builtin_expf(-s));
      sst(out + t * a.out_ts + c0 + c, s);
    }
  }

  if (has_state && a.store_state) {
    for (int64_t i = 0; i < SL; ++i) {
      const int64_t src = a.len + i;  // index into win
      for (int64_t c = 0; c < cb; ++c) {
        const float val = src < SL ? prior[src * cbp + c] : sld(x + (src - SL) * a.x_ts + c0 + c);
        st(a.st_dt, a.state, (c0 + c) * a.st_cs + i * a.st_ts, val);
      }
    }
  }
}

static void conv1d(const Conv1dArgs& a, float* ws) {
  if (a.x_dt == DT::F32)
    conv1d_t<float>(a, ws);
  else
    conv1d_t<uint16_t>(a, ws);
}

// ------------------------------------------------------ gated RMSNorm (swish)
// y = x * rsqrt(mean(x^2) + eps) * weight * silu(z), in fp32, as the
// norm_before_gate / is_rms_norm path of upstream's
// sglang/kernels/ops/attention/fla/layernorm_gated.py.
template <typename XT, typename ZT>
static void rmsnorm_gated_t(const RmsNormGatedArgs& a, int64_t r0, int64_t r1) {
  const int64_t n = a.n;
  const vf one = v_set1(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const XT* x = static_cast<const XT*>(a.x) + r * a.x_rs;
    const ZT* z = a.z != nullptr ? static_cast<const ZT*>(a.z) + r * a.z_rs : nullptr;
    XT* y = static_cast<XT*>(a.out) + r * a.out_rs;
    vf acc = v_zero();
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
      const vf xv = vld(x + i);
      acc = v_fma(xv, xv, acc);
    }
    float ss = v_hsum(acc);
    for (; i < n; ++i) {
      const float xv = sld(x + i);
      ss += xv * xv;
    }
    const float rstd = 1.0f / __builtin_sqrtf(ss / static_cast<float>(n) + a.eps);
    const vf vr = v_set1(rstd);
    for (i = 0; i + VW <= n; i += VW) {
      vf yv = v_mul(v_mul(vld(x + i), vr), v_load(a.weight + i));
      if (z != nullptr) {
        const vf zv = vld(z + i);
        yv = v_mul(yv, v_div(zv, v_add(one, v_exp(v_sub(v_zero(), zv)))));
      }
      vst(y + i, yv);
    }
    for (; i < n; ++i) {
      float yv = sld(x + i) * rstd * a.weight[i];
      if (z != nullptr) {
        const float zv = sld(z + i);
        yv *= zv / (1.0f + __builtin_expf(-zv));
      }
      sst(y + i, yv);
    }
  }
}

static void rmsnorm_gated(const RmsNormGatedArgs& a, int64_t r0, int64_t r1) {
  const bool zf = a.z == nullptr || a.z_dt == DT::F32;
  if (a.x_dt == DT::F32) {
    if (zf)
      rmsnorm_gated_t<float, float>(a, r0, r1);
    else
      rmsnorm_gated_t<float, uint16_t>(a, r0, r1);
  } else {
    if (zf)
      rmsnorm_gated_t<uint16_t, float>(a, r0, r1);
    else
      rmsnorm_gated_t<uint16_t, uint16_t>(a, r0, r1);
  }
}

// ------------------------------------------------------ x *= sigmoid(gate)
template <typename XT, typename GT>
static void sigmoid_mul_t(const SigmoidMulArgs& a, int64_t r0, int64_t r1) {
  const int64_t D = a.head_dim;
  const vf one = v_set1(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t h = 0; h < a.heads; ++h) {
      XT* x = static_cast<XT*>(a.x) + r * a.x_rs + h * D;
      const GT* g = static_cast<const GT*>(a.gate) + r * a.g_rs + h * a.g_hs;
      int64_t i = 0;
      for (; i + VW <= D; i += VW) {
        const vf s = v_div(one, v_add(one, v_exp(v_sub(v_zero(), vld(g + i)))));
        vst(x + i, v_mul(vld(x + i), s));
      }
      for (; i < D; ++i) sst(x + i, sld(x + i) / (1.0f + __builtin_expf(-sld(g + i))));
    }
  }
}

static void sigmoid_mul(const SigmoidMulArgs& a, int64_t r0, int64_t r1) {
  if (a.x_dt == DT::F32) {
    if (a.g_dt == DT::F32)
      sigmoid_mul_t<float, float>(a, r0, r1);
    else
      sigmoid_mul_t<float, uint16_t>(a, r0, r1);
  } else {
    if (a.g_dt == DT::F32)
      sigmoid_mul_t<uint16_t, float>(a, r0, r1);
    else
      sigmoid_mul_t<uint16_t, uint16_t>(a, r0, r1);
  }
}

static const IsaKernels kTable = {
    SGLK_ISA_NAME, &chunk_gdn, &recurrent_gdn, &conv1d, &rmsnorm_gated, &sigmoid_mul,
};

}  // namespace
}  // namespace sglk
