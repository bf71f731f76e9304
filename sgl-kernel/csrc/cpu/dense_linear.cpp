// Dense bf16 linear of the decode step on the CPU executor's pool:
//
//   dense_linear_cpu(x [M, K] bf16, weight [N, K] bf16, bias [N] bf16|f32 or None)
//     -> y [M, N] bf16,  y = bf16(x @ weight.T + bias)
//
// For the few rows of a decode step (M <= kDenseLinearMaxRows) a linear reads its whole weight
// once per step and does 2 FLOPs per weight element, so it is bound by memory bandwidth, as
// the routed experts are. MKL's bf16 GEMV reaches 25-30 GB/s here (issue 18's profile of the
// lm_head, qkv_proj and o_proj); this op streams the weight with the executor's dot kernels
// (isa/cpu_executor_kernels.h: vdpbf16ps with AVX512_BF16, fp32 FMA otherwise) on the executor's
// pinned pool (cpu_executor_pool.h), so dense and expert work share one set of threads.
//
// Work items are disjoint blocks of output features (rows of weight, ~kItemBytes of weights
// each), taken from one atomic counter by every pool thread; each item computes its rows'
// dots with every x row (one weight row read once for all M tokens) and writes its y columns.
//
// Numerics: every y[m][n] is one fp32 dot of K exact bf16 x bf16 products computed whole by
// one thread with the same operation sequence wherever its row falls (the dot_tile contract
// of isa/cpu_executor_args.h), then + bias in fp32, then one rounding to bf16 (nearest-even).
// So y is bit-identical for any thread count and item size (for one ISA level).
//
// Layout: x and weight need unit stride along K; their row strides may be anything (a slice
// of a fused weight, a view of hidden states). Other layouts, dtypes, devices, M outside
// [0, kDenseLinearMaxRows] and shape mismatches raise with the argument named.
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "common.h"
#include "cpu_executor_pool.h"

namespace sglk {
// Rows (tokens) the op takes: the executor's dot tiles keep every token of a weight tile in
// registers up to 4 (DOT_CMAX); beyond that a GEMM with weight reuse (torch's) is the right tool.
constexpr int64_t kDenseLinearMaxRows = 16;

namespace {

// Weight bytes per work item: small enough that every thread gets several items of even a
// small projection (balance), large enough that the counter is touched rarely.
constexpr int64_t kItemBytes = 128 * 1024;
constexpr int64_t kItemRowAlign = 16;

#define DL_CHECK(cond, ...) TORCH_CHECK(cond, "dense_linear_cpu: ", __VA_ARGS__)

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16_bits(float f) {  // nearest-even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

class DenseLinearJob final : public ItemJob {
 public:
  DenseLinearJob(at::Tensor x, at::Tensor w, at::Tensor bias, at::Tensor y, int64_t rows_per_item)
      : x_(std::move(x)), w_(std::move(w)), bias_(std::move(bias)), y_(std::move(y)), rb_(rows_per_item) {
    M_ = x_.size(0);
    K_ = x_.size(1);
    N_ = w_.size(0);
    w_rs_ = w_.stride(0);
    k_ = &cpu_executor_kernels();
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x_.data_ptr());
    for (int64_t m = 0; m < M_; ++m) xrows_[m] = xp + m * x_.stride(0);
    set_items((N_ + rb_ - 1) / rb_);
  }

  void release() override {
    x_ = at::Tensor();
    w_ = at::Tensor();
    bias_ = at::Tensor();
    y_ = at::Tensor();
  }

 protected:
  void do_item(int64_t i, int) override {
    const int64_t n0 = i * rb_, nb = std::min(rb_, N_ - n0);
    const uint16_t* w = reinterpret_cast<const uint16_t*>(w_.data_ptr()) + n0 * w_rs_;
    // fp32 dots of this item, [M][nb]: at most kDenseLinearMaxRows x rows_per_item floats
    std::vector<float> acc(static_cast<size_t>(M_ * nb));
    float* yp[kDenseLinearMaxRows];
    for (int64_t m = 0; m < M_; ++m) yp[m] = acc.data() + m * nb;
    k_->dot_tile(w, w_rs_, nb, xrows_, M_, K_, yp);
    const float* b = bias_.defined() ? bias_.data_ptr<float>() + n0 : nullptr;
    uint16_t* y = reinterpret_cast<uint16_t*>(y_.data_ptr());
    for (int64_t m = 0; m < M_; ++m) {
      uint16_t* ym = y + m * N_ + n0;
      for (int64_t r = 0; r < nb; ++r) ym[r] = f32_to_bf16_bits(b ? yp[m][r] + b[r] : yp[m][r]);
    }
  }

 private:
  at::Tensor x_, w_, bias_, y_;
  int64_t M_ = 0, K_ = 0, N_ = 0, w_rs_ = 0, rb_ = 1;
  const uint16_t* xrows_[kDenseLinearMaxRows] = {};
  const CpuExecutorKernels* k_ = nullptr;
};

// Output features per item: ~kItemBytes of weights, a multiple of kItemRowAlign, and small
// enough that each pool thread gets at least two items when N allows.
int64_t rows_per_item(int64_t N, int64_t K, int threads) {
  const int64_t row_bytes = std::max<int64_t>(1, 2 * K);
  int64_t rb = std::max<int64_t>(kItemRowAlign, kItemBytes / row_bytes / kItemRowAlign * kItemRowAlign);
  const int64_t spread = (N + 2 * threads - 1) / (2 * threads);
  const int64_t spread_aligned = (spread + kItemRowAlign - 1) / kItemRowAlign * kItemRowAlign;
  return std::max<int64_t>(1, std::min(rb, spread_aligned));
}

}  // namespace

at::Tensor dense_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  DL_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x and weight must be CPU tensors, got ", x.device(),
           " and ", weight.device());
  DL_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
           "x and weight must be bfloat16, got ", x.scalar_type(), " and ", weight.scalar_type());
  DL_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [M, K] and weight [N, K], got shapes ", x.sizes(), " and ",
           weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  DL_CHECK(weight.size(1) == K, "x has K = ", K, " columns but weight is ", weight.sizes(), " (expected [N, ", K, "])");
  DL_CHECK(M <= kDenseLinearMaxRows, "x has ", M, " rows; the op takes at most ", kDenseLinearMaxRows,
           " (use torch's GEMM for prefill)");
  DL_CHECK((K <= 1 || x.stride(1) == 1) && (K <= 1 || weight.stride(1) == 1),
           "x and weight need unit stride along K, got strides ", x.strides(), " and ", weight.strides());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    DL_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, "bias must be a CPU tensor [", N,
             "], got ", bias->sizes(), " on ", bias->device());
    DL_CHECK(bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat,
             "bias must be bfloat16 or float32, got ", bias->scalar_type());
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  if (K == 0) {
    if (b.defined())
      y.copy_(b.unsqueeze(0).expand({M, N}));
    else
      y.zero_();
    return y;
  }
  ExpertPool& pool = ExpertPool::get();
  auto job = std::make_shared<DenseLinearJob>(x, weight, b, y, rows_per_item(N, K, pool.parallelism()));
  wait_and_release(pool, pool.submit({job}));
  return y;
}

}  // namespace sglk

// Its own fragment, like extend_attention's: the op stands apart from upstream's CPU names.
TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("dense_linear_cpu(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("dense_linear_cpu_max_rows() -> int", [] { return sglk::kDenseLinearMaxRows; });
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) { m.impl("dense_linear_cpu", &sglk::dense_linear_cpu); }
