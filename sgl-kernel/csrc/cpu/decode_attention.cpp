// Decode attention on the CPU (decode_attention.h): one request's few query rows against its
// keys, read in the KV pool's own layout ([slot][kv head][dim], through the request's slot
// list), without the flash kernel's repacking.
//
// extend_attention_cpu (extend_attention.cpp) repacks every key and value of the request into
// its vdpbf16ps operand layout before attending; that pays off over 64 query rows, but a decode
// step has one, and the repack (scalar transposing stores) made a 4096-key decode call take
// ~2.5 ms per layer against ~0.3 ms to read its 8 MB of KV. Here each work item is (query row,
// KV head, chunk of kChunk keys):
//   S = q K^T   the item's G = heads / kv_heads query heads against each key row as stored:
//               bf16 path: vdpbf16ps over the row's natural (2p, 2p+1) pairs, 16 keys at a time,
//               their 16 partial-sum vectors reduced by one transpose-and-add tree;
//               AVX2 path: the row's pairs widened in registers (low bf16 = lane << 16, high =
//               lane & 0xffff0000) against q's even / odd elements (fp32, scale folded in).
//   P           softmax numerator over the chunk (its max m, its sum l); the bf16 path rounds P
//               to bf16 before P V as the flash kernel does, the AVX2 path keeps it fp32.
//   O = P V     bf16 path: pairs of value rows interleaved once per 32-key tile (unpack lo / hi),
//               then vdpbf16ps against each head's (p_2t, p_2t+1) pair; AVX2 path: each value
//               row's pairs widened, one FMA per element and head.
// The chunks of a row and head are then merged in chunk order: M = max m_c, L = sum l_c e^(m_c
// - M), out = sum o_c e^(m_c - M) / L (the split-K of flash decoding; Dao et al., 2023). The
// chunking depends on the key count only, so results do not depend on the thread count.
// The K / V of a chunk are read from memory once for all G heads (later heads hit L1 / L2).

#include "decode_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_executor_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own _mm512_undefined_* helpers inside the reduce intrinsics (as isa_unit.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace sglk {
namespace {

constexpr int kChunk = 256;  // keys per work item (a multiple of the 32-key P V tile)

// Keys row r sees (exclusive end).
inline int64_t row_keys(const DecodeAttnArgs& a, int64_t r) {
  return a.causal ? std::min(a.keys, a.q_pos0 + r + 1) : a.keys;
}

inline const uint16_t* key_row(const DecodeAttnArgs& a, int64_t h, int64_t j) {
  return a.k + (a.idx != nullptr ? a.idx[j] : j) * a.k_row + h * a.k_head;
}

inline const uint16_t* value_row(const DecodeAttnArgs& a, int64_t h, int64_t j) {
  return a.v + (a.idx != nullptr ? a.idx[j] : j) * a.v_row + h * a.v_head;
}

// One item's result per head g of the item: m[g] (max scaled score), l[g] (sum of P, fp32) and
// o[g * D + d] (P V, not yet divided by l), all fp32, dims in natural order.
using ItemFn = void (*)(const DecodeAttnArgs&, int64_t r, int64_t h, int64_t j0, int64_t j1, float* m, float* l,
                        float* o);

}  // namespace
}  // namespace sglk

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

// ---- AVX2 + FMA path (also the avx512 level: AVX-512 without BF16) -------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace sglk {
namespace {
namespace avx2 {
#define SGLK_ISA_LEVEL 1
#include "isa/vec.h"
#undef SGLK_ISA_LEVEL

inline __m256 pair_lo(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
inline __m256 pair_hi(__m256i x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536))); }

