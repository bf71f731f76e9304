// Extend (prefill) attention on the CPU: flash attention over bf16 queries, keys and values,
// fp32 softmax and accumulation, in one of two ISA paths:
//   avx512bf16   AVX-512 BF16 dot products (vdpbf16ps), P rounded to bf16 before P V;
//   avx2         AVX2 + FMA fp32 products (bf16 operands widened in registers), P kept fp32;
//                also taken on AVX-512 CPUs without BF16 (level "avx512").
// The path follows the selected kernel level (dispatch.cpp: SGLANG_CPU_KERNEL_ISA, set_cpu_isa);
// the scalar level has neither and the Python side keeps ATen's flash kernel there.
//
//   extend_attention_cpu(q, k, v, out, q_pos0, scale, causal, kv_index=None)
//
// One request's new rows against all the keys they can see, the torch_native backend's extend
// step (python/sglang/srt/layers/attention/torch_native_extend.py calls it). It replaces two
// calls of ATen's CPU flash kernel plus their log-sum-exp merge, which run at ~25 GFLOP/s here:
// the agent replays' long prefixes (100-176K tokens) spend most of their prefill in it.
// With kv_index, k / v are a KV pool ([slots, kv_heads, dim]) and key j is its row kv_index[j]:
// the decode step (torch_native_decode.py) reads a request's keys in place instead of gathering
// them into new tensors first (two copies per layer and step, ~2 KB per key here).
//
// Algorithm: FlashAttention-2's online softmax (Dao, 2023, Algorithm 1), per (query head, block
// of query rows), over key blocks of kKeyBlock keys. Keys and values are first repacked once per
// KV head into the operand layout of vdpbf16ps (pairs of bf16 in one 32-bit lane):
//   K: [block][D/2][kKeyBlock] pairs (k[j][2p], k[j][2p+1])   -> S = Q K^T, one key per lane
//   V: [block][kKeyBlock/2][D] pairs (v[2t][d], v[2t+1][d])   -> O += P V, one dim per lane
// so the two products are register-blocked outer products without horizontal sums. The AVX2
// path reads the same packs: a lane's high bf16 is its fp32 value with the low half masked off,
// the low bf16 is the lane shifted left by 16, so each pair load gives two fp32 operand vectors
// in one integer op each (no shuffles).
// Calls of at most kDecodeMaxRows (4) query rows (decode) skip the repack: decode_attention.cpp
// reads K / V where they lie, in (row, KV head, key chunk) items merged per row and head.
// Causal masking (bottom-right aligned: row i sees keys [0, q_pos0 + i]) is applied only in the
// key blocks a query block's diagonal crosses; blocks past the diagonal are skipped.
//
// Each path is compiled under its own target pragma and entered only when the selected level
// (hence the CPU) has it: extend_attention_cpu_supported().
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "decode_attention.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own _mm512_undefined_* helpers inside the reduce intrinsics (as isa_unit.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace sglk {
namespace {

constexpr int kKeyBlock = 64;    // keys per block: 4 vectors of 16 scores
constexpr int kQueryBlock = 64;  // query rows per work item
constexpr int kRowTile = 4;      // query rows per S microkernel call

// The path the selected kernel level takes (dispatch.cpp), or kNone at the scalar level.
enum class Path { kNone, kAvx2, kAvx512Bf16 };

Path selected_path() {
  const std::string isa = current_isa();
  if (isa == "avx512bf16") return Path::kAvx512Bf16;
  if (isa == "avx512" || isa == "avx2") return Path::kAvx2;
  return Path::kNone;
}

bool head_dim_supported(int64_t d) { return d == 64 || d == 128 || d == 256; }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
struct ItemArgs {
  const uint16_t* q;  // row 0 of this head: q + row * q_row_stride
  int64_t q_row_stride;
  uint16_t* out;  // same layout as q
  int64_t out_row_stride;
  const uint32_t* kp;  // this KV head's packed keys / values
  const uint32_t* vp;
  int64_t rows;    // query rows of the request
  int64_t keys;    // visible key count (all of them for non-causal)
  int64_t q_pos0;  // position of query row 0 (causal)
  bool causal;
  float scale;  // softmax scale
};

// One path's attend_rows: query rows [r_begin, r_end) of one head.
using AttendRows = void (*)(const ItemArgs&, int64_t, int64_t);

// Every (head, block of kQueryBlock query rows) item on the OpenMP pool. Later query blocks see
// more keys (causal): they are taken first, dynamically, for balance.
void run_items(const std::vector<ItemArgs>& heads, int64_t rows, AttendRows attend) {
  const int64_t nqb = (rows + kQueryBlock - 1) / kQueryBlock;
  const int64_t items = int64_t(heads.size()) * nqb;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t it = 0; it < items; ++it) {
    const int64_t qb = nqb - 1 - it / int64_t(heads.size());
    const int64_t h = it % int64_t(heads.size());
    attend(heads[size_t(h)], qb * kQueryBlock, std::min(rows, (qb + 1) * kQueryBlock));
  }
}

}  // namespace
}  // namespace sglk

