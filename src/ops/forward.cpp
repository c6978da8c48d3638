// inplace_abn::forward_: y = f(g~ (x - mean) / sqrt(var + eps) + beta [+ residual]) written into x; returns the
// packed SiLU branch mask. With z_out (the non-invertible ReLU): z into z_out, max(z, 0) into x, in one pass. With
// source: the input is read from source and x only receives the output (the out-of-place layer; one pass less than
// a copy followed by the in-place form). Kernels: src/cpu/forward_kernel.cpp, src/cuda/forward_kernel.cu.
#include <ATen/MemoryOverlap.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub forward_stub;

at::Tensor check_forward(const at::Tensor& x, const OptTensor& residual, Act act, const OptTensor& z_out,
                         const Groups& grp, const OptTensor& source) {
  if (source.has_value()) {  // read in lockstep with x: the same elements at the same offsets
    TORCH_CHECK(source->sizes() == x.sizes() && source->scalar_type() == x.scalar_type() &&
                    source->device() == x.device(),
                "inplace_abn: source must have x's shape, dtype and device (", x.sizes(), " ", x.scalar_type(), " on ",
                x.device(), "), got ", source->sizes(), " ", source->scalar_type(), " on ", source->device());
    TORCH_CHECK(source->strides() == x.strides(), "inplace_abn: source must have x's memory layout (strides ",
                x.strides(), "), got strides ", source->strides());
    const auto overlap = at::get_overlap_status(x, *source);
    TORCH_CHECK(overlap == at::MemOverlapStatus::No || overlap == at::MemOverlapStatus::Full,
                "inplace_abn: source and x share part of their memory: the output would overwrite input not yet read");
  }
  check_like(residual, x, "residual");
  if (z_out.has_value()) {  // one write of z, in the dtype and memory order the kernel stores it
    check_like(z_out, x, "z_out");
    TORCH_CHECK(act == Act::Identity, "inplace_abn: z_out is the ReLU path and needs activation 0 (identity), got ",
                static_cast<int>(act));
    TORCH_CHECK(z_out->scalar_type() == acc_type_of(x.scalar_type()), "inplace_abn: z_out must be ",
                acc_type_of(x.scalar_type()), " for a ", x.scalar_type(), " input, got ", z_out->scalar_type());
    TORCH_CHECK(is_channels_last(x) ? is_channels_last(*z_out) : z_out->is_contiguous(),
                "inplace_abn: z_out must have x's memory layout (contiguous or channels-last)");
  }
  return new_empty({act == Act::Silu ? grp.mask_size(x) : 0}, x.options().dtype(at::kInt));
}

at::Tensor forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var, const OptTensor& weight,
                    const OptTensor& bias, const OptTensor& residual, double eps, int64_t activation,
                    double activation_param, bool signed_weight, const OptTensor& z_out, int64_t groups,
                    const OptTensor& source) {
  check_input(x, "x");
  const Act act = to_act(activation);
  const Groups grp(x, groups);
  const std::array<ChannelInput, 4> in{grp.stat(mean, 0.0, x, "mean"), grp.stat(var, 0.0, x, "var"),
                                       grp.param(weight, 1.0, x, "weight"), grp.param(bias, 0.0, x, "bias")};
  at::Tensor mask = check_forward(x, residual, act, z_out, grp, source);
  if (x.numel() == 0) return mask;
  c10::OptionalDeviceGuard guard(x.device());
  const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
  const auto acc = acc_type_of(x.scalar_type());
  const at::Tensor xv = grp.view(x);
  const at::Tensor coef =
      coef_table<Table::Forward>(xv, in, {.eps = eps, .has_weight = weight.has_value(), .signed_weight = signed_weight,
                                          .acc_float = acc == at::kFloat}, grp.columns(x));
  grp.run(forward_stub,
          {.x = xv, .source = grp.view(source.value_or(at::Tensor())), .residual = grp.view(like(residual, x)), .mask = mask, .coef = coef,
           .out1 = grp.view(z_out.value_or(at::Tensor())), .g = geometry_of(xv, "x"), .act = act,
           .param = activation_param},
          false);
  return mask;
}

}  // namespace inplace_abn
