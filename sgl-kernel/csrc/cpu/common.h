// Shared helpers of the torch-facing operators (baseline ISA only; the SIMD
// kernels live in isa/ and never include this header).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <optional>
#include <string>
#include <vector>

#include "isa/cpu_executor_args.h"
#include "isa/kernel_args.h"

namespace sglk {

// A schema's `Tensor[]? name=None` (a list argument with a default: `Tensor[]` cannot have one).
using OptTensorList = std::optional<at::TensorList>;

// Kernel table of the ISA selected at load time (see dispatch.cpp).
const IsaKernels& kernels();
// Kernel table of the CPU executor for the same level.
const CpuExecutorKernels& cpu_executor_kernels();
// Name of the selected ISA level: "avx512bf16", "avx512", "avx2" or "scalar".
std::string current_isa();
// Select an ISA level by name ("auto", "avx512bf16", "avx512", "avx2",
// "scalar"); errors if the CPU lacks it. Returns the name now in use.
std::string select_isa(const std::string& name);

inline DT dt_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DT::F32;
    case at::kBFloat16:
      return DT::BF16;
    default:
      TORCH_CHECK(false, what, ": unsupported dtype ", t.scalar_type(), " (float32 and bfloat16 are supported)");
  }
  return DT::F32;
}

// Element index as int64 from an integer tensor of any width.
inline std::vector<int64_t> to_int64_vector(const at::Tensor& t, const char* what) {
  TORCH_CHECK(!at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool, what,
              " must be an integer tensor, got ", t.scalar_type());
  at::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

inline at::Tensor as_float_contig(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

#define SGLK_CHECK_CPU(x) TORCH_CHECK((x).device().is_cpu(), #x " must be a CPU tensor, got ", (x).device())
#define SGLK_CHECK_DIM(x, d) TORCH_CHECK((x).dim() == (d), #x " must be ", d, "-D, got shape ", (x).sizes())

}  // namespace sglk
