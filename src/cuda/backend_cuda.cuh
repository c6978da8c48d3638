// CUDA backend of ops_impl.h (see the interface described there): current
// stream, device guard, launches with error checks. Included by the per-operator
// translation units (batch_stats.cu, forward.cu, backward_reduce.cu,
// backward_input.cu), each of which then includes its operator's op_*.h: a
// parallel build compiles them side by side.
//
// Only c10 CUDA headers (not ATen/cuda/CUDAContext.h, which pulls in the
// cuBLAS / cuSPARSE headers): c10::cuda::getCurrentCUDAStream() is the stream
// at::cuda::getCurrentCUDAStream() returns.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <utility>

#include "kernels.cuh"
#include "ops_cuda.h"

namespace inplace_abn {
namespace gpu {
namespace backend {

using Stream = cudaStream_t;

inline Stream stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Attribute query of the current device (set by the Guard): no synchronisation.
inline int sm_count() {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return sms > 0 ? sms : 1;
}

constexpr int64_t kMaxGridY = 65535;
// Largest block-count multiple accepted for the fixed-channel element-wise
// grids (ew_config in ops_impl.h).
constexpr int64_t kMaxFixedBlocks = 8192;

inline void check_device(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.is_cuda(), "inplace_abn (CUDA): ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == x.device(), "inplace_abn (CUDA): ", name, " is on ", t.device(), " but the input is on ",
              x.device());
}

struct Guard {
  explicit Guard(const at::Tensor& x) : guard_(x.device()) {}
  c10::cuda::CUDAGuard guard_;
};

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, Stream s, Args&&... args) {
  kernel<<<grid, block, 0, s>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace backend
}  // namespace gpu
}  // namespace inplace_abn

