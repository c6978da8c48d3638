// forward_ and backward_input with the super-rows of the rows layout walked in pairs (for_each_pair), for the
// activations of kPairedRows. In a file of their own: beside the other instantiations, GCC inlined less in those
// (ELU backward_input 4096x512, AVX2: 1.52-1.83 against 1.03 ms; the planar leaky_relu walk 1.7x).
#include "cpu/elementwise_kernels.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {

void forward_paired_kernel(const KernelArgs& a) { forward_kernel_t<true>(a); }
void backward_input_paired_kernel(const KernelArgs& a) { backward_input_kernel_t<true>(a); }

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
