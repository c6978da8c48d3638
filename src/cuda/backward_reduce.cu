// inplace_abn::backward_reduce on CUDA (kernels: coef_kernel, bwd_reduce_*_kernel,
// finalize_sums_kernel).
#include "backend_cuda.cuh"
#include "op_backward_reduce.h"

namespace inplace_abn {
namespace cuda_ops {

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                   const std::optional<at::Tensor>& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   const std::optional<at::Tensor>& residual, double eps,
                                                   int64_t activation, double activation_param, bool signed_weight) {
  return gpu::backward_reduce(y, dy, mask, weight, bias, residual, eps, activation, activation_param, signed_weight);
}

}  // namespace cuda_ops
}  // namespace inplace_abn
