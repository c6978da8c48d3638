// Registers the CUDA implementations of the inplace_abn operators (schemas:
// src/ops.cpp). Kernels: kernels.cuh; host side: ops_impl.h, backend_cuda.cuh.
#include <torch/library.h>

#include "ops_cuda.h"

TORCH_LIBRARY_IMPL(inplace_abn, CUDA, m) {
  m.impl("batch_stats", &inplace_abn::cuda_ops::batch_stats);
  m.impl("forward_", &inplace_abn::cuda_ops::forward_);
  m.impl("backward_reduce", &inplace_abn::cuda_ops::backward_reduce);
  m.impl("backward_input", &inplace_abn::cuda_ops::backward_input);
}