// out lane t = the sum of v[t]'s 8 lanes.
inline __m256 reduce8(const __m256 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <int D>
void item(const DecodeAttnArgs& a, int64_t r, int64_t h, int64_t j0, int64_t j1, float* m, float* l, float* o) {
  constexpr int kGroups = D / 16;  // 16-element groups of a row: one 8-lane vector of pairs each
  const int G = int(a.heads / a.kv_heads);
  const int n = int(j1 - j0);
  thread_local std::vector<float> qf_buf, s_buf, acc_buf;
  qf_buf.resize(size_t(G) * D);
  s_buf.resize(size_t(G) * kChunk);
  acc_buf.resize(size_t(G) * D);
  float* qf = qf_buf.data();  // per head and group: 8 even elements, then 8 odd ones (scaled)
  float* s = s_buf.data();    // scores, then P, [G][kChunk]
  float* acc = acc_buf.data();
  for (int g = 0; g < G; ++g) {
    const uint16_t* qg = a.q + r * a.q_row + (h * G + g) * a.q_head;
    for (int c = 0; c < kGroups; ++c)
      for (int i = 0; i < 8; ++i) {
        uint32_t lo = uint32_t(qg[16 * c + 2 * i]) << 16, hi = uint32_t(qg[16 * c + 2 * i + 1]) << 16;
        float flo, fhi;
        std::memcpy(&flo, &lo, 4);
        std::memcpy(&fhi, &hi, 4);
        qf[g * D + 16 * c + i] = flo * a.scale;
        qf[g * D + 16 * c + 8 + i] = fhi * a.scale;
      }
  }
  // S, 8 keys at a time (past the end: the last key again, its scores unused).
  for (int t0 = 0; t0 < n; t0 += 8) {
    const uint16_t* kr[8];
    for (int t = 0; t < 8; ++t) kr[t] = key_row(a, h, j0 + std::min(t0 + t, n - 1));
    for (int g = 0; g < G; ++g) {
      __m256 sc[8];
      for (int t = 0; t < 8; ++t) sc[t] = _mm256_setzero_ps();
      for (int c = 0; c < kGroups; ++c) {
        const __m256 qe = _mm256_loadu_ps(qf + g * D + 16 * c), qo = _mm256_loadu_ps(qf + g * D + 16 * c + 8);
        for (int t = 0; t < 8; ++t) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr[t] + 16 * c));
          sc[t] = _mm256_fmadd_ps(qe, pair_lo(x), sc[t]);
          sc[t] = _mm256_fmadd_ps(qo, pair_hi(x), sc[t]);
        }
      }
      _mm256_storeu_ps(s + g * kChunk + t0, reduce8(sc));
    }
  }
  // P (fp32; keys past n get exactly 0) and its max and sum per head.
  const int nv = (n + 7) / 8;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * kChunk;
    __m256 mx = ninf;
    for (int c = 0; c < nv; ++c) {
      const __m256 keep = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c))));
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sg + 8 * c), keep));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mg = _mm_cvtss_f32(m4);
    const __m256 vm = _mm256_set1_ps(mg);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < nv; ++c) {
      const __m256 keep = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c))));
      const __m256 p = _mm256_and_ps(v_exp(_mm256_sub_ps(_mm256_loadu_ps(sg + 8 * c), vm)), keep);
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(sg + 8 * c, p);
    }
    m[g] = mg;
    l[g] = v_hsum(sum);
  }
  // O = P V, 64 dims (4 groups: 4 even + 4 odd accumulators) at a time.
  for (int g = 0; g < G; ++g) {
    const float* pg = s + g * kChunk;
    for (int c0 = 0; c0 < kGroups; c0 += 4) {
      __m256 ae[4], ao[4];
      for (int c = 0; c < 4; ++c) ae[c] = ao[c] = _mm256_setzero_ps();
      for (int j = 0; j < n; ++j) {
        const __m256 p = _mm256_broadcast_ss(pg + j);
        const uint16_t* vr = value_row(a, h, j0 + j) + 16 * c0;
        for (int c = 0; c < 4; ++c) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * c));
          ae[c] = _mm256_fmadd_ps(p, pair_lo(x), ae[c]);
          ao[c] = _mm256_fmadd_ps(p, pair_hi(x), ao[c]);
        }
      }
      for (int c = 0; c < 4; ++c) {
        _mm256_storeu_ps(acc + g * D + 16 * (c0 + c), ae[c]);
        _mm256_storeu_ps(acc + g * D + 16 * (c0 + c) + 8, ao[c]);
      }
    }
    for (int c = 0; c < kGroups; ++c)
      for (int i = 0; i < 8; ++i) {
        o[g * D + 16 * c + 2 * i] = acc[g * D + 16 * c + i];
        o[g * D + 16 * c + 2 * i + 1] = acc[g * D + 16 * c + 8 + i];
      }
  }
}

}  // namespace avx2
}  // namespace
}  // namespace sglk
#pragma GCC pop_options

