// inplace_abn::backward_input on CUDA (kernels: coef_kernel, backward_input_kernel).
#include "backend_cuda.cuh"
#include "op_backward_input.h"

namespace inplace_abn {
namespace cuda_ops {

std::tuple<at::Tensor, at::Tensor> backward_input(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                  const at::Tensor& var, const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  const std::optional<at::Tensor>& residual,
                                                  const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat,
                                                  double eps, int64_t activation, double activation_param,
                                                  bool signed_weight, bool residual_grad) {
  return gpu::backward_input(y, dy, mask, var, weight, bias, residual, mean_gz, mean_gz_xhat, eps, activation,
                             activation_param, signed_weight, residual_grad);
}

}  // namespace cuda_ops
}  // namespace inplace_abn
