// The CUDA backend (src/cuda/ops_impl.h, op_*.h, kernels.cuh) compiled for the CPU
// emulator, registered as the operators of a separate library,
// inplace_abn_emu, on CPU tensors. Test-only: built by src/cuda/emu/test_emu.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "emu_runtime.h"  // after the torch headers: it defines CUDA built-in names
#include "cuda/kernels.cuh"

namespace inplace_abn {
namespace gpu {
namespace backend {

using Stream = int;
inline Stream stream() { return 0; }
inline int g_sms = 2;
inline int sm_count() { return g_sms; }
inline int64_t kMaxGridY = 65535;
inline int64_t kMaxFixedBlocks = 8192;

inline void check_device(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.is_cpu(), "inplace_abn (emulated CUDA): ", name, " must be a CPU tensor");
  TORCH_CHECK(t.device() == x.device(), "inplace_abn (emulated CUDA): ", name, " is on another device");
}

struct Guard {
  explicit Guard(const at::Tensor&) {}
};

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, Stream, Args&&... args) {
  iabn_emu::run(grid, block, [&] { kernel(args...); });
}

}  // namespace backend
}  // namespace gpu
}  // namespace inplace_abn

#include "cuda/op_backward_input.h"
#include "cuda/op_backward_reduce.h"
#include "cuda/op_batch_stats.h"
#include "cuda/op_forward.h"
#include "schemas.h"

namespace {
// Multiprocessor count (sizes the grids), gridDim.y cap and fixed-channel
// block limit the launch configurations see: small values exercise the
// grid-stride loops and the fallbacks.
void set_config(int64_t sms, int64_t max_grid_y, int64_t max_fixed_blocks) {
  inplace_abn::gpu::backend::g_sms = static_cast<int>(sms);
  inplace_abn::gpu::backend::kMaxGridY = max_grid_y;
  inplace_abn::gpu::backend::kMaxFixedBlocks = max_fixed_blocks;
}
}  // namespace

TORCH_LIBRARY(inplace_abn_emu, m) {
  m.def("set_config(int sms, int max_grid_y, int max_fixed_blocks) -> ()", &set_config);
  inplace_abn::define_schemas(m);
}

TORCH_LIBRARY_IMPL(inplace_abn_emu, CPU, m) {
  m.impl("batch_stats", &inplace_abn::gpu::batch_stats);
  m.impl("forward_", &inplace_abn::gpu::forward_);
  m.impl("backward_reduce", &inplace_abn::gpu::backward_reduce);
  m.impl("backward_input", &inplace_abn::gpu::backward_input);
}