// ---- AVX-512 BF16 path -----------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace sglk {
namespace {
namespace bf16 {
#define SGLK_ISA_LEVEL 2
#include "isa/vec.h"
#undef SGLK_ISA_LEVEL

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// out lane t = the sum of v[t]'s 16 lanes: pairs of vectors are folded within 128-bit blocks
// (unpack lo / hi, twice), then the four blocks of four vectors are transposed and added.
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d p = _mm512_castps_pd(t[2 * i]), q = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  // u[i]'s block L holds the block-L partial sums of v[4i .. 4i+3].
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

template <int D>
void item(const DecodeAttnArgs& a, int64_t r, int64_t h, int64_t j0, int64_t j1, float* m, float* l, float* o) {
  constexpr int kVecs = D / 32;  // 32-element vectors of a bf16 row
  const int G = int(a.heads / a.kv_heads);
  const int n = int(j1 - j0);
  thread_local std::vector<float> s_buf, acc_buf;
  thread_local std::vector<uint16_t> p_buf;
  s_buf.resize(size_t(G) * kChunk);
  p_buf.resize(size_t(G) * kChunk);
  acc_buf.resize(size_t(G) * D);
  float* s = s_buf.data();      // scores [G][kChunk]
  uint16_t* pp = p_buf.data();  // P in bf16 [G][kChunk], zero past n up to the next 32
  float* acc = acc_buf.data();  // P V per head in the unpack order (see below)
  // S, 16 keys at a time (past the end: the last key again, its scores unused).
  for (int t0 = 0; t0 < n; t0 += 16) {
    const uint16_t* kr[16];
    for (int t = 0; t < 16; ++t) kr[t] = key_row(a, h, j0 + std::min(t0 + t, n - 1));
    for (int g = 0; g < G; ++g) {
      const uint16_t* qg = a.q + r * a.q_row + (h * G + g) * a.q_head;
      __m512 sc[16];
      for (int t = 0; t < 16; ++t) sc[t] = _mm512_setzero_ps();
      for (int c = 0; c < kVecs; ++c) {
        const __m512i qv = _mm512_loadu_si512(qg + 32 * c);
        for (int t = 0; t < 16; ++t)
          sc[t] = _mm512_dpbf16_ps(sc[t], as_bh(qv), as_bh(_mm512_loadu_si512(kr[t] + 32 * c)));
      }
      _mm512_storeu_ps(s + g * kChunk + t0, reduce16(sc));
    }
  }
  // P (bf16, as the flash kernel's P V takes it; keys past n exactly 0) and its max and fp32 sum.
  const int n32 = (n + 31) / 32 * 32;
  const __m512 vscale = _mm512_set1_ps(a.scale);
  for (int g = 0; g < G; ++g) {
    const float* sg = s + g * kChunk;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int t0 = 0; t0 < n; t0 += 16) {
      const __mmask16 keep = n - t0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t0)) - 1);
      mx = _mm512_mask_max_ps(mx, keep, mx, _mm512_mul_ps(_mm512_loadu_ps(sg + t0), vscale));
    }
    const float mg = _mm512_reduce_max_ps(mx);
    const __m512 vm = _mm512_set1_ps(mg);
    __m512 sum = _mm512_setzero_ps();
    for (int t0 = 0; t0 < n32; t0 += 16) {
      const int left = n - t0;
      const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sg + t0), vscale);
      const __m512 p = _mm512_maskz_mov_ps(keep, v_exp(_mm512_sub_ps(x, vm)));
      sum = _mm512_add_ps(sum, p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + g * kChunk + t0), (__m256i)_mm512_cvtneps_pbh(p));
    }
    m[g] = mg;
    l[g] = _mm512_reduce_add_ps(sum);
  }
  // O = P V over 32-key tiles. Value rows 2t and 2t+1 are interleaved once per tile
  // (unpacklo / unpackhi_epi16: per 128-bit block, dims 0-3 / 4-7 of the block as (v_2t, v_2t+1)
  // pairs), then each head's (p_2t, p_2t+1) pair multiplies them with vdpbf16ps.
  alignas(64) static const uint16_t zero_row[256] = {};
  alignas(64) __m512i vp[16][2 * kVecs];
  std::fill(acc, acc + size_t(G) * D, 0.0f);
  for (int tile = 0; tile < n; tile += 32) {
    const int pairs = std::min(16, (n - tile + 1) / 2);
    for (int t = 0; t < pairs; ++t) {
      const int j = tile + 2 * t;
      const uint16_t* ra = value_row(a, h, j0 + j);
      const uint16_t* rb = j + 1 < n ? value_row(a, h, j0 + j + 1) : zero_row;
      for (int c = 0; c < kVecs; ++c) {
        const __m512i x = _mm512_loadu_si512(ra + 32 * c), y = _mm512_loadu_si512(rb + 32 * c);
        vp[t][2 * c] = _mm512_unpacklo_epi16(x, y);
        vp[t][2 * c + 1] = _mm512_unpackhi_epi16(x, y);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* ag = acc + g * D;
      const uint16_t* pg = pp + g * kChunk + tile;
      __m512 ov[2 * kVecs];
      for (int c = 0; c < 2 * kVecs; ++c) ov[c] = _mm512_loadu_ps(ag + 16 * c);
      for (int t = 0; t < pairs; ++t) {
        uint32_t pair;
        std::memcpy(&pair, pg + 2 * t, 4);
        const __m512i pb = _mm512_set1_epi32(int(pair));
        for (int c = 0; c < 2 * kVecs; ++c) ov[c] = _mm512_dpbf16_ps(ov[c], as_bh(pb), as_bh(vp[t][c]));
      }
      for (int c = 0; c < 2 * kVecs; ++c) _mm512_storeu_ps(ag + 16 * c, ov[c]);
    }
  }
  // Unpack order -> dims: accumulator 2c lane 4L + i is dim 32c + 8L + i, accumulator 2c + 1
  // lane 4L + i is dim 32c + 8L + 4 + i.
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kVecs; ++c)
      for (int blk = 0; blk < 4; ++blk)
        for (int i = 0; i < 4; ++i) {
          o[g * D + 32 * c + 8 * blk + i] = acc[g * D + 32 * c + 4 * blk + i];
          o[g * D + 32 * c + 8 * blk + 4 + i] = acc[g * D + 32 * c + 16 + 4 * blk + i];
        }
}

}  // namespace bf16
}  // namespace
}  // namespace sglk
#pragma GCC pop_options

