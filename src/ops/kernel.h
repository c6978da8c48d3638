// The contract between the device-agnostic front ends (src/ops/<op>.cpp) and
// the device kernels (src/cpu/<op>_kernel.cpp, src/cuda/<op>_kernel.cu): the
// arguments every kernel receives, the rows of the per-channel coefficient
// table, and one dispatch stub per operator (as ATen's DispatchStub: each
// kernel file registers itself; the front end calls the stub).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <type_traits>

#include "activations.h"

namespace inplace_abn {

// Dense memory of a contiguous (N, C, S) or channels-last (N, S, C) tensor,
// S the product of the spatial sizes. Elements are addressed by their memory
// position e; the channel of e is (e / inner()) % C.
struct Geometry {
  int64_t N, C, S, numel;
  bool channels_last;
  int64_t inner() const { return channels_last ? 1 : S; }
};

// Rows of the coefficient table (a contiguous (rows, C) tensor in the
// accumulation dtype, computed by the front end):
// forward_: z = ((x - mean_hi) - mean_lo) scale + shift [+ residual], the mean
// split into hi + lo so that x - mean keeps its accuracy when |mean| >> std.
enum ForwardRow : int { kFwdMeanHi, kFwdMeanLo, kFwdScale, kFwdShift, kFwdRows };
// backward_reduce: zc = z - shift [- residual]; the kernel sums gz and gz zc,
// and divides the second sum by the gain g~ (xhat = zc / g~).
enum ReduceRow : int { kRedShift, kRedGain, kRedRows };
// backward_input: dx = a gz + b zc + c0 = g~ r (gz - mean_gz - xhat mean_gz_xhat).
enum InputRow : int { kInShift, kInA, kInB, kInC0, kInRows };
// GroupNorm's (a, b, c0) of InputRow from its (n, group) means of g~ gz and of
// g~ gz xhat, for channel gain g and inverse std r (zc = g~ xhat, hence the / g).
template <class T>
std::array<T, 3> gn_input_row(const T& g, const T& r, const T& mean_ggz_xhat, const T& mean_ggz) {
  return {g * r, -r * mean_ggz_xhat / g, -r * mean_ggz};
}
// gn_backward (GroupNorm, contiguous, CPU), one column per (n, c): the shift and
// gain of ReduceRow and the (n, group)'s inverse std; the kernel derives InputRow.
enum GnRow : int { kGnShift, kGnGain, kGnRstd, kGnRows };

struct KernelArgs {
  at::Tensor x;         // batch_stats, forward_ (overwritten): x; backward: y
  at::Tensor source;    // forward_: undefined, or the input read in x's place (x then only receives y)
  at::Tensor dy;        // backward: the output gradient, in x's dtype and layout
  at::Tensor residual;  // undefined, or in x's dtype and layout
  at::Tensor mask;      // SiLU: the packed branch bits (int32), else undefined
  at::Tensor coef;      // the coefficient table (rows above)
  // batch_stats: mean, var; backward_reduce: sum_gz, sum_gz_xhat (the
  // accumulation dtype); backward_input: dx and dresidual (undefined unless wanted)
  at::Tensor out1, out2;
  // SiLU on the CPU, float32/float64 (docs/DESIGN.md section 7.2): backward_reduce
  // stores z = f^-1(y) here when defined; backward_input with from_z reads z
  // from x (no inversion) and overwrites it with dx (out1 is x)
  at::Tensor z;
  bool from_z = false;
  // backward_reduce / backward_input of a ReLU layer (activation 0, CPU): x holds
  // z, and gz = dy where z > 0, else 0 (other devices get a thresholded dy)
  bool relu = false;
  Geometry g;
  Act act;
  double param;  // activation parameter
  // gn_backward: the groups, and the (C,) sums over the batch of gz and gz xhat
  int64_t groups = 0;
  at::Tensor sum_gz, sum_gz_xhat;
};

using Kernel = void (*)(const KernelArgs&);

// CPU kernels are compiled once per instruction set; the stub runs the best
// one this machine and PyTorch allow (src/cpu/dispatch.cpp).
enum class CpuIsa : int { DEFAULT, AVX2, AVX512 };
constexpr int kNumIsa = 3;

struct KernelStub {
  Kernel cpu[kNumIsa];  // by CpuIsa; null where not compiled
  Kernel cuda;
  void operator()(const KernelArgs& a) const;
};
extern KernelStub batch_stats_stub, forward_stub, backward_reduce_stub, backward_input_stub, gn_backward_stub;

// At namespace scope in a kernel file: the stub runs fn on the CPU (in the
// file's CPU_CAPABILITY) or on CUDA.
#define IABN_REGISTER_KERNEL(stub, slot, fn) \
  static const bool stub##_registered = ((::inplace_abn::stub.slot = (fn)), true)
#define IABN_REGISTER_CPU_KERNEL(stub, fn) \
  IABN_REGISTER_KERNEL(stub, cpu[static_cast<int>(::inplace_abn::CpuIsa::CPU_CAPABILITY)], fn)
#define IABN_REGISTER_CUDA_KERNEL(stub, fn) IABN_REGISTER_KERNEL(stub, cuda, fn)

// f(std::integral_constant<Act, A>{}) for the activation a.
template <class F>
void dispatch_act(Act a, F&& f) {
  switch (a) {
    case Act::Identity: return f(std::integral_constant<Act, Act::Identity>{});
    case Act::LeakyRelu: return f(std::integral_constant<Act, Act::LeakyRelu>{});
    case Act::Elu: return f(std::integral_constant<Act, Act::Elu>{});
    case Act::Silu: return f(std::integral_constant<Act, Act::Silu>{});
  }
}

}  // namespace inplace_abn
