// The CUDA operators registered by register.cu; each is defined in its own
// translation unit (batch_stats.cu, forward.cu, backward_reduce.cu,
// backward_input.cu) around the shared host code of ops_impl.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace inplace_abn {
namespace cuda_ops {

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x);

at::Tensor forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& residual, double eps, int64_t activation,
                    double activation_param, bool signed_weight);

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                   const std::optional<at::Tensor>& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   const std::optional<at::Tensor>& residual, double eps,
                                                   int64_t activation, double activation_param, bool signed_weight);

std::tuple<at::Tensor, at::Tensor> backward_input(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                  const at::Tensor& var, const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  const std::optional<at::Tensor>& residual,
                                                  const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat,
                                                  double eps, int64_t activation, double activation_param,
                                                  bool signed_weight, bool residual_grad);

}  // namespace cuda_ops
}  // namespace inplace_abn
