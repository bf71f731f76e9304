// CPU executor (paper §3.2 CPU execution set C, §4.1 "Graph-resident CPU
// execution"): routed experts computed on the host, from any number of expert
// bank sets, on the persistent pinned pool of cpu_executor_pool.h.
//
//   moe_experts_cpu(hidden [T,H] bf16, topk_weights [T,K] f32,
//                   expert_rows[S] of [T,K] i32, w13[S] of [N_i,2I,H] bf16,
//                   w2[S] of [N_i,H,I] bf16, out [T,H] f32, accumulate,
//                   format = bf16, w13_scale[S], w2_scale[S], w13_scale_2[S], w2_scale_2[S],
//                   w13_bias[S] of [N_i,2I] f32|bf16, w2_bias[S] of [N_i,H] f32|bf16,
//                   activation = silu, alpha = 1.702, limit = 7.0)
//
// Quantized formats (fp8, mxfp4, nvfp4; isa/cpu_executor_args.h): the banks hold the layer
// quant method's per-expert tensors as upstream creates them, and the weights are decoded in
// registers (weight-only: activations stay bf16, w13 / w2 entries below mean the dequantized
// weights). The kernels read copies of x and h in dot_q's activation layout (fp32, or bf16 for
// avx512bf16), written per chunk by the table's prep_x.
//
// For each token t, result[t] = sum_{k=0..K-1, in this order} topk_weights[t,k]
// * expert(x[t]) over the (t,k) whose row is >= 0 in one set i (rows of -1 in
// every set contribute nothing), with
//   expert(x) = w2 @ h + b2,  h = bf16(act(g, u)),  g = w13[:I] @ x + b13[:I],
//   u = w13[I:] @ x + b13[I:],
// g, u and the w2 dot in fp32 (bf16 x bf16 products are exact in fp32), the biases (if given;
// zero otherwise) added in fp32 to the finished dots, act one of SGLK_EXPERT_ACTIVATIONS
// (isa/cpu_executor_args.h: silu, gpt-oss's swiglu_oai, DeepSeek-V4's swiglu_limit). As in
// transformers' GptOssExperts, b2 is added before the routing weight. Gate and up are the two
// halves of w13 for every activation: checkpoints that interleave them (gpt-oss) are
// de-interleaved once where the banks are loaded (expert_cache/formats.py). The one
// rounding to bf16 is of h, the input of the down projection (as in SGLang's
// bf16 MoE, and needed by vdpbf16ps). out = out + result if accumulate, else
// result.
//
// Exactness: every dot product is computed whole by one thread with the same
// operation sequence wherever its row comes from (see isa/cpu_executor_args.h),
// each (t,k) output is kept in its own fp32 scratch row, and the k-sum runs in
// k order over those rows. So the value of a (t,k) term, and the output, are
// bit-identical for any thread count, any split of the entries over sets, and
// any chunking of tokens (for one ISA level).
//
// Work partition, per chunk of tokens (chunks bound the scratch to
// SGLANG_CPU_EXPERT_SCRATCH_MB, default 64 MB; a decode step is one chunk): the valid (t,k) entries are grouped per
// expert (set, row), and three kinds of work items are handed out in this order from one atomic counter:
//   1. (expert, block of intermediate indices [j0,j1)): gate rows j0..j1 and
//      up rows I+j0..I+j1 of w13 (item_bytes(): ~512 KB of weights, less with many
//      threads), dotted with every token of the expert, then h for those indices;
//   2. (expert, block of rows of w2, ~item_bytes()): dotted with the h of every token
//      of the expert; starts once all phase-1 items of its expert are done;
//   3. (token, block of columns): the k-sum into out, once phase 2 is done.
// Each item streams one disjoint contiguous slice of weights, so decode (few
// tokens per expert) is bound by memory bandwidth; in prefill the tile kernel
// keeps a few weight rows in L1 while all tokens of the expert pass over them.
#include <Python.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "common.h"
#include "cpu_executor_pool.h"

namespace sglk {
namespace {

// ----------------------------------------------------------- scratch memory
// Cache of 64-byte aligned buffers (at most 4 kept), so that steady-state calls
// do not fault fresh pages in. A buffer returns to the cache when the waiting
// thread releases the call (PoolJob::release), never in a pool thread.
class ScratchCache {
 public:
  static ScratchCache& get() {
    static ScratchCache* c = new ScratchCache();  // never deleted (see cpu_executor_pool.cpp)
    return *c;
  }
  std::shared_ptr<char> take(size_t bytes) {
    bytes = std::max<size_t>(64, (bytes + 63) / 64 * 64);
    char* p = nullptr;
    size_t cap = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i)
        if (free_[i].second >= bytes && (best == free_.size() || free_[i].second < free_[best].second)) best = i;
      if (best < free_.size()) {
        p = free_[best].first;
        cap = free_[best].second;
        free_.erase(free_.begin() + best);
      }
    }
    if (p == nullptr) {
      p = static_cast<char*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(p != nullptr, "moe_experts_cpu: cannot allocate ", bytes, " bytes of scratch");
      cap = bytes;
    }
    return std::shared_ptr<char>(p, [this, cap](char* q) { give(q, cap); });
  }

 private:
  void give(char* p, size_t cap) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.emplace_back(p, cap);
    if (free_.size() > 4) {  // drop the smallest
      auto it = std::min_element(free_.begin(), free_.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
      std::free(it->first);
      free_.erase(it);
    }
  }
  std::mutex mu_;
  std::vector<std::pair<char*, size_t>> free_;
};