// Packing (both paths) and the AVX2 path, with the executor's AVX2 fp32 helpers (vec.h level 1).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace sglk {
namespace {
namespace avx2 {
#define SGLK_ISA_LEVEL 1
#include "isa/vec.h"
#undef SGLK_ISA_LEVEL
}  // namespace avx2

// Two bf16 values (raw bits) in one 32-bit lane, low half first (vdpbf16ps's pair order).
inline uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// Repack one KV head's keys into [nblk][D/2][kKeyBlock] pairs and values into
// [nblk][kKeyBlock/2][D] pairs; keys past `keys` are zero. Key j is row j of k / v, or row idx[j]
// when idx is given (the KV pool's slots of a request, read in place).
void pack_kv_head(const uint16_t* k, const uint16_t* v, int64_t k_row_stride, int64_t v_row_stride, int64_t keys,
                  int64_t d, int64_t blk, uint32_t* kp, uint32_t* vp, const int64_t* idx) {
  const int64_t j0 = blk * kKeyBlock;
  const int64_t n = std::min<int64_t>(kKeyBlock, keys - j0);
  uint32_t* kb = kp + blk * (d / 2) * kKeyBlock;
  uint32_t* vb = vp + blk * (kKeyBlock / 2) * d;
  if (n < kKeyBlock) {
    std::memset(kb, 0, sizeof(uint32_t) * (d / 2) * kKeyBlock);
    std::memset(vb, 0, sizeof(uint32_t) * (kKeyBlock / 2) * d);
  }
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* kr = k + (idx != nullptr ? idx[j0 + j] : j0 + j) * k_row_stride;
    for (int64_t p = 0; p < d / 2; ++p) kb[p * kKeyBlock + j] = pair(kr[2 * p], kr[2 * p + 1]);
  }
  for (int64_t t = 0; t < (n + 1) / 2; ++t) {
    const int64_t j = j0 + 2 * t;
    const uint16_t* v0 = v + (idx != nullptr ? idx[j] : j) * v_row_stride;
    const bool has1 = 2 * t + 1 < n;
    const uint16_t* v1 = has1 ? v + (idx != nullptr ? idx[j + 1] : j + 1) * v_row_stride : nullptr;
    for (int64_t c = 0; c < d; ++c) vb[t * d + c] = pair(v0[c], has1 ? v1[c] : uint16_t(0));
  }
}

namespace avx2 {

// The two fp32 operand vectors of 8 packed bf16 pairs: lanes' low halves, then high halves.
inline __m256 pair_lo(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
inline __m256 pair_hi(__m256i x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536))); }

inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

constexpr int kRowTile = 2;  // query rows per microkernel call: 8 accumulators + 4 broadcasts
constexpr int kVecs = 4;     // 8-lane vectors per microkernel call (32 keys or 32 dims)

