// inplace_abn::backward_input: dx = g~ r (gz - k mean_gz - xhat k mean_gz_xhat), k = sums_scale,
// and gz (the residual's gradient) when asked. Kernels:
// src/cpu/backward_input_kernel.cpp, src/cuda/backward_input_kernel.cu.
#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub backward_input_stub;

std::tuple<at::Tensor, at::Tensor> backward_input(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                  const at::Tensor& var, const OptTensor& weight,
                                                  const OptTensor& bias, const OptTensor& residual,
                                                  const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat,
                                                  double eps, int64_t activation, double activation_param,
                                                  bool signed_weight, bool residual_grad, double sums_scale) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  check_channel_vector(var, y, "var");
  check_channel_vector(mean_gz, y, "mean_gz");
  check_channel_vector(mean_gz_xhat, y, "mean_gz_xhat");
  const Geometry g = y.numel() > 0 ? geometry_of(y, "y") : Geometry{};  // the layout check before allocating
  // y's dtype and memory format (a dense tensor keeps its strides)
  at::Tensor dx = at::empty_like(y, at::MemoryFormat::Preserve);
  at::Tensor dres = residual_grad ? at::empty_like(y, at::MemoryFormat::Preserve) : at::empty({0}, y.options());
  if (y.numel() == 0) return {dx, dres};
  c10::OptionalDeviceGuard guard(y.device());
  const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
  // k = 0 (eval: the statistics are constants) drops the sums, whatever they hold
  const OptTensor mgx = sums_scale == 0.0 ? OptTensor() : OptTensor(mean_gz_xhat);
  const OptTensor mg = sums_scale == 0.0 ? OptTensor() : OptTensor(mean_gz);
  const at::Tensor coef = coef_table<5>(
      y, {{{var, 0.0}, {weight, 1.0}, {bias, 0.0}, {mgx, 0.0}, {mg, 0.0}}}, [&](const auto& v) {
        // a = g~ r, b = -r k mean_gz_xhat, c0 = -g~ r k mean_gz
        const auto r = inv_std(v[0], eps), a_gz = gain(v[1], weight.has_value(), eps, signed_weight) * r;
        return std::array{v[2], a_gz, -r * (v[3] * sums_scale), -a_gz * (v[4] * sums_scale)};
      });
  backward_input_stub({.x = y, .dy = like(dy, y), .residual = like(residual, y), .mask = mask, .coef = coef,
                       .out1 = dx, .out2 = residual_grad ? dres : at::Tensor(), .g = g, .act = act,
                       .param = activation_param});
  return {dx, dres};
}

}  // namespace inplace_abn