// ------------------------------------------------------------------ the call
// Bytes of Y + h per chunk of tokens: SGLANG_CPU_EXPERT_SCRATCH_MB (default 64).
int64_t scratch_budget() {
  const char* e = std::getenv("SGLANG_CPU_EXPERT_SCRATCH_MB");
  const double mb = e && *e ? std::atof(e) : 64.0;
  return std::max<int64_t>(1, static_cast<int64_t>(mb * (1 << 20)));
}
// Weight bytes per phase-1/2 item. Items are handed out in turn, so with N threads each
// thread's stream jumps every item; the hardware prefetchers ramp up again after each jump,
// so few threads want large items (512 KB against 128 KB: benchmark/RESULTS.md, CPU
// executor). With many threads each one's share of the bandwidth is small (the jumps cost
// less) and items must stay plentiful (a top-8 decode of 9.4 MB experts makes ~150 items
// of 512 KB), so the size steps down: 512 KB up to 4 threads, 256 KB at 8, 128 KB from 16.
int64_t item_bytes() {
  const int64_t n = std::max(1, ExpertPool::get().parallelism());
  return std::max<int64_t>(128 << 10, (int64_t{512} << 10) * 4 / std::max<int64_t>(4, n));
}
constexpr int64_t kColBlock = 512;  // out columns per phase-3 item

// Bytes of one weight row of n elements.
int64_t weight_row_bytes(int64_t format, int64_t n) {
  return format == kFormat_bf16 ? 2 * n : format == kFormat_fp8 ? n : n / 2;
}

// Whether an fp8 w13 scale bank holds one scale per output channel ([N, 2I, 1], compressed-tensors
// FP8-Dynamic) rather than one per 128 x 128 block ([N, ceil(2I/128), ceil(H/128)]): the shapes
// never coincide, since ceil(2I/128) < 2I for every I >= 1. A set's w2 scales must follow
// (check_quant_set).
bool fp8_per_channel(const at::Tensor& w13_scale, int64_t two_i) {
  return w13_scale.dim() == 3 && w13_scale.size(1) == two_i && two_i > 1 && w13_scale.size(2) == 1;
}

// The quantized formats' per-set tensors (empty lists for bf16): the scales of w13 and w2 and,
// for nvfp4, their global scales (w13_scale_2 [N] or [N, 2] = (gate, up), w2_scale_2 [N]).
struct QuantBanks {
  int64_t format = kFormat_bf16;
  std::vector<at::Tensor> w13_scale, w2_scale, w13_scale_2, w2_scale_2;
};

// The epilogue: per-set bias banks (empty lists: no bias) and the activation.
struct Epilogue {
  std::vector<at::Tensor> w13_bias, w2_bias;  // [N_i, 2I] / [N_i, H], float32 or bfloat16
  Activation act{kAct_silu, 1.702f, 7.0f};
};

// State shared by the chunk jobs of one call. Holds references to the tensors
// (and the scratch) until the waiting thread releases the jobs.
struct MoeCall {
  at::Tensor hidden, topk, out;
  std::vector<at::Tensor> rows, w13, w2;
  QuantBanks q;
  Epilogue ep;
  int64_t T = 0, K = 0, H = 0, I = 0;
  int64_t XH = 0, XI = 0;  // quantized formats: floats per prepared x / h row
  bool accumulate = false;
  const CpuExecutorKernels* kern = nullptr;
  std::vector<int32_t> set_of;  // [T*K]: set of entry t*K+k, or -1
  std::vector<int32_t> row_of;  // [T*K]: row in that set
  std::shared_ptr<char> scratch;
  float* Y = nullptr;        // [chunk tokens * K, H]: per-(t,k) expert outputs
  uint16_t* hbuf = nullptr;  // [chunk tokens * K, I]: h (bf16) per grouped entry
  float* xf = nullptr;       // quantized: [T, XH] x in dot_q's layout (all tokens: every chunk job
                             // prepares its rows when it is made, before any job runs)
  float* hf = nullptr;       // quantized: [chunk tokens * K, XI] h (its bf16 values) in that layout
};

struct Expert {
  const uint16_t* w13;
  const uint16_t* w2;
  int32_t first;               // first grouped position
  int32_t count;               // tokens routed to it in this chunk
  QuantMatrix gate, up, down;  // quantized formats: the expert's three matrices
  int64_t bias = -1;           // offset of its fp32 biases [2I + H] in the job's bias_, or -1
};

// bias row r of a [N, n] float32 / bfloat16 bank, as fp32, into dst[0, n)
static void bias_row_f32(const at::Tensor& b, int64_t r, int64_t n, float* dst) {
  if (b.scalar_type() == at::kFloat) {
    std::memcpy(dst, b.data_ptr<float>() + r * n, 4 * n);
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(b.data_ptr()) + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
  }
}

struct Item {
  int32_t kind;  // 1: gate/up block, 2: w2 row block, 3: k-sum block
  int32_t a;     // expert (1, 2) or token in the chunk (3)
  int32_t b0, b1;
};

class MoeChunkJob final : public ItemJob {
 public:
  MoeChunkJob(std::shared_ptr<MoeCall> call, int64_t t0, int64_t t1) : c_(std::move(call)), t0_(t0), t1_(t1) {
    plan();
    set_items(static_cast<int64_t>(items_.size()));
  }

  void release() override { c_.reset(); }  // the tensors (see PoolJob::release)

 protected:
  void do_item(int64_t i, int) override {
    const Item& it = items_[i];
    // the dependency counters advance even if an item fails, so that no
    // thread waits forever; the error reaches moe_experts_cpu_wait
    try {
      if (it.kind == 1)
        gate_up(it);
      else if (it.kind == 2)
        down(it);
      else
        reduce(it);
    } catch (const std::exception& e) {
      set_error(e.what());
    }
    if (it.kind == 1)
      p1_done_[it.a].fetch_add(1, std::memory_order_release);
    else if (it.kind == 2)
      p2_done_.fetch_add(1, std::memory_order_release);
  }

