// inplace_abn::forward_ on CUDA (kernels: coef_kernel, forward_kernel).
#include "backend_cuda.cuh"
#include "op_forward.h"

namespace inplace_abn {
namespace cuda_ops {

at::Tensor forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& residual, double eps, int64_t activation,
                    double activation_param, bool signed_weight) {
  return gpu::forward_(x, mean, var, weight, bias, residual, eps, activation, activation_param, signed_weight);
}

}  // namespace cuda_ops
}  // namespace inplace_abn
