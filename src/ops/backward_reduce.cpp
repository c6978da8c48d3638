// inplace_abn::backward_reduce: per-channel S_g = sum gz and S_gx = sum gz xhat,
// from the output y alone. Kernels: src/cpu/backward_reduce_kernel.cpp,
// src/cuda/backward_reduce_kernel.cu.
#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub backward_reduce_stub;

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                   const OptTensor& weight, const OptTensor& bias,
                                                   const OptTensor& residual, double eps, int64_t activation,
                                                   double activation_param, bool signed_weight,
                                                   const OptTensor& z_out) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  if (z_out.has_value()) check_z(*z_out, y, act, "z_out");
  const auto opts = y.options().dtype(acc_type_of(y.scalar_type()));
  if (y.numel() == 0) return {at::zeros({y.size(1)}, opts), at::zeros({y.size(1)}, opts)};
  c10::OptionalDeviceGuard guard(y.device());
  const at::Tensor sum_gz = at::empty({y.size(1)}, opts), sum_gz_xhat = at::empty({y.size(1)}, opts);
  const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
  const at::Tensor coef = coef_table<2>(y, {{{bias, 0.0}, {weight, 1.0}}}, [&](const auto& v) {
    return std::array{v[0], gain(v[1], weight.has_value(), eps, signed_weight)};
  });
  backward_reduce_stub({.x = y, .dy = like(dy, y), .residual = like(residual, y), .mask = mask, .coef = coef,
                        .out1 = sum_gz, .out2 = sum_gz_xhat, .z = z_out.value_or(at::Tensor()),
                        .g = geometry_of(y, "y"), .act = act,
                        .param = activation_param});
  return {sum_gz, sum_gz_xhat};
}

}  // namespace inplace_abn