#endif  // x86-64 with GNU attributes

namespace sglk {

void decode_attention(const DecodeAttnArgs& a, bool use_bf16) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  ItemFn fn = nullptr;
  switch (a.dim) {
    case 64:
      fn = use_bf16 ? &bf16::item<64> : &avx2::item<64>;
      break;
    case 128:
      fn = use_bf16 ? &bf16::item<128> : &avx2::item<128>;
      break;
    case 256:
      fn = use_bf16 ? &bf16::item<256> : &avx2::item<256>;
      break;
    default:
      TORCH_CHECK(false, "decode_attention: head dim ", a.dim, " is not supported (64, 128, 256)");
  }
  const int64_t G = a.heads / a.kv_heads, D = a.dim;
  const int64_t chunks = (a.keys + kChunk - 1) / kChunk;
  const int64_t items = a.rows * a.kv_heads * chunks;
  const int64_t part = G * (D + 2);  // m[G], l[G], o[G][D] of one item
  std::vector<float> parts(size_t(items * part));
  // On the executor's pool (the caller works too), as the decode step's linears and experts
  // are: torch's OpenMP team beside the pool's spinning workers would share their cores.
  parallel_items(items, [&](int64_t it) {
    const int64_t r = it / (a.kv_heads * chunks), c = (it / a.kv_heads) % chunks, h = it % a.kv_heads;
    const int64_t j0 = c * kChunk, j1 = std::min(row_keys(a, r), j0 + kChunk);
    if (j0 >= j1) return;  // a causal row that does not reach this chunk (never merged)
    float* p = parts.data() + ((r * a.kv_heads + h) * chunks + c) * part;
    fn(a, r, h, j0, j1, p, p + G, p + 2 * G);
  });
  // Merge each (row, head)'s chunks in chunk order.
  const int64_t grain = std::max<int64_t>(1, 8192 / (chunks * D));
  const int64_t heads_all = a.rows * a.heads;
  parallel_items((heads_all + grain - 1) / grain, [&](int64_t blk) {
    const int64_t begin = blk * grain, end = std::min(heads_all, begin + grain);
    std::vector<float> acc(static_cast<size_t>(D));
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / a.heads, head = rh % a.heads, h = head / G, g = head % G;
      const float* first = parts.data() + (r * a.kv_heads + h) * chunks * part;
      // The row's chunks (>= 1: every row sees key 0); later ones hold no keys of it.
      const int64_t row_chunks = (row_keys(a, r) + kChunk - 1) / kChunk;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < row_chunks; ++c) mx = std::max(mx, first[c * part + g]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float lsum = 0.0f;
      for (int64_t c = 0; c < row_chunks; ++c) {
        const float* p = first + c * part;
        const float w = std::exp(p[g] - mx);  // exactly 1 for the chunk holding the max
        lsum += w * p[G + g];
        const float* o = p + 2 * G + g * D;
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += w * o[d];
      }
      const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
      uint16_t* dst = a.out + r * a.out_row + head * a.out_head;
      for (int64_t d = 0; d < D; ++d) {
        const c10::BFloat16 b(acc[size_t(d)] * inv);
        std::memcpy(dst + d, &b, 2);
      }
    }
  });
#else
  (void)a;
  (void)use_bf16;
  TORCH_CHECK(false, "decode_attention needs x86-64 (AVX2 or AVX-512 BF16)");
#endif
}

}  // namespace sglk
