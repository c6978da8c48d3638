// inplace_abn::backward_input: dx = g~ r (gz - k mean_gz - xhat k mean_gz_xhat), k = sums_scale,
// and gz (the residual's gradient) when asked; backward_input_from_z_: the same
// from z = f^-1(y) stored by backward_reduce, dx written over z. Kernels:
// src/cpu/backward_input_kernel.cpp, src/cuda/backward_input_kernel.cu.
#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub backward_input_stub;

namespace {

void check_vectors(const at::Tensor& y, const at::Tensor& var, const at::Tensor& mean_gz,
                   const at::Tensor& mean_gz_xhat) {
  check_channel_vector(var, y, "var");
  check_channel_vector(mean_gz, y, "mean_gz");
  check_channel_vector(mean_gz_xhat, y, "mean_gz_xhat");
}

// a = g~ r, b = -r k mean_gz_xhat, c0 = -g~ r k mean_gz (rows of kernel.h's InputRow),
// k = sums_scale; k = 0 (eval: the statistics are constants) drops the sums, whatever they hold
at::Tensor input_coefs(const at::Tensor& y, const at::Tensor& var, const OptTensor& weight, const OptTensor& bias,
                       const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat, double eps, bool signed_weight,
                       double sums_scale) {
  const OptTensor mgx = sums_scale == 0.0 ? OptTensor() : OptTensor(mean_gz_xhat);
  const OptTensor mg = sums_scale == 0.0 ? OptTensor() : OptTensor(mean_gz);
  return coef_table<5>(
      y, {{{var, 0.0}, {weight, 1.0}, {bias, 0.0}, {mgx, 0.0}, {mg, 0.0}}}, [&](const auto& v) {
        const auto r = inv_std(v[0], eps), a_gz = gain(v[1], weight.has_value(), eps, signed_weight) * r;
        return std::array{v[2], a_gz, -r * (v[3] * sums_scale), -a_gz * (v[4] * sums_scale)};
      });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> backward_input(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                  const at::Tensor& var, const OptTensor& weight,
                                                  const OptTensor& bias, const OptTensor& residual,
                                                  const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat,
                                                  double eps, int64_t activation, double activation_param,
                                                  bool signed_weight, bool residual_grad, double sums_scale) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  check_vectors(y, var, mean_gz, mean_gz_xhat);
  const Geometry g = y.numel() > 0 ? geometry_of(y, "y") : Geometry{};  // the layout check before allocating
  // y's dtype and memory format (a dense tensor keeps its strides)
  at::Tensor dx = at::empty_like(y, at::MemoryFormat::Preserve);
  at::Tensor dres = residual_grad ? at::empty_like(y, at::MemoryFormat::Preserve) : at::empty({0}, y.options());
  if (y.numel() == 0) return {dx, dres};
  c10::OptionalDeviceGuard guard(y.device());
  const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
  const at::Tensor coef = input_coefs(y, var, weight, bias, mean_gz, mean_gz_xhat, eps, signed_weight, sums_scale);
  backward_input_stub({.x = y, .dy = like(dy, y), .residual = like(residual, y), .mask = mask, .coef = coef,
                       .out1 = dx, .out2 = residual_grad ? dres : at::Tensor(), .g = g, .act = act,
                       .param = activation_param});
  return {dx, dres};
}

at::Tensor backward_input_from_z_(const at::Tensor& z, const at::Tensor& dy, const at::Tensor& var,
                                  const OptTensor& weight, const OptTensor& bias, const OptTensor& residual,
                                  const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat, double eps,
                                  int64_t activation, double activation_param, bool signed_weight,
                                  bool residual_grad, double sums_scale) {
  check_input(z, "z");
  const Act act = to_act(activation);
  check_z(z, z, act, "z");
  check_like(dy, z, "dy");
  check_channel_vector(weight, z, "weight");
  check_channel_vector(bias, z, "bias");
  check_like(residual, z, "residual");
  check_vectors(z, var, mean_gz, mean_gz_xhat);
  const Geometry g = z.numel() > 0 ? geometry_of(z, "z") : Geometry{};
  at::Tensor dres = residual_grad ? at::empty_like(z, at::MemoryFormat::Preserve) : at::empty({0}, z.options());
  if (z.numel() == 0) return dres;
  const TableGuard table_guard;
  const at::Tensor coef = input_coefs(z, var, weight, bias, mean_gz, mean_gz_xhat, eps, signed_weight, sums_scale);
  backward_input_stub({.x = z, .dy = like(dy, z), .residual = like(residual, z), .coef = coef, .out1 = z,
                       .out2 = residual_grad ? dres : at::Tensor(), .from_z = true, .g = g, .act = act,
                       .param = activation_param});
  return dres;
}

}  // namespace inplace_abn