 private:
  void plan() {
    const MoeCall& c = *c_;
    const int64_t K = c.K, H = c.H, I = c.I;
    struct Key {
      int32_t set, row, entry;
    };
    std::vector<Key> keys;
    for (int64_t e = t0_ * K; e < t1_ * K; ++e)
      if (c.set_of[e] >= 0) keys.push_back({c.set_of[e], c.row_of[e], static_cast<int32_t>(e)});
    std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
      return a.set != b.set ? a.set < b.set : a.row != b.row ? a.row < b.row : a.entry < b.entry;
    });
    const int64_t n = static_cast<int64_t>(keys.size());
    xp_.resize(n);
    hp_.resize(n);
    local_.resize(n);
    if (c.q.format != kFormat_bf16) {
      xfp_.resize(n);
      hfp_.resize(n);
    }
    const uint16_t* x = reinterpret_cast<const uint16_t*>(c.hidden.data_ptr());
    for (int64_t p = 0; p < n; ++p) {
      const int64_t e = keys[p].entry;
      if (p == 0 || keys[p].set != keys[p - 1].set || keys[p].row != keys[p - 1].row) {
        const int64_t s = keys[p].set, r = keys[p].row;
        Expert ex{};
        ex.first = static_cast<int32_t>(p);
        if (c.q.format == kFormat_bf16) {
          ex.w13 = reinterpret_cast<const uint16_t*>(c.w13[s].data_ptr()) + r * 2 * I * H;
          ex.w2 = reinterpret_cast<const uint16_t*>(c.w2[s].data_ptr()) + r * H * I;
        } else {
          quant_matrices(c, s, r, ex);
        }
        if (!c.ep.w13_bias.empty() || !c.ep.w2_bias.empty()) {
          // the expert's biases as fp32 [gate+up 2I | down H] (zeros for a missing bank)
          ex.bias = static_cast<int64_t>(bias_.size());
          bias_.resize(bias_.size() + 2 * I + H, 0.0f);
          if (!c.ep.w13_bias.empty()) bias_row_f32(c.ep.w13_bias[s], r, 2 * I, bias_.data() + ex.bias);
          if (!c.ep.w2_bias.empty()) bias_row_f32(c.ep.w2_bias[s], r, H, bias_.data() + ex.bias + 2 * I);
        }
        experts_.push_back(ex);
      }
      experts_.back().count++;
      xp_[p] = x + (e / K) * H;
      hp_[p] = c.hbuf + p * I;
      local_[p] = static_cast<int32_t>(e - t0_ * K);
    }
    if (c.q.format != kFormat_bf16) {
      // x of every token of the chunk in dot_q's layout; the padding of the h rows
      for (int64_t t = t0_; t < t1_; ++t) c.kern->prep_x(c.q.format, x + t * H, 0, H, H, 1, c.xf + t * c.XH);
      for (int64_t p = 0; p < n; ++p) {
        xfp_[p] = c.xf + (keys[p].entry / K) * c.XH;
        hfp_[p] = c.hf + p * c.XI;
        c.kern->prep_x(c.q.format, nullptr, I, I, I, 1, hfp_[p]);
      }
    }
    const int64_t ne = static_cast<int64_t>(experts_.size());
    const int64_t item = item_bytes();
    // weight bytes per row: 2 (bf16), 1 (fp8) or 1/2 (4-bit) per element
    const int64_t b13 = weight_row_bytes(c.q.format, H), b2 = weight_row_bytes(c.q.format, I);
    const int64_t J = std::clamp<int64_t>(item / std::max<int64_t>(1, 2 * b13), 1, std::max<int64_t>(1, I));
    int64_t R2 = std::max<int64_t>(8, item / std::max<int64_t>(1, b2) / 8 * 8);
    R2 = std::min(R2, H);
    p1_total_.reset(new int32_t[std::max<int64_t>(ne, 1)]);
    p1_done_.reset(new std::atomic<int32_t>[std::max<int64_t>(ne, 1)]);
    for (int64_t e = 0; e < ne; ++e) {
      p1_done_[e].store(0, std::memory_order_relaxed);
      p1_total_[e] = 0;
      for (int64_t j = 0; j < I; j += J) {
        items_.push_back(
            {1, static_cast<int32_t>(e), static_cast<int32_t>(j), static_cast<int32_t>(std::min(I, j + J))});
        p1_total_[e]++;
      }
    }
    for (int64_t e = 0; e < ne; ++e)
      for (int64_t r = 0; r < H; r += R2) {
        items_.push_back(
            {2, static_cast<int32_t>(e), static_cast<int32_t>(r), static_cast<int32_t>(std::min(H, r + R2))});
        p2_total_++;
      }
    for (int64_t t = t0_; t < t1_; ++t)
      for (int64_t c0 = 0; c0 < H; c0 += kColBlock)
        items_.push_back({3, static_cast<int32_t>(t - t0_), static_cast<int32_t>(c0),
                          static_cast<int32_t>(std::min(H, c0 + kColBlock))});
  }

  // The three QuantMatrix of expert row r of set s (gate and up share w13's scale grid).
  static void quant_matrices(const MoeCall& c, int64_t s, int64_t r, Expert& ex) {
    const int64_t H = c.H, I = c.I, f = c.q.format;
    const at::Tensor &a = c.w13[s], &b = c.w2[s], &sa = c.q.w13_scale[s], &sb = c.q.w2_scale[s];
    const uint8_t* w13 = static_cast<const uint8_t*>(a.data_ptr()) + r * a.stride(0);
    const uint8_t* w2 = static_cast<const uint8_t*>(b.data_ptr()) + r * b.stride(0);
    const char* s13 = static_cast<const char*>(sa.data_ptr()) + r * sa.stride(0) * sa.element_size();
    const char* s2 = static_cast<const char*>(sb.data_ptr()) + r * sb.stride(0) * sb.element_size();
    const int64_t b13 = weight_row_bytes(f, H), b2 = weight_row_bytes(f, I);
    // gate and up are both w13 addressed from its row 0 (the up rows are I..2I-1, and fp8's
    // 128 x 128 or per-row scale grid covers all 2I rows); they differ only in nvfp4's global
    // scale. fp8 per channel (scales [2I, 1] / [H, 1], check_quant_set): one scale row per
    // weight row, the same scale for every 128-column block.
    const bool channel = f == kFormat_fp8 && fp8_per_channel(sa, 2 * c.I);
    const int64_t div = channel ? 1 : kFp8Block, step = channel ? 0 : 1;
    ex.gate = {static_cast<int32_t>(f), w13, b13, s13, sa.size(2), 1.0f, div, step};
    ex.up = ex.gate;
    ex.down = {static_cast<int32_t>(f), w2, b2, s2, sb.size(2), 1.0f, div, step};
    if (f == kFormat_nvfp4) {
      const float* g13 = c.q.w13_scale_2[s].data_ptr<float>();
      const bool two = c.q.w13_scale_2[s].dim() == 2;
      ex.gate.global = two ? g13[2 * r] : g13[r];
      ex.up.global = two ? g13[2 * r + 1] : g13[r];
      ex.down.global = c.q.w2_scale_2[s].data_ptr<float>()[r];
    }
  }

  void gate_up(const Item& it) {
    const MoeCall& c = *c_;
    const CpuExecutorKernels& k = *c.kern;
    const Expert& ex = experts_[it.a];
    const int64_t H = c.H, I = c.I, m = ex.count, j0 = it.b0, nj = it.b1 - it.b0;
    thread_local std::vector<float> gu;
    thread_local std::vector<float*> yp;
    gu.resize(2 * nj * m);
    yp.resize(m);
    float* G = gu.data();
    float* U = G + nj * m;
    if (c.q.format == kFormat_bf16) {
      const uint16_t* const* x = xp_.data() + ex.first;
      for (int64_t t = 0; t < m; ++t) yp[t] = G + t * nj;
      k.dot_tile(ex.w13 + j0 * H, H, nj, x, m, H, yp.data());
      for (int64_t t = 0; t < m; ++t) yp[t] = U + t * nj;
      k.dot_tile(ex.w13 + (I + j0) * H, H, nj, x, m, H, yp.data());
    } else {
      const float* const* x = xfp_.data() + ex.first;
      for (int64_t t = 0; t < m; ++t) yp[t] = G + t * nj;
      k.dot_q(&ex.gate, j0, nj, x, m, H, yp.data());
      for (int64_t t = 0; t < m; ++t) yp[t] = U + t * nj;
      k.dot_q(&ex.up, I + j0, nj, x, m, H, yp.data());
    }
    if (ex.bias >= 0) {  // fp32 adds to the finished dots: the same value in any tile or split
      const float* bg = bias_.data() + ex.bias + j0;
      const float* bu = bias_.data() + ex.bias + I + j0;
      for (int64_t t = 0; t < m; ++t)
        for (int64_t j = 0; j < nj; ++j) {
          G[t * nj + j] += bg[j];
          U[t * nj + j] += bu[j];
        }
    }
    for (int64_t t = 0; t < m; ++t) {
      uint16_t* h = c.hbuf + (ex.first + t) * I;
      k.glu_bf16(G + t * nj, U + t * nj, nj, &c.ep.act, h + j0);
      if (c.q.format != kFormat_bf16) k.prep_x(c.q.format, h, j0, j0 + nj, I, 0, hfp_[ex.first + t]);
    }
  }

  void down(const Item& it) {
    const MoeCall& c = *c_;
    const Expert& ex = experts_[it.a];
    const int64_t H = c.H, I = c.I, m = ex.count, r0 = it.b0;
    spin_until(p1_done_[it.a], p1_total_[it.a]);
    thread_local std::vector<float*> yp;
    yp.resize(m);
    for (int64_t t = 0; t < m; ++t) yp[t] = c.Y + static_cast<int64_t>(local_[ex.first + t]) * H + r0;
    if (c.q.format == kFormat_bf16)
      c.kern->dot_tile(ex.w2 + r0 * I, I, it.b1 - it.b0, hp_.data() + ex.first, m, I, yp.data());
    else
      c.kern->dot_q(&ex.down, r0, it.b1 - it.b0, hfp_.data() + ex.first, m, I, yp.data());
    if (ex.bias >= 0) {  // the down bias, before the routing weight (transformers' GptOssExperts)
      const float* b2 = bias_.data() + ex.bias + 2 * I + r0;
      for (int64_t t = 0; t < m; ++t)
        for (int64_t r = 0; r < it.b1 - it.b0; ++r) yp[t][r] += b2[r];
    }
  }

  void reduce(const Item& it) {
    const MoeCall& c = *c_;
    const int64_t K = c.K, H = c.H, t = t0_ + it.a, c0 = it.b0;
    spin_until(p2_done_, p2_total_);
    thread_local std::vector<const float*> ys;
    thread_local std::vector<float> ws;
    ys.clear();
    ws.clear();
    const float* tw = c.topk.data_ptr<float>() + t * K;
    for (int64_t k = 0; k < K; ++k) {
      if (c.set_of[t * K + k] < 0) continue;
      ys.push_back(c.Y + (static_cast<int64_t>(it.a) * K + k) * H + c0);
      ws.push_back(tw[k]);
    }
    c.kern->weighted_sum(c.out.data_ptr<float>() + t * H + c0, it.b1 - it.b0, ys.data(), ws.data(),
                         static_cast<int64_t>(ys.size()), c.accumulate ? 1 : 0);
  }

  std::shared_ptr<MoeCall> c_;
  int64_t t0_, t1_;
  std::vector<Expert> experts_;
  std::vector<const uint16_t*> xp_;  // grouped position -> token activations
  std::vector<const uint16_t*> hp_;  // grouped position -> its h row
  std::vector<const float*> xfp_;    // quantized: grouped position -> its x in dot_q's layout
  std::vector<float*> hfp_;          // quantized: grouped position -> its h in dot_q's layout
  std::vector<int32_t> local_;       // grouped position -> entry index in the chunk
  std::vector<float> bias_;          // per expert with biases: fp32 [2I + H] (Expert::bias)
  std::vector<Item> items_;
  std::unique_ptr<int32_t[]> p1_total_;
  std::unique_ptr<std::atomic<int32_t>[]> p1_done_;
  int32_t p2_total_ = 0;
  std::atomic<int32_t> p2_done_{0};
};

