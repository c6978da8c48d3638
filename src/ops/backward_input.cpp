// inplace_abn::backward_input: dx = g~ r (gz - k mean_gz - xhat k mean_gz_xhat), k = sums_scale, and gz (the
// residual's gradient) when asked; backward_input_from_z_: the same from y and what backward_reduce kept of
// z = f^-1(y) (docs/DESIGN.md section 7.2), dx written over it or into dx_out.
// Kernels: src/cpu/backward_input_kernel.cpp, src/cuda/backward_input_kernel.cu.
#include "ops/backward_passes.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub backward_input_stub;

std::array<ChannelInput, 5> input_args(const at::Tensor& y, const Groups& grp, const at::Tensor& var,
                                       const OptTensor& weight, const OptTensor& bias, const OptTensor& mean_gz,
                                       const OptTensor& mean_gz_xhat, double sums_scale) {
  std::array<ChannelInput, 5> in{grp.stat(var, 0.0, y, "var"), grp.param(weight, 1.0, y, "weight"),
                                 grp.param(bias, 0.0, y, "bias"), grp.stat(mean_gz_xhat, 0.0, y, "mean_gz_xhat"),
                                 grp.stat(mean_gz, 0.0, y, "mean_gz")};
  if (sums_scale == 0.0) in[3].t = in[4].t = std::nullopt;
  return in;
}

// a = g~ r, b = -r k mean_gz_xhat, c0 = -g~ r k mean_gz (rows of kernel.h's InputRow), k = sums_scale.
// GroupNorm passes the (N, G) means of g~ gz and g~ gz xhat: BatchNorm's means times g~_c.
void input_pass(const Groups& grp, const at::Tensor& y, const at::Tensor& gy, bool kernel_relu,
                const at::Tensor& kept, const at::Tensor& mask, const std::array<ChannelInput, 5>& in, bool has_weight, const at::Tensor& res,
                double eps, Act act, double param, bool signed_weight, double sums_scale, const at::Tensor& dx,
                const at::Tensor& dres, const Geometry& g) {
  const at::Tensor yv = grp.view(y), dxv = grp.view(dx);
  const bool from_z = kept.defined();
  const at::Tensor coef =
      coef_table<Table::Input>(yv, in, {.eps = eps, .has_weight = has_weight, .signed_weight = signed_weight,
                                        .groupnorm = grp.G > 0, .sums_scale = sums_scale}, grp.columns(y));
  grp.run(backward_input_stub,
          {.x = yv, .dy = grp.view(gy), .residual = grp.view(res), .mask = from_z ? at::Tensor() : mask,
           .coef = coef, .out1 = dxv, .out2 = grp.view(dres), .z = from_z ? grp.view(kept) : at::Tensor(), .from_z = from_z,
           .relu = kernel_relu, .g = grp.G ? geometry_of(yv, "y") : g, .act = act, .param = param},
          false);
}

std::tuple<at::Tensor, at::Tensor> backward_input(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                                                  const at::Tensor& var, const OptTensor& weight,
                                                  const OptTensor& bias, const OptTensor& residual,
                                                  const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat,
                                                  double eps, int64_t activation, double activation_param,
                                                  bool signed_weight, bool residual_grad, double sums_scale,
                                                  int64_t groups, bool relu) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  const auto [gy, kernel_relu] = relu_dy(dy, y, act, relu);
  const Groups grp(y, groups);
  const auto in = input_args(y, grp, var, weight, bias, mean_gz, mean_gz_xhat, sums_scale);
  const Geometry g = y.numel() > 0 ? geometry_of(y, "y") : Geometry{};  // the layout check before allocating
  // y's dtype and memory format (a dense tensor keeps its strides)
  at::Tensor dx = new_like(y);
  at::Tensor dres = residual_grad ? new_like(y) : new_empty({0}, y.options());
  if (y.numel() == 0) return {dx, dres};
  c10::OptionalDeviceGuard guard(y.device());
  const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
  input_pass(grp, y, like(gy, y), kernel_relu, at::Tensor(), mask, in, weight.has_value(), like(residual, y), eps, act,
             activation_param, signed_weight, sums_scale, dx, residual_grad ? dres : at::Tensor(), g);
  return {dx, dres};
}

at::Tensor backward_input_from_z_(const at::Tensor& z, const at::Tensor& y, const at::Tensor& dy,
                                  const at::Tensor& var, const OptTensor& weight, const OptTensor& bias,
                                  const OptTensor& residual, const at::Tensor& mean_gz,
                                  const at::Tensor& mean_gz_xhat, double eps, int64_t activation,
                                  double activation_param, bool signed_weight, bool residual_grad, double sums_scale,
                                  int64_t groups, const OptTensor& dx_out) {
  check_input(y, "y");
  const Act act = to_act(activation);
  check_z(z, y, act, "z");
  TORCH_CHECK(!z.is_alias_of(y), "inplace_abn: backward_input_from_z_'s z (what backward_reduce kept) must not share "
              "y's memory");
  if (dx_out.has_value()) {
    TORCH_CHECK(dx_out->sizes() == y.sizes() && dx_out->strides() == y.strides() &&
                    dx_out->scalar_type() == y.scalar_type() && dx_out->device() == y.device(),
                "inplace_abn: backward_input_from_z_'s dx_out must have y's shape, strides, dtype and device");
    TORCH_CHECK(!dx_out->is_alias_of(y) && !dx_out->is_alias_of(z) && !dx_out->is_alias_of(dy),
                "inplace_abn: backward_input_from_z_'s dx_out must not share memory with y, z or dy");
  } else {
    TORCH_CHECK(z.scalar_type() == y.scalar_type(), "inplace_abn: backward_input_from_z_ writes dx over z, which a ",
                y.scalar_type(), " y keeps in ", z.scalar_type(), ": pass dx_out (y's dtype) for dx");
  }
  check_like(dy, y, "dy");
  check_like(residual, y, "residual");
  const Groups grp(y, groups);
  const auto in = input_args(y, grp, var, weight, bias, mean_gz, mean_gz_xhat, sums_scale);
  const Geometry g = y.numel() > 0 ? geometry_of(y, "y") : Geometry{};
  at::Tensor dres = residual_grad ? new_like(y) : new_empty({0}, y.options());
  if (y.numel() == 0) return dres;
  const TableGuard table_guard;
  input_pass(grp, y, like(dy, y), false, z, at::Tensor(), in, weight.has_value(), like(residual, y), eps, act,
             activation_param, signed_weight, sums_scale, dx_out.value_or(z), residual_grad ? dres : at::Tensor(), g);
  return dres;
}

}  // namespace inplace_abn
