// The stubs' run-time choice of kernel: on the CPU the best instruction set compiled into this build
// (src/cpu/<op>_kernel.cpp is built once per ISA, see setup.py) that both PyTorch (ATEN_CPU_CAPABILITY overrides
// it, as for PyTorch's own kernels) and this CPU allow; on CUDA the registered kernel (and the per-channel kernels
// of ChannelStub).
#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <string>

#include "ops/kernel.h"

namespace inplace_abn {
namespace {

bool cpu_supports(CpuIsa isa) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  if (isa == CpuIsa::AVX512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && cpu_supports(CpuIsa::AVX2);
  if (isa == CpuIsa::AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == CpuIsa::DEFAULT;
}

int best_isa() {
  // "DEFAULT", "AVX2", "AVX512" on x86-64 (the exported string form of
  // at::native::get_cpu_capability); anything else selects DEFAULT
  const std::string cap = at::get_cpu_capability();
  const int allowed = cap == "AVX512" ? 2 : cap == "AVX2" ? 1 : 0;
  int isa = allowed;
  while (isa > 0 && !cpu_supports(static_cast<CpuIsa>(isa))) --isa;
  return isa;
}

}  // namespace

void KernelStub::operator()(const KernelArgs& a) const {
  Kernel k = nullptr;
  if (a.x.is_cpu()) {
    static const int isa = best_isa();
    for (int i = isa; i >= 0 && k == nullptr; --i) k = cpu[i];
  } else if (a.x.is_cuda()) {
    k = cuda;
  }
  TORCH_CHECK(k != nullptr, "inplace_abn: no kernel for ", a.x.device(), " in this build");
  k(a);
}

ChannelStub cuda_channel_stub;

const ChannelStub& device_channel_stub(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && cuda_channel_stub.table != nullptr, "inplace_abn: no kernel for ", x.device(),
              " in this build");
  return cuda_channel_stub;
}

}  // namespace inplace_abn
