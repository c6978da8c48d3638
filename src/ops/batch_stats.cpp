// inplace_abn::batch_stats: per-channel mean and biased variance, in the
// accumulation dtype. Kernels: src/cpu/batch_stats_kernel.cpp,
// src/cuda/batch_stats_kernel.cu.
#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub batch_stats_stub;

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x) {
  check_input(x, "x");
  const auto opts = x.options().dtype(acc_type_of(x.scalar_type()));
  if (x.numel() == 0) return {at::zeros({x.size(1)}, opts), at::zeros({x.size(1)}, opts)};
  c10::OptionalDeviceGuard guard(x.device());
  const at::Tensor mean = at::empty({x.size(1)}, opts), var = at::empty({x.size(1)}, opts);
  batch_stats_stub({.x = x, .out1 = mean, .out2 = var, .g = geometry_of(x, "x")});
  return {mean, var};
}

}  // namespace inplace_abn