#define MOE_CHECK(cond, ...) TORCH_CHECK(cond, "moe_experts_cpu: ", __VA_ARGS__)

// Validates the arguments, resolves each (t,k) to its set and row, and splits
// the tokens into chunk jobs. Returns the jobs (empty when T == 0).
// "bf16 (0), fp8 (1), ...": the formats' names and codes, for error messages.
std::string format_values() {
  std::string out;
  int value = 0;
#define SGLK_EXPERT_FORMAT_VALUE(name)                                                  \
  out += (value ? ", " : "") + std::string(#name) + " (" + std::to_string(value) + ")"; \
  ++value;
  SGLK_EXPERT_FORMATS(SGLK_EXPERT_FORMAT_VALUE)
#undef SGLK_EXPERT_FORMAT_VALUE
  return out;
}

// "silu (0), swiglu_oai (1), ...": the activations' names and codes, for error messages.
std::string activation_values() {
  std::string out;
  int value = 0;
#define SGLK_EXPERT_ACTIVATION_VALUE(name)                                              \
  out += (value ? ", " : "") + std::string(#name) + " (" + std::to_string(value) + ")"; \
  ++value;
  SGLK_EXPERT_ACTIVATIONS(SGLK_EXPERT_ACTIVATION_VALUE)
#undef SGLK_EXPERT_ACTIVATION_VALUE
  return out;
}

const char* format_name(int64_t format) {
#define SGLK_EXPERT_FORMAT_NAME(name) #name,
  static const char* names[] = {SGLK_EXPERT_FORMATS(SGLK_EXPERT_FORMAT_NAME)};
#undef SGLK_EXPERT_FORMAT_NAME
  return names[format];
}

// One per-expert tensor of a bank set: a contiguous CPU tensor of `dtype` and `shape`; `what`
// names upstream's parameter it holds. Errors name the argument ("w13_scale[1]").
void check_bank_tensor(const at::Tensor& t, const char* arg, size_t set, at::ScalarType dtype,
                       const std::vector<int64_t>& shape, int64_t format, const char* what) {
  MOE_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes().vec() == shape, arg, "[", set, "] must be a ",
            c10::IntArrayRef(shape), " ", dtype, " CPU tensor (format ", format_name(format), ": ", what, "), got ",
            t.scalar_type(), " ", t.sizes(), " on ", t.device());
  MOE_CHECK(t.is_contiguous(), arg, "[", set, "] must be contiguous (make the bank contiguous once at load time; ",
            "the op never copies weights)");
}

// The per-set tensors of a quantized format: dtypes and shapes of upstream's create_weights for
// an [N, 2I, H] / [N, H, I] expert pair (isa/cpu_executor_args.h).
void check_quant_set(const QuantBanks& q, size_t i, const at::Tensor& a, const at::Tensor& b, int64_t N, int64_t H,
                     int64_t I) {
  const int64_t f = q.format;
  auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  if (f == kFormat_fp8) {
    check_bank_tensor(a, "w13", i, at::kFloat8_e4m3fn, {N, 2 * I, H}, f, "w13_weight");
    check_bank_tensor(b, "w2", i, at::kFloat8_e4m3fn, {N, H, I}, f, "w2_weight");
    if (fp8_per_channel(q.w13_scale[i], 2 * I)) {  // compressed-tensors FP8, per output channel
      check_bank_tensor(q.w13_scale[i], "w13_scale", i, at::kFloat, {N, 2 * I, 1}, f,
                        "w13_weight_scale, one per output channel");
      check_bank_tensor(q.w2_scale[i], "w2_scale", i, at::kFloat, {N, H, 1}, f,
                        "w2_weight_scale, one per output channel (as w13_scale)");
      return;
    }
    check_bank_tensor(q.w13_scale[i], "w13_scale", i, at::kFloat,
                      {N, ceil_div(2 * I, kFp8Block), ceil_div(H, kFp8Block)}, f,
                      "w13_weight_scale_inv, one per 128 x 128 block");
    check_bank_tensor(q.w2_scale[i], "w2_scale", i, at::kFloat, {N, ceil_div(H, kFp8Block), ceil_div(I, kFp8Block)}, f,
                      "w2_weight_scale_inv, one per 128 x 128 block");
    return;
  }
  const int64_t G = f == kFormat_mxfp4 ? kMxfp4Group : kNvfp4Group;
  MOE_CHECK(H % G == 0 && I % G == 0, "format ", format_name(f), " needs H and I multiples of its scale group ", G,
            ", got H = ", H, ", I = ", I);
  const at::ScalarType sdt = f == kFormat_mxfp4 ? at::kByte : at::kFloat8_e4m3fn;
  const char* sw = f == kFormat_mxfp4 ? "w13_weight_scale, e8m0 per 32" : "w13_weight_scale, e4m3 per 16";
  const char* sw2 = f == kFormat_mxfp4 ? "w2_weight_scale, e8m0 per 32" : "w2_weight_scale, e4m3 per 16";
  check_bank_tensor(a, "w13", i, at::kByte, {N, 2 * I, H / 2}, f, "w13_weight, two e2m1 codes per byte");
  check_bank_tensor(b, "w2", i, at::kByte, {N, H, I / 2}, f, "w2_weight, two e2m1 codes per byte");
  check_bank_tensor(q.w13_scale[i], "w13_scale", i, sdt, {N, 2 * I, H / G}, f, sw);
  check_bank_tensor(q.w2_scale[i], "w2_scale", i, sdt, {N, H, I / G}, f, sw2);
  if (f == kFormat_nvfp4) {
    const at::Tensor& g = q.w13_scale_2[i];
    const bool two = g.dim() == 2;
    check_bank_tensor(g, "w13_scale_2", i, at::kFloat, two ? std::vector<int64_t>{N, 2} : std::vector<int64_t>{N}, f,
                      "w13_weight_scale_2, [N, 2] (gate, up) or [N]");
    check_bank_tensor(q.w2_scale_2[i], "w2_scale_2", i, at::kFloat, {N}, f, "w2_weight_scale_2");
  }
}

// The bias banks of set i (if given): [N, 2I] and [N, H], float32 or bfloat16, contiguous CPU.
void check_epilogue_set(const Epilogue& ep, size_t i, int64_t N, int64_t H, int64_t I) {
  auto check = [&](const std::vector<at::Tensor>& l, const char* arg, int64_t n, const char* what) {
    if (l.empty()) return;
    const at::Tensor& b = l[i];
    MOE_CHECK(b.device().is_cpu() && (b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16) &&
                  b.dim() == 2 && b.size(0) == N && b.size(1) == n,
              arg, "[", i, "] must be a [N_", i, ", ", what, "] = [", N, ", ", n,
              "] float32 or bfloat16 CPU tensor (N_i as w13[i]), got ", b.scalar_type(), " ", b.sizes(), " on ",
              b.device());
    MOE_CHECK(b.is_contiguous(), arg, "[", i, "] must be contiguous (make the bias bank contiguous once at load time)");
  };
  check(ep.w13_bias, "w13_bias", 2 * I, "2*I (gate biases then up biases)");
  check(ep.w2_bias, "w2_bias", H, "H");
}

// Validates the arguments, resolves each (t,k) to its set and row, and splits
// the tokens into chunk jobs. Returns the jobs (empty when T == 0).
std::vector<std::shared_ptr<PoolJob>> make_jobs(const at::Tensor& hidden, const at::Tensor& topk_weights,
                                                const std::vector<at::Tensor>& expert_rows,
                                                const std::vector<at::Tensor>& w13, const std::vector<at::Tensor>& w2,
                                                const at::Tensor& out, bool accumulate, const QuantBanks& q,
                                                const Epilogue& ep) {
  const size_t S = expert_rows.size();
  MOE_CHECK(S >= 1 && w13.size() == S && w2.size() == S,
            "expert_rows, w13 and w2 must be lists of the same length >= 1 (one entry per bank set), got lengths ",
            expert_rows.size(), ", ", w13.size(), ", ", w2.size());
  MOE_CHECK(q.format >= 0 && q.format < kFormatCount, "format must be one of ", format_values(), ", got ", q.format);
  const bool nv = q.format == kFormat_nvfp4, quant = q.format != kFormat_bf16;
  MOE_CHECK(q.w13_scale.size() == (quant ? S : 0) && q.w2_scale.size() == (quant ? S : 0) &&
                q.w13_scale_2.size() == (nv ? S : 0) && q.w2_scale_2.size() == (nv ? S : 0),
            "format ", format_name(q.format), " takes ", quant ? "one" : "no", " w13_scale / w2_scale per bank set",
            nv ? " and one w13_scale_2 / w2_scale_2 per set" : (quant ? " and no w13_scale_2 / w2_scale_2" : ""), " (",
            S, " sets), got lengths ", q.w13_scale.size(), ", ", q.w2_scale.size(), ", ", q.w13_scale_2.size(), ", ",
            q.w2_scale_2.size());
  MOE_CHECK(
      hidden.device().is_cpu() && hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 && hidden.is_contiguous(),
      "hidden must be a contiguous 2-D [T, H] bfloat16 CPU tensor, got ", hidden.scalar_type(), " ", hidden.sizes(),
      hidden.is_contiguous() ? "" : " (not contiguous)", " on ", hidden.device());
  MOE_CHECK(ep.w13_bias.empty() || ep.w13_bias.size() == S, "w13_bias must be None or one tensor per bank set (", S,
            " sets), got ", ep.w13_bias.size());
  MOE_CHECK(ep.w2_bias.empty() || ep.w2_bias.size() == S, "w2_bias must be None or one tensor per bank set (", S,
            " sets), got ", ep.w2_bias.size());
  MOE_CHECK(ep.act.code >= 0 && ep.act.code < kActCount, "activation must be one of ", activation_values(), ", got ",
            ep.act.code);
  MOE_CHECK(
      ep.act.code == kAct_silu || ep.act.code == kAct_gelu_tanh || (std::isfinite(ep.act.limit) && ep.act.limit > 0.0f),
      "limit must be a finite number > 0 for the clamped activations, got ", ep.act.limit);
  MOE_CHECK(ep.act.code != kAct_swiglu_oai || std::isfinite(ep.act.alpha), "alpha must be finite, got ", ep.act.alpha);
  const int64_t T = hidden.size(0), H = hidden.size(1);
  MOE_CHECK(topk_weights.device().is_cpu() && topk_weights.dim() == 2 && topk_weights.scalar_type() == at::kFloat &&
                topk_weights.size(0) == T,
            "topk_weights must be a 2-D [T, K] float32 CPU tensor with T = ", T, " (hidden's rows), got ",
            topk_weights.scalar_type(), " ", topk_weights.sizes());
  const int64_t K = topk_weights.size(1);
  MOE_CHECK(T * K < (int64_t{1} << 31), "T * K = ", T * K, " (t, k) entries exceed 2^31; call in token chunks");
  MOE_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T &&
                out.size(1) == H && out.is_contiguous(),
            "out must be a contiguous [T, H] = [", T, ", ", H, "] float32 CPU tensor, got ", out.scalar_type(), " ",
            out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
  MOE_CHECK(w13[0].dim() == 3 && w13[0].size(1) % 2 == 0,
            "w13[0] must be [N, 2*I, H] (gate rows then up rows), got shape ", w13[0].sizes());
  const int64_t I = w13[0].size(1) / 2;

  auto call = std::make_shared<MoeCall>();
  MoeCall& c = *call;
  c.hidden = hidden;
  c.topk = topk_weights.contiguous();
  c.out = out;
  c.q = q;
  c.ep = ep;
  c.T = T;
  c.K = K;
  c.H = H;
  c.I = I;
  c.XH = quant_x_stride(H);
  c.XI = quant_x_stride(I);
  c.accumulate = accumulate;
  c.kern = &cpu_executor_kernels();
  std::vector<int64_t> N(S);
  for (size_t i = 0; i < S; ++i) {
    const at::Tensor& a = w13[i];
    const at::Tensor& b = w2[i];
    const at::Tensor& r = expert_rows[i];
    if (quant) {
      MOE_CHECK(a.dim() == 3, "w13[", i, "] must be 3-D [N_", i, ", 2*I, ...], got shape ", a.sizes());
      N[i] = a.size(0);
      check_quant_set(q, i, a, b, N[i], H, I);
    } else {
      MOE_CHECK(a.device().is_cpu() && a.scalar_type() == at::kBFloat16 && a.dim() == 3 && a.size(1) == 2 * I &&
                    a.size(2) == H,
                "w13[", i, "] must be a [N_", i, ", 2*I, H] = [N, ", 2 * I, ", ", H, "] bfloat16 CPU tensor, got ",
                a.scalar_type(), " ", a.sizes());
      MOE_CHECK(a.is_contiguous(), "w13[", i,
                "] must be contiguous (make the bank contiguous once at load time; the op ", "never copies weights)");
      N[i] = a.size(0);
      MOE_CHECK(b.device().is_cpu() && b.scalar_type() == at::kBFloat16 && b.dim() == 3 && b.size(0) == N[i] &&
                    b.size(1) == H && b.size(2) == I,
                "w2[", i, "] must be a [N_", i, ", H, I] = [", N[i], ", ", H, ", ", I,
                "] bfloat16 CPU tensor (N_i as w13[i]), got ", b.scalar_type(), " ", b.sizes());
      MOE_CHECK(b.is_contiguous(), "w2[", i,
                "] must be contiguous (make the bank contiguous once at load time; the op ", "never copies weights)");
    }
    MOE_CHECK(r.device().is_cpu() && r.scalar_type() == at::kInt && r.dim() == 2 && r.size(0) == T && r.size(1) == K,
              "expert_rows[", i, "] must be a [T, K] = [", T, ", ", K, "] int32 CPU tensor (K as topk_weights), got ",
              r.scalar_type(), " ", r.sizes());
    check_epilogue_set(ep, i, N[i], H, I);
    c.rows.push_back(r.contiguous());
    c.w13.push_back(a);
    c.w2.push_back(b);
  }

  c.set_of.assign(T * K, -1);
  c.row_of.assign(T * K, -1);
  for (size_t i = 0; i < S; ++i) {
    const int32_t* r = c.rows[i].data_ptr<int32_t>();
    for (int64_t e = 0; e < T * K; ++e) {
      if (r[e] == -1) continue;
      MOE_CHECK(r[e] >= 0 && r[e] < N[i], "expert_rows[", i, "][", e / K, ", ", e % K, "] = ", r[e],
                " is out of range [0, ", N[i], ") of set ", i, " (w13[", i, "].size(0)); use -1 for (t, k) not in ",
                "this set");
      MOE_CHECK(c.set_of[e] < 0, "(t, k) = (", e / K, ", ", e % K, ") has a row in set ", c.set_of[e], " and in set ",
                i, "; each (t, k) may come from at most one set");
      c.set_of[e] = static_cast<int32_t>(i);
      c.row_of[e] = r[e];
    }
  }

  std::vector<std::shared_ptr<PoolJob>> jobs;
  if (T == 0 || H == 0) return jobs;  // nothing to write
  // quantized formats add h in dot_q's layout (fp32) per chunk token, and x in it for all T
  const int64_t q_token = quant ? K * 4 * c.XI : 0;
  const int64_t per_token = std::max<int64_t>(1, K * (4 * H + 2 * I) + q_token);
  const int64_t chunk = std::clamp<int64_t>(scratch_budget() / per_token, 1, T);
  auto align = [](int64_t b) { return (b + 63) / 64 * 64; };
  const int64_t y_bytes = align(chunk * K * H * 4), h_bytes = align(chunk * K * I * 2);
  const int64_t xf_bytes = quant ? align(T * c.XH * 4) : 0, hf_bytes = quant ? chunk * K * c.XI * 4 : 0;
  c.scratch = ScratchCache::get().take(static_cast<size_t>(y_bytes + h_bytes + xf_bytes + hf_bytes + 64));
  c.Y = reinterpret_cast<float*>(c.scratch.get());
  c.hbuf = reinterpret_cast<uint16_t*>(c.scratch.get() + y_bytes);
  if (quant) {
    c.xf = reinterpret_cast<float*>(c.scratch.get() + y_bytes + h_bytes);
    c.hf = reinterpret_cast<float*>(c.scratch.get() + y_bytes + h_bytes + xf_bytes);
  }
  for (int64_t t0 = 0; t0 < T; t0 += chunk)
    jobs.push_back(std::make_shared<MoeChunkJob>(call, t0, std::min(T, t0 + chunk)));
  return jobs;
}

// Sequential read of a buffer: one contiguous slice per pool thread (items are
// slices, so each thread normally streams its own), `passes` times over.
class ReadJob final : public ItemJob {
 public:
  ReadJob(const char* p, int64_t bytes, int64_t passes, int nslices, const CpuExecutorKernels* k)
      : p_(p), slice_(bytes / nslices / 256 * 256), passes_(passes), nslices_(nslices), k_(k) {
    set_items(nslices);
  }
  int64_t bytes_read() const { return slice_ * nslices_ * passes_; }

 protected:
  void do_item(int64_t i, int) override {
    uint64_t acc = 0;
    for (int64_t pass = 0; pass < passes_; ++pass) acc += k_->stream_read(p_ + i * slice_, slice_);
    sink_.fetch_add(acc, std::memory_order_relaxed);
  }

 private:
  const char* p_;
  int64_t slice_, passes_, nslices_;
  const CpuExecutorKernels* k_;
  std::atomic<uint64_t> sink_{0};
};

}  // namespace

