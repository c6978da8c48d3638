// backward_input on the CPU: dx = a gz + b (z - shift [- residual]) + c0, dresidual = gz,
// with z = f^-1(y), gz = dy f'(z); RELU (identity): gz = dy [z > 0].
#include "cpu/elementwise_kernels.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {

IABN_REGISTER_CPU_KERNEL(backward_input_stub, &backward_input_kernel_t<false>);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
