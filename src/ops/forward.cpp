// inplace_abn::forward_: y = f(g~ (x - mean) / sqrt(var + eps) + beta [+ residual])
// written into x; returns the packed SiLU branch mask. Kernels:
// src/cpu/forward_kernel.cpp, src/cuda/forward_kernel.cu.
#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub forward_stub;

at::Tensor forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var, const OptTensor& weight,
                    const OptTensor& bias, const OptTensor& residual, double eps, int64_t activation,
                    double activation_param, bool signed_weight) {
  check_input(x, "x");
  const Act act = to_act(activation);
  check_channel_vector(mean, x, "mean");
  check_channel_vector(var, x, "var");
  check_channel_vector(weight, x, "weight");
  check_channel_vector(bias, x, "bias");
  check_like(residual, x, "residual");
  at::Tensor mask = at::empty({act == Act::Silu ? mask_words(x.numel()) : 0}, x.options().dtype(at::kInt));
  if (x.numel() == 0) return mask;
  c10::OptionalDeviceGuard guard(x.device());
  const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
  const auto acc = acc_type_of(x.scalar_type());
  const at::Tensor coef = coef_table<4>(x, {{{mean, 0.0}, {var, 0.0}, {weight, 1.0}, {bias, 0.0}}}, [&](const auto& v) {
    const auto hi = round_to(v[0], acc);  // the mean as hi + lo
    return std::array{hi, v[0] - hi, gain(v[2], weight.has_value(), eps, signed_weight) * inv_std(v[1], eps), v[3]};
  });
  forward_stub({.x = x, .residual = like(residual, x), .mask = mask, .coef = coef,
                .g = geometry_of(x, "x"), .act = act, .param = activation_param});
  return mask;
}

}  // namespace inplace_abn