QuantBanks quant_banks(int64_t format, const OptTensorList& w13_scale, const OptTensorList& w2_scale,
                       const OptTensorList& w13_scale_2, const OptTensorList& w2_scale_2) {
  QuantBanks q;
  q.format = format;
  auto vec = [](const OptTensorList& l) { return l ? l->vec() : std::vector<at::Tensor>{}; };
  q.w13_scale = vec(w13_scale);
  q.w2_scale = vec(w2_scale);
  q.w13_scale_2 = vec(w13_scale_2);
  q.w2_scale_2 = vec(w2_scale_2);
  return q;
}

Epilogue epilogue(const OptTensorList& w13_bias, const OptTensorList& w2_bias, int64_t activation, double alpha,
                  double limit) {
  Epilogue ep;
  auto vec = [](const OptTensorList& l) { return l ? l->vec() : std::vector<at::Tensor>{}; };
  ep.w13_bias = vec(w13_bias);
  ep.w2_bias = vec(w2_bias);
  MOE_CHECK(activation >= 0 && activation < kActCount, "activation must be one of ", activation_values(), ", got ",
            activation);
  ep.act.code = static_cast<int32_t>(activation);
  ep.act.alpha = static_cast<float>(alpha);
  ep.act.limit = static_cast<float>(limit);
  return ep;
}