// One step of both products: acc[r][c] += a[r][0] * lo(pairs[c]) + a[r][1] * hi(pairs[c]) for NR
// rows (row r's two fp32 operands at a + r * a_stride) and kVecs vectors of 8 packed pairs.
template <int NR>
inline void pair_step(const float* a, int a_stride, const uint32_t* pairs, __m256 (&acc)[NR][kVecs]) {
  __m256 al[NR], ah[NR];
  for (int r = 0; r < NR; ++r) {
    al[r] = _mm256_broadcast_ss(a + r * a_stride);
    ah[r] = _mm256_broadcast_ss(a + r * a_stride + 1);
  }
  for (int c = 0; c < kVecs; ++c) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 8 * c));
    const __m256 lo = pair_lo(x), hi = pair_hi(x);
    for (int r = 0; r < NR; ++r) {
      acc[r][c] = _mm256_fmadd_ps(al[r], lo, acc[r][c]);
      acc[r][c] = _mm256_fmadd_ps(ah[r], hi, acc[r][c]);
    }
  }
}

// S[r][0..63] = q_r . k_j for NR rows (q: [rows][D] fp32, already scaled).
template <int D, int NR>
inline void qk_tile(const float* q, const uint32_t* kb, float* s) {
  for (int h = 0; h < kKeyBlock; h += 8 * kVecs) {
    __m256 acc[NR][kVecs];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int p = 0; p < D / 2; ++p) pair_step<NR>(q + 2 * p, D, kb + p * kKeyBlock + h, acc);
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kVecs; ++c) _mm256_storeu_ps(s + r * kKeyBlock + h + 8 * c, acc[r][c]);
  }
}

// O[r][0..D) += sum_j P[r][j] V[j] for NR rows (P: [rows][kKeyBlock] fp32).
template <int D, int NR>
inline void pv_tile(const float* pf, const uint32_t* vb, float* o) {
  for (int d0 = 0; d0 < D; d0 += 8 * kVecs) {
    __m256 acc[NR][kVecs];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm256_loadu_ps(o + r * D + d0 + 8 * c);
    for (int t = 0; t < kKeyBlock / 2; ++t) pair_step<NR>(pf + 2 * t, kKeyBlock, vb + t * D + d0, acc);
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kVecs; ++c) _mm256_storeu_ps(o + r * D + d0 + 8 * c, acc[r][c]);
  }
}

