// inplace_abn::backward_reduce: per-channel S_g = sum gz and S_gx = sum gz xhat, from the output y alone.
// Kernels: src/cpu/backward_reduce_kernel.cpp, src/cuda/backward_reduce_kernel.cu.
#include "ops/backward_passes.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub backward_reduce_stub;

void reduce_pass(const Groups& grp, const at::Tensor& y, const at::Tensor& gy, bool kernel_relu,
                 const at::Tensor& mask, const OptTensor& weight, const OptTensor& bias, const at::Tensor& res,
                 double eps, Act act, double param, bool signed_weight, const at::Tensor& z, const at::Tensor& sum_gz,
                 const at::Tensor& sum_gz_xhat) {
  const std::array<ChannelInput, 2> in{grp.param(bias, 0.0, y, "bias"), grp.param(weight, 1.0, y, "weight")};
  const at::Tensor yv = grp.view(y);
  const at::Tensor coef = coef_table<Table::Reduce>(
      yv, in, {.eps = eps, .has_weight = weight.has_value(), .signed_weight = signed_weight}, grp.columns(y));
  grp.run(backward_reduce_stub,
          {.x = yv, .dy = grp.view(gy), .residual = grp.view(res), .mask = mask, .coef = coef, .out1 = sum_gz,
           .out2 = sum_gz_xhat, .z = grp.view(z), .relu = kernel_relu, .g = geometry_of(yv, "y"), .act = act,
           .param = param},
          true);
}

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                   const OptTensor& weight, const OptTensor& bias,
                                                   const OptTensor& residual, double eps, int64_t activation,
                                                   double activation_param, bool signed_weight,
                                                   const OptTensor& z_out, int64_t groups, bool relu) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  const auto [gy, kernel_relu] = relu_dy(dy, y, act, relu);
  if (z_out.has_value()) check_z(*z_out, y, act, "z_out");
  const Groups grp(y, groups);
  const auto opts = y.options().dtype(acc_type_of(y.scalar_type()));
  // per channel, or per (n, c) for GroupNorm
  const auto shape = grp.G ? std::vector<int64_t>{y.size(0), y.size(1)} : std::vector<int64_t>{y.size(1)};
  if (y.numel() == 0) return {at::zeros(shape, opts), at::zeros(shape, opts)};
  c10::OptionalDeviceGuard guard(y.device());
  const at::Tensor sum_gz = new_empty(shape, opts), sum_gz_xhat = new_empty(shape, opts);
  const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
  reduce_pass(grp, y, like(gy, y), kernel_relu, mask, weight, bias, like(residual, y), eps, act, activation_param,
              signed_weight, z_out.value_or(at::Tensor()), sum_gz, sum_gz_xhat);
  return {sum_gz, sum_gz_xhat};
}

}  // namespace inplace_abn
