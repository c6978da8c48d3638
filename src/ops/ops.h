// The device-agnostic front ends of the operators (schemas: src/ops/library.cpp),
// registered for CPU by src/ops/library.cpp and for CUDA by src/cuda/register.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace inplace_abn {

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x, const std::optional<at::Tensor>& running_mean,
                                               const std::optional<at::Tensor>& running_var, double momentum,
                                               int64_t groups);

at::Tensor forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& residual, double eps, int64_t activation,
                    double activation_param, bool signed_weight, const std::optional<at::Tensor>& z_out,
                    int64_t groups, const std::optional<at::Tensor>& source);

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                   const std::optional<at::Tensor>& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   const std::optional<at::Tensor>& residual, double eps,
                                                   int64_t activation, double activation_param, bool signed_weight,
                                                   const std::optional<at::Tensor>& z_out, int64_t groups, bool relu);

std::tuple<at::Tensor, at::Tensor> backward_input(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                  const at::Tensor& var, const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  const std::optional<at::Tensor>& residual,
                                                  const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat,
                                                  double eps, int64_t activation, double activation_param,
                                                  bool signed_weight, bool residual_grad, double sums_scale,
                                                  int64_t groups, bool relu);

at::Tensor weight_grad(const at::Tensor& sum_gz_xhat, const at::Tensor& weight, bool signed_weight);

at::Tensor backward_input_from_z_(const at::Tensor& z, const at::Tensor& y, const at::Tensor& dy, const at::Tensor& var,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual, const at::Tensor& mean_gz,
                                  const at::Tensor& mean_gz_xhat, double eps, int64_t activation,
                                  double activation_param, bool signed_weight, bool residual_grad,
                                  double sums_scale, int64_t groups, const std::optional<at::Tensor>& dx_out);

// The local BatchNorm layer's training forward: batch_stats, then forward_ with its statistics; returns forward_'s
// mask and the batch's mean and biased var.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_forward_(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& residual, double momentum, double eps, int64_t activation,
    double activation_param, bool signed_weight, const std::optional<at::Tensor>& z_out,
    const std::optional<at::Tensor>& source);

// The functional twins of forward_ and bn_forward_ (src/ops/functional_forward.cpp): (y, z, mask) and
// (y, z, mask, mean, var), y a new tensor in x's layout, z ReLU's pre-activation (keep_z) or empty; bn_forward takes
// no running statistics.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& mean,
                                                       const at::Tensor& var, const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       const std::optional<at::Tensor>& residual, double eps,
                                                       int64_t activation, double activation_param,
                                                       bool signed_weight, bool keep_z, int64_t groups);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, double eps, int64_t activation, double activation_param,
    bool signed_weight, bool keep_z);

// The local BatchNorm layer's whole backward: dx, dweight, dbias, dresidual (those
// output_mask leaves out: empty tensors).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_backward(
    const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, double eps, int64_t activation, double activation_param,
    bool signed_weight, bool training, std::array<bool, 4> output_mask, bool relu,
    const std::optional<at::Tensor>& dx_out);
// Whether bn_backward on y writes dx straight into a dx_out (the CPU, but SiLU's two-pass path; elsewhere through
// a new tensor and a copy).
bool bn_backward_dx_direct(const at::Tensor& y, int64_t activation);

// The GroupNorm backward (groups > 0): dx, dresidual and the (C,) sums over the batch.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gn_backward(
    const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, int64_t groups, double eps, int64_t activation,
    double activation_param, bool signed_weight, bool residual_grad);

// The same front ends for a device's dispatch key.
#define IABN_IMPL_ALL(m)                                      \
  m.impl("batch_stats", &::inplace_abn::batch_stats);         \
  m.impl("forward_", &::inplace_abn::forward_);               \
  m.impl("bn_forward_", &::inplace_abn::bn_forward_);         \
  m.impl("forward", &::inplace_abn::forward);                 \
  m.impl("bn_forward", &::inplace_abn::bn_forward);           \
  m.impl("backward_reduce", &::inplace_abn::backward_reduce); \
  m.impl("backward_input", &::inplace_abn::backward_input);   \
  m.impl("weight_grad", &::inplace_abn::weight_grad);         \
  m.impl("bn_backward", &::inplace_abn::bn_backward);         \
  m.impl("gn_backward", &::inplace_abn::gn_backward)

// CPU only (docs/DESIGN.md section 7.2)
#define IABN_IMPL_CPU_ONLY(m) m.impl("backward_input_from_z_", &::inplace_abn::backward_input_from_z_)

}  // namespace inplace_abn
