// The CUDA build registers the same device-agnostic front ends (src/ops) for
// the CUDA dispatch key; their stubs run the kernels of src/cuda.
#include <torch/library.h>

#include "ops/ops.h"

TORCH_LIBRARY_IMPL(inplace_abn, CUDA, m) { IABN_IMPL_ALL(m); }