void moe_experts_cpu(const at::Tensor& hidden, const at::Tensor& topk_weights, at::TensorList expert_rows,
                     at::TensorList w13, at::TensorList w2, const at::Tensor& out, bool accumulate, int64_t format,
                     const OptTensorList& w13_scale, const OptTensorList& w2_scale, const OptTensorList& w13_scale_2,
                     const OptTensorList& w2_scale_2, const OptTensorList& w13_bias, const OptTensorList& w2_bias,
                     int64_t activation, double alpha, double limit) {
  auto jobs = make_jobs(hidden, topk_weights, expert_rows.vec(), w13.vec(), w2.vec(), out, accumulate,
                        quant_banks(format, w13_scale, w2_scale, w13_scale_2, w2_scale_2),
                        epilogue(w13_bias, w2_bias, activation, alpha, limit));
  if (jobs.empty()) return;
  ExpertPool& pool = ExpertPool::get();
  wait_and_release(pool, pool.submit(std::move(jobs)));
}

int64_t moe_experts_cpu_submit(const at::Tensor& hidden, const at::Tensor& topk_weights, at::TensorList expert_rows,
                               at::TensorList w13, at::TensorList w2, const at::Tensor& out, bool accumulate,
                               int64_t format, const OptTensorList& w13_scale, const OptTensorList& w2_scale,
                               const OptTensorList& w13_scale_2, const OptTensorList& w2_scale_2,
                               const OptTensorList& w13_bias, const OptTensorList& w2_bias, int64_t activation,
                               double alpha, double limit) {
  auto jobs = make_jobs(hidden, topk_weights, expert_rows.vec(), w13.vec(), w2.vec(), out, accumulate,
                        quant_banks(format, w13_scale, w2_scale, w13_scale_2, w2_scale_2),
                        epilogue(w13_bias, w2_bias, activation, alpha, limit));
  return ExpertPool::get().submit(std::move(jobs));
}

