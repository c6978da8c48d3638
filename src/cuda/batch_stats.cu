// inplace_abn::batch_stats on CUDA (kernels: stats_*_kernel, finalize_stats_kernel).
#include "backend_cuda.cuh"
#include "op_batch_stats.h"

namespace inplace_abn {
namespace cuda_ops {

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x) { return gpu::batch_stats(x); }

}  // namespace cuda_ops
}  // namespace inplace_abn