// One work item: query rows [r_begin, r_end) of one head (the AVX-512 path's attend_rows with
// fp32 operands; the softmax scale is folded into q).
template <int D>
void attend_rows(const ItemArgs& a, int64_t r_begin, int64_t r_end) {
  const int rows = int(r_end - r_begin);
  alignas(64) float qf[kQueryBlock * D];
  alignas(64) float s[kQueryBlock * kKeyBlock];
  alignas(64) float o[kQueryBlock * D];
  float m[kQueryBlock];
  __m256 lsum[kQueryBlock];
  const __m256 vscale = _mm256_set1_ps(a.scale);
  for (int r = 0; r < rows; ++r) {
    const uint16_t* qr = a.q + (r_begin + r) * a.q_row_stride;
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(qf + r * D + c, _mm256_mul_ps(v_load_bf16(qr + c), vscale));
    m[r] = -std::numeric_limits<float>::infinity();
    lsum[r] = _mm256_setzero_ps();
  }
  std::memset(o, 0, sizeof(float) * rows * D);

  const int64_t key_end = a.causal ? std::min(a.keys, a.q_pos0 + r_end) : a.keys;
  const int64_t nblk = (key_end + kKeyBlock - 1) / kKeyBlock;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  constexpr int kBlockVecs = kKeyBlock / 8;

  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t j0 = b * kKeyBlock;
    const uint32_t* kb = a.kp + b * (D / 2) * kKeyBlock;
    const uint32_t* vb = a.vp + b * (kKeyBlock / 2) * D;
    int r0 = 0;
    for (; r0 + kRowTile <= rows; r0 += kRowTile) qk_tile<D, kRowTile>(qf + r0 * D, kb, s + r0 * kKeyBlock);
    for (; r0 < rows; ++r0) qk_tile<D, 1>(qf + r0 * D, kb, s + r0 * kKeyBlock);
    const int64_t first_limit = a.causal ? std::min(a.keys, a.q_pos0 + r_begin + 1) : a.keys;
    const bool masked = j0 + kKeyBlock > first_limit;
    for (int r = 0; r < rows; ++r) {
      float* sr = s + r * kKeyBlock;  // scores in, then P (fp32) out
      const int64_t limit = a.causal ? std::min(a.keys, a.q_pos0 + r_begin + r + 1) : a.keys;
      __m256 x[kBlockVecs], keep[kBlockVecs];
      __m256 mx = ninf;
      for (int c = 0; c < kBlockVecs; ++c) {
        x[c] = _mm256_loadu_ps(sr + 8 * c);
        if (masked) {
          const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(int32_t(j0 + 8 * c)));
          keep[c] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(limit)), key));
          x[c] = _mm256_blendv_ps(ninf, x[c], keep[c]);
        }
        mx = _mm256_max_ps(mx, x[c]);
      }
      // Finite: every row sees key 0 (as in the AVX-512 path).
      const float m_new = std::max(m[r], hmax(mx));
      const float alpha = std::exp(m[r] - m_new);
      const __m256 vm = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int c = 0; c < kBlockVecs; ++c) {
        __m256 p = v_exp(_mm256_sub_ps(x[c], vm));
        if (masked) p = _mm256_and_ps(p, keep[c]);  // v_exp clamps: masked keys need an exact 0
        sum = _mm256_add_ps(sum, p);
        _mm256_storeu_ps(sr + 8 * c, p);
      }
      lsum[r] = _mm256_fmadd_ps(lsum[r], _mm256_set1_ps(alpha), sum);
      m[r] = m_new;
      if (alpha != 1.0f) {
        const __m256 va = _mm256_set1_ps(alpha);
        float* orow = o + r * D;
        for (int c = 0; c < D; c += 8) _mm256_storeu_ps(orow + c, _mm256_mul_ps(_mm256_loadu_ps(orow + c), va));
      }
    }
    r0 = 0;
    for (; r0 + kRowTile <= rows; r0 += kRowTile) pv_tile<D, kRowTile>(s + r0 * kKeyBlock, vb, o + r0 * D);
    for (; r0 < rows; ++r0) pv_tile<D, 1>(s + r0 * kKeyBlock, vb, o + r0 * D);
  }
  for (int r = 0; r < rows; ++r) {
    const float l = v_hsum(lsum[r]);
    const __m256 vi = _mm256_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
    uint16_t* dst = a.out + (r_begin + r) * a.out_row_stride;
    for (int c = 0; c < D; c += 8) v_store_bf16(dst + c, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + c), vi));
  }
}

}  // namespace avx2
}  // namespace
}  // namespace sglk
#pragma GCC pop_options

// The executor's AVX-512 fp32 helpers (v_exp: the Cephes expf polynomial), compiled for this
// kernel's target as the ISA units compile them (isa_unit.h).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace sglk {
namespace {
#define SGLK_ISA_LEVEL 2
#include "isa/vec.h"
#undef SGLK_ISA_LEVEL

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// S[r][0..63] = q_r . k_j over D/2 pairs for kRowTile rows (q pairs: [rows][D/2]).
template <int D, int NR>
inline void qk_tile(const uint32_t* q, const uint32_t* kb, float* s) {
  constexpr int rows = NR;
  __m512 acc[kRowTile][4];
  for (int r = 0; r < kRowTile; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const uint32_t* kr = kb + p * kKeyBlock;
    const __m512i k0 = _mm512_loadu_si512(kr), k1 = _mm512_loadu_si512(kr + 16);
    const __m512i k2 = _mm512_loadu_si512(kr + 32), k3 = _mm512_loadu_si512(kr + 48);
    for (int r = 0; r < kRowTile; ++r) {
      if (r >= NR) break;
      const __m512i qb = _mm512_set1_epi32(int(q[r * (D / 2) + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], as_bh(qb), as_bh(k0));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], as_bh(qb), as_bh(k1));
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], as_bh(qb), as_bh(k2));
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], as_bh(qb), as_bh(k3));
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeyBlock + 16 * c, acc[r][c]);
}

