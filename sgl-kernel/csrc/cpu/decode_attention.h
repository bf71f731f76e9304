// Decode attention on the CPU: a request's few query rows (decode, a short extend) against its
// keys read where they lie (decode_attention.cpp). Called by extend_attention_cpu for
// rows <= kDecodeMaxRows; baseline ISA only (the kernels switch their own target).
#pragma once

#include <cstdint>

namespace sglk {

constexpr int64_t kDecodeMaxRows = 4;

// Element strides throughout (bf16 elements, not bytes); the head dim is contiguous.
struct DecodeAttnArgs {
  const uint16_t* q;  // [rows, heads, dim]
  int64_t q_row, q_head;
  uint16_t* out;  // [rows, heads, dim]
  int64_t out_row, out_head;
  const uint16_t* k;  // [slots, kv_heads, dim]
  int64_t k_row, k_head;
  const uint16_t* v;  // [slots, kv_heads, dim]
  int64_t v_row, v_head;
  const int64_t* idx;  // key j is row idx[j] of k / v, or row j when null
  int64_t rows, heads, kv_heads, dim;
  int64_t keys;    // keys of the request (all rows see them when not causal)
  int64_t q_pos0;  // position of query row 0: row r sees keys [0, q_pos0 + r] when causal
  bool causal;
  float scale;
};

// out = softmax(q k^T * scale) v per query head (GQA: head i reads KV head i / (heads /
// kv_heads)). bf16 = true takes the AVX-512 BF16 path (P rounded to bf16 before P V), else the
// AVX2 + FMA fp32 path; the caller checks that the CPU has it and that dim is 64, 128 or 256.
void decode_attention(const DecodeAttnArgs& a, bool bf16);

}  // namespace sglk
