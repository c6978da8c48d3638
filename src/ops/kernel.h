// The contract between the device-agnostic front ends (src/ops/<op>.cpp) and the device kernels
// (src/cpu/<op>_kernel.cpp, src/cuda/<op>_kernel.cu): the arguments every kernel receives (the coefficient tables'
// rows: channel_math.h), and one dispatch stub per operator (as ATen's DispatchStub: each kernel file registers
// itself; the front end calls the stub).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <type_traits>

#include "channel_math.h"

namespace inplace_abn {

// Dense memory of a contiguous (N, C, S) or channels-last (N, S, C) tensor, S the product of the spatial sizes.
// Elements are addressed by their memory position e; the channel of e is (e / inner()) % C.
struct Geometry {
  int64_t N, C, S, numel;
  bool channels_last;
  int64_t inner() const { return channels_last ? 1 : S; }
};

struct KernelArgs {
  at::Tensor x;         // batch_stats, forward_ (overwritten): x; backward: y
  at::Tensor source;    // forward_: undefined, or the input read in x's place (x then only receives y)
  at::Tensor dy;        // backward: the output gradient, in x's dtype and layout
  at::Tensor residual;  // undefined, or in x's dtype and layout
  at::Tensor mask;      // SiLU: the packed branch bits (int32), else undefined
  at::Tensor coef;      // the coefficient table (rows above)
  // batch_stats, bn_forward: mean, var; backward_reduce: sum_gz, sum_gz_xhat (the
  // accumulation dtype); backward_input: dx and dresidual (undefined unless wanted)
  at::Tensor out1, out2;
  // SiLU on the CPU, float32/float64 (docs/DESIGN.md section 7.2): backward_reduce stores here, when defined, what
  // the input pass needs of z = f^-1(y) besides y (activations.h, inverse_deriv's `kept`); backward_input with
  // from_z reads it with y (no inversion) and overwrites it with dx (out1 is z). bn_forward: the ReLU path's z_out
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
  // bn_backward: the scale of the sums in the input pass (1/n in training, 0 in eval)
  double sums_scale = 0.0;
  // bn_forward: the forward table's scalars; the kernel fills each channel's column (table_column) once its
  // statistics are known, from coef = the (2, C) float64 weight and bias (their fills where absent)
  TableSpec spec{};
};

using Kernel = void (*)(const KernelArgs&);

// A per-channel input of a coefficient table: its values, `fill` where absent. Column k of the table reads entry
// (k / div) % mod of t (mod 0: k / div), see Groups in src/ops/common.h.
struct ChannelInput {
  std::optional<at::Tensor> t;
  double fill;
  int64_t div = 1, mod = 0;
};

// The per-channel work of the front ends on a GPU, one launch each (the CPU does
// it in loops, src/ops/common.h); the formulas are channel_math.h's.
struct ChannelStub {
  // the (table_rows_of(t), cols) table t, in its dtype, from its table_inputs_of(t) inputs
  void (*table)(Table t, const TableSpec& spec, const ChannelInput* in, const at::Tensor& table) = nullptr;
  // running_mean and running_var (either may be undefined) moved towards the batch's
  // mean and var: running_update with factor 1 and var_factor
  void (*running)(const at::Tensor& running_mean, const at::Tensor& mean, const at::Tensor& running_var,
                  const at::Tensor& var, double var_factor, double momentum) = nullptr;
  // out = abs_weight_grad(s, w) in out's (the weight's) dtype, w taken in s's dtype
  void (*weight_grad)(const at::Tensor& s, const at::Tensor& w, const at::Tensor& out) = nullptr;
};
extern ChannelStub cuda_channel_stub;
// cuda_channel_stub for a tensor on a GPU, checked (src/cpu/dispatch.cpp).
const ChannelStub& device_channel_stub(const at::Tensor& x);

// CPU kernels are compiled once per instruction set; the stub runs the best
// one this machine and PyTorch allow (src/cpu/dispatch.cpp).
enum class CpuIsa : int { DEFAULT, AVX2, AVX512 };
constexpr int kNumIsa = 3;

struct KernelStub {
  Kernel cpu[kNumIsa];  // by CpuIsa; null where not compiled
  Kernel cuda;
  void operator()(const KernelArgs& a) const;
};
extern KernelStub batch_stats_stub, forward_stub, backward_reduce_stub, backward_input_stub, gn_backward_stub,
    bn_backward_stub, bn_forward_stub;

// At namespace scope in a kernel file: the stub runs fn on the CPU (in the file's CPU_CAPABILITY) or on CUDA.
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