// O[r][0..D) += sum_t P pair(r, t) . V pair(t) for `rows` rows (P pairs: [rows][kKeyBlock/2]).
template <int D>
inline void pv_tile(const uint32_t* pp, int rows, const uint32_t* vb, float* o) {
  constexpr int kVec = D / 16;
  constexpr int kRows = 256 / D;  // 16 accumulators: 4 rows at D=64, 2 at 128, 1 at 256
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = std::min(kRows, rows - r0);
    __m512 acc[kRows][kVec];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVec; ++c)
        acc[r][c] = r < nr ? _mm512_loadu_ps(o + (r0 + r) * D + 16 * c) : _mm512_setzero_ps();
    for (int t = 0; t < kKeyBlock / 2; ++t) {
      __m512i vv[kVec];
      for (int c = 0; c < kVec; ++c) vv[c] = _mm512_loadu_si512(vb + t * D + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        if (r >= nr) break;
        const __m512i pb = _mm512_set1_epi32(int(pp[(r0 + r) * (kKeyBlock / 2) + t]));
        for (int c = 0; c < kVec; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(pb), as_bh(vv[c]));
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < kVec; ++c) _mm512_storeu_ps(o + (r0 + r) * D + 16 * c, acc[r][c]);
  }
}

// One work item: query rows [r_begin, r_end) of one head.
template <int D>
void attend_rows(const ItemArgs& a, int64_t r_begin, int64_t r_end) {
  const int rows = int(r_end - r_begin);
  alignas(64) uint32_t qpairs[kQueryBlock * (D / 2)];
  alignas(64) float s[kQueryBlock * kKeyBlock];
  alignas(64) uint32_t ppairs[kQueryBlock * (kKeyBlock / 2)];
  alignas(64) float o[kQueryBlock * D];
  float m[kQueryBlock];
  __m512 lsum[kQueryBlock];
  for (int r = 0; r < rows; ++r) {
    std::memcpy(qpairs + r * (D / 2), a.q + (r_begin + r) * a.q_row_stride, sizeof(uint16_t) * D);
    m[r] = -std::numeric_limits<float>::infinity();
    lsum[r] = _mm512_setzero_ps();
  }
  std::memset(o, 0, sizeof(float) * rows * D);

  // Keys the last row sees (exclusive end); blocks past it are skipped.
  const int64_t key_end = a.causal ? std::min(a.keys, a.q_pos0 + r_end) : a.keys;
  const int64_t nblk = (key_end + kKeyBlock - 1) / kKeyBlock;
  const __m512 vscale = _mm512_set1_ps(a.scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);

  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t j0 = b * kKeyBlock;
    const uint32_t* kb = a.kp + b * (D / 2) * kKeyBlock;
    const uint32_t* vb = a.vp + b * (kKeyBlock / 2) * D;
    int r0 = 0;
    for (; r0 + kRowTile <= rows; r0 += kRowTile) qk_tile<D, kRowTile>(qpairs + r0 * (D / 2), kb, s + r0 * kKeyBlock);
    for (; r0 < rows; ++r0) qk_tile<D, 1>(qpairs + r0 * (D / 2), kb, s + r0 * kKeyBlock);
    // Masking is needed where some key of the block lies past a row's limit.
    const int64_t first_limit = a.causal ? std::min(a.keys, a.q_pos0 + r_begin + 1) : a.keys;
    const bool masked = j0 + kKeyBlock > first_limit;
    for (int r = 0; r < rows; ++r) {
      float* sr = s + r * kKeyBlock;
      const int64_t limit = a.causal ? std::min(a.keys, a.q_pos0 + r_begin + r + 1) : a.keys;
      __m512 x[4];
      __mmask16 keep[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
      __m512 mx = ninf;
      for (int c = 0; c < 4; ++c) {
        x[c] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * c), vscale);
        if (masked) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(j0 + 16 * c)));
          keep[c] = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(int32_t(limit)));
        }
        mx = _mm512_mask_max_ps(mx, keep[c], mx, x[c]);
      }
      // Finite: every row sees key 0, which is in block 0 (m[r] is -inf only there, and
      // exp(-inf) = 0 makes that block's alpha 0).
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const float alpha = std::exp(m[r] - m_new);
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; c += 2) {
        // Masked keys get exactly 0 (v_exp clamps its argument, so it never returns 0 itself).
        const __m512 p0 = _mm512_maskz_mov_ps(keep[c], v_exp(_mm512_sub_ps(x[c], vm)));
        const __m512 p1 = _mm512_maskz_mov_ps(keep[c + 1], v_exp(_mm512_sub_ps(x[c + 1], vm)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        // Round to bf16 (nearest even); 16 consecutive bf16 read as 8 uint32 are the pairs
        // (2t, 2t+1) that P V takes, so each vector is stored as it is.
        uint16_t* dst = reinterpret_cast<uint16_t*>(ppairs + r * (kKeyBlock / 2) + 8 * c);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(p0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), (__m256i)_mm512_cvtneps_pbh(p1));
      }
      // Row sums stay in 16 lanes until the end (one horizontal sum per row, not per block).
      lsum[r] = _mm512_fmadd_ps(lsum[r], _mm512_set1_ps(alpha), sum);
      m[r] = m_new;
      if (alpha != 1.0f) {
        const __m512 va = _mm512_set1_ps(alpha);
        float* orow = o + r * D;
        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), va));
      }
    }
    pv_tile<D>(ppairs, rows, vb, o);
  }
  for (int r = 0; r < rows; ++r) {
    const float l = _mm512_reduce_add_ps(lsum[r]);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);
    uint16_t* dst = a.out + (r_begin + r) * a.out_row_stride;
    for (int c = 0; c < D; c += 16) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + c), vi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), b);
    }
  }
}

}  // namespace
}  // namespace sglk
#pragma GCC pop_options
namespace sglk {
namespace {
#endif  // x86-64 with GNU attributes
}  // namespace

void extend_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                          int64_t q_pos0, double scale, bool causal, const c10::optional<at::Tensor>& kv_index) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "extend_attention_cpu: q / out [rows, heads, dim] and k / v [keys, kv_heads, dim] expected, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ", out.sizes());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16,
                "extend_attention_cpu: every tensor must be a CPU bfloat16 tensor, got ", t->scalar_type(), " on ",
                t->device());
    TORCH_CHECK(t->stride(2) == 1, "extend_attention_cpu: the head dim must be contiguous");
  }
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const bool indexed = kv_index.has_value() && kv_index->defined();
  at::Tensor idx;
  if (indexed) {
    TORCH_CHECK(kv_index->device().is_cpu() && kv_index->dim() == 1 &&
                    (kv_index->scalar_type() == at::kLong || kv_index->scalar_type() == at::kInt),
                "extend_attention_cpu: kv_index must be a 1-D int32 / int64 CPU tensor, got ", kv_index->sizes(), " ",
                kv_index->scalar_type());
    idx = kv_index->to(at::kLong).contiguous();
    const int64_t* p = idx.data_ptr<int64_t>();
    for (int64_t j = 0; j < idx.numel(); ++j)
      TORCH_CHECK(p[j] >= 0 && p[j] < k.size(0), "extend_attention_cpu: kv_index[", j, "] = ", p[j], " outside the ",
                  k.size(0), " rows of k / v");
  }
  const int64_t keys = indexed ? idx.numel() : k.size(0), hkv = k.size(1);
  TORCH_CHECK(head_dim_supported(d), "extend_attention_cpu: head dim ", d, " is not supported (64, 128, 256)");
  TORCH_CHECK(k.size(2) == d && v.size(2) == d && v.size(0) == k.size(0) && v.size(1) == hkv,
              "extend_attention_cpu: k and v must both be [keys, kv_heads, ", d, "], got ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "extend_attention_cpu: out must be shaped as q ", q.sizes(), ", got ",
              out.sizes());
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "extend_attention_cpu: ", hq, " query heads are not a multiple of ", hkv,
              " KV heads");
  TORCH_CHECK(!causal || (q_pos0 >= 0 && q_pos0 + rows <= keys), "extend_attention_cpu: causal rows at positions [",
              q_pos0, ", ", q_pos0 + rows, ") need that many keys, got ", keys);
  const Path path = selected_path();
  TORCH_CHECK(path != Path::kNone, "extend_attention_cpu needs the avx2 kernel level or better, the selected one is ",
              current_isa(), " (check extend_attention_cpu_supported)");
  if (rows == 0) return;
  TORCH_CHECK(keys > 0, "extend_attention_cpu: no keys");
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (rows <= kDecodeMaxRows) {  // decode: read K / V in place instead of repacking them
    DecodeAttnArgs da;
    da.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
    da.q_row = q.stride(0);
    da.q_head = q.stride(1);
    da.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    da.out_row = out.stride(0);
    da.out_head = out.stride(1);
    da.k = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    da.k_row = k.stride(0);
    da.k_head = k.stride(1);
    da.v = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    da.v_row = v.stride(0);
    da.v_head = v.stride(1);
    da.idx = indexed ? idx.data_ptr<int64_t>() : nullptr;
    da.rows = rows;
    da.heads = hq;
    da.kv_heads = hkv;
    da.dim = d;
    da.keys = keys;
    da.q_pos0 = causal ? q_pos0 : 0;
    da.causal = causal;
    da.scale = float(scale);
    decode_attention(da, path == Path::kAvx512Bf16);
    return;
  }
  const int64_t nblk = (keys + kKeyBlock - 1) / kKeyBlock;
  const int64_t kv_head_words = nblk * kKeyBlock * d / 2;  // uint32 pairs per KV head (K or V)
  // Not value-initialized: pack_kv_head writes every word (zeros past the last key).
  std::unique_ptr<uint32_t[]> kp(new uint32_t[size_t(hkv * kv_head_words)]);
  std::unique_ptr<uint32_t[]> vp(new uint32_t[size_t(hkv * kv_head_words)]);
  const auto* kbase = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vbase = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::parallel_for(0, hkv * nblk, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nblk, b = i % nblk;
      pack_kv_head(kbase + h * k.stride(1), vbase + h * v.stride(1), k.stride(0), v.stride(0), keys, d, b,
                   kp.get() + h * kv_head_words, vp.get() + h * kv_head_words,
                   indexed ? idx.data_ptr<int64_t>() : nullptr);
    }
  });
  std::vector<ItemArgs> heads(static_cast<size_t>(hq));
  const int64_t rep = hq / hkv;
  for (int64_t h = 0; h < hq; ++h) {
    ItemArgs& a = heads[size_t(h)];
    a.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) + h * q.stride(1);
    a.q_row_stride = q.stride(0);
    a.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + h * out.stride(1);
    a.out_row_stride = out.stride(0);
    a.kp = kp.get() + (h / rep) * kv_head_words;
    a.vp = vp.get() + (h / rep) * kv_head_words;
    a.rows = rows;
    a.keys = keys;
    a.q_pos0 = causal ? q_pos0 : 0;
    a.causal = causal;
    a.scale = float(scale);
  }
  const bool bf16 = path == Path::kAvx512Bf16;
  switch (d) {
    case 64:
      run_items(heads, rows, bf16 ? &attend_rows<64> : &avx2::attend_rows<64>);
      break;
    case 128:
      run_items(heads, rows, bf16 ? &attend_rows<128> : &avx2::attend_rows<128>);
      break;
    default:
      run_items(heads, rows, bf16 ? &attend_rows<256> : &avx2::attend_rows<256>);
      break;
  }
#endif
}

bool extend_attention_cpu_supported(int64_t head_dim) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return selected_path() != Path::kNone && head_dim_supported(head_dim);
#else
  return false;
#endif
}

}  // namespace sglk

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "extend_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int q_pos0, float scale, bool causal, "
      "Tensor? kv_index=None) -> ()");
  m.def("extend_attention_cpu_supported(int head_dim) -> bool", &sglk::extend_attention_cpu_supported);
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) { m.impl("extend_attention_cpu", &sglk::extend_attention_cpu); }
