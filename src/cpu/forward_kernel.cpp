// forward_ on the CPU: x <- f((x - mean_hi - mean_lo) scale + shift [+ residual]), in place (or from source, when
// given, into x); SiLU: the branch bits [z < z*] in memory order. ZOUT (ReLU, with identity): z into out1 (the
// compute type), max(z, 0) into x.
#include "cpu/elementwise_kernels.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {

IABN_REGISTER_CPU_KERNEL(forward_stub, &forward_kernel_t<false>);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