void moe_experts_cpu_wait(int64_t handle) { wait_and_release(ExpertPool::get(), handle); }

int64_t expert_pool_set_threads(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= 4096, "expert_pool_set_threads: n must be in [0, 4096] (0 = one per physical core), got ",
              n);
  GilRelease nogil;  // may wait for queued jobs
  return ExpertPool::get().set_threads(static_cast<int>(n));
}

std::string expert_pool_info() { return ExpertPool::get().info(); }

std::vector<std::string> expert_activation_names() {
#define SGLK_EXPERT_ACTIVATION_NAME(name) #name,
  return {SGLK_EXPERT_ACTIVATIONS(SGLK_EXPERT_ACTIVATION_NAME)};
#undef SGLK_EXPERT_ACTIVATION_NAME
}

std::vector<std::string> expert_format_names() {
#define SGLK_EXPERT_FORMAT_NAME(name) #name,
  return {SGLK_EXPERT_FORMATS(SGLK_EXPERT_FORMAT_NAME)};
#undef SGLK_EXPERT_FORMAT_NAME
}

double expert_pool_read_bandwidth(const at::Tensor& buffer, int64_t passes) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(),
              "expert_pool_read_bandwidth: buffer must be a contiguous CPU tensor");
  TORCH_CHECK(passes >= 1, "expert_pool_read_bandwidth: passes must be >= 1, got ", passes);
  const char* p = static_cast<const char*>(buffer.data_ptr());
  const int64_t skip = (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
  const int64_t bytes = buffer.nbytes() - skip;
  ExpertPool& pool = ExpertPool::get();
  const int nw = pool.parallelism();
  TORCH_CHECK(bytes >= 256 * nw, "expert_pool_read_bandwidth: buffer too small (", buffer.nbytes(), " bytes)");
  auto job = std::make_shared<ReadJob>(p + skip, bytes, passes, nw, &cpu_executor_kernels());
  const auto t0 = std::chrono::steady_clock::now();
  wait_and_release(pool, pool.submit({job}));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(job->bytes_read()) / s / 1e9;
}

}  // namespace sglk
