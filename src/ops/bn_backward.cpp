// inplace_abn::bn_backward: the whole backward of the local BatchNorm layer in one operator call, as stock's
// native_batch_norm_backward: the reduce pass (when its sums are needed), the input pass (from the reduce pass's z
// for SiLU on the CPU, docs/DESIGN.md section 7.2) and the parameters' gradients, behind one front end: one set of
// checks, guards and dy conversion, and no dispatcher round trip between the passes. A contiguous CPU y whose
// channels fit the cache runs both passes channel by channel instead, reading y and dy from memory once
// (src/cpu/bn_backward_kernel.cpp, docs/DESIGN.md section 6.2). The local layer's autograd (C++, and the Python
// path on the native backend) calls it; the synchronised layer calls backward_reduce and backward_input, as its
// all-reduce sits between them.
#include <ATen/record_function.h>

#include "ops/backward_passes.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub bn_backward_stub;

namespace {

// The one-pass CPU kernel keeps a channel's y and dy in the cache between its two passes (and SiLU / ELU their gz
// and zc in two buffers of the compute type): 2^16 elements are 512 KB in float32, within L2.
constexpr int64_t kBnBackwardMaxChannel = int64_t(1) << 16;

// Whether the one-pass kernel serves y: a contiguous CPU y whose planes hold a vector and whose channels fit.
bool bn_backward_fits(const at::Tensor& y) {
  if (!y.is_cpu() || y.dim() < 3 || y.numel() == 0 || !y.is_contiguous()) return false;
  const int64_t N = y.size(0), C = y.size(1), P = y.numel() / (N * C);
  return P >= 16 && N * P <= kBnBackwardMaxChannel;
}

}  // namespace

// Not SiLU's two-pass z path on the CPU (z, then dx over it, needs a tensor of its own), nor CUDA, whose kernels
// take their arguments as __restrict__ (no aliasing).
bool bn_backward_dx_direct(const at::Tensor& y, int64_t activation) {
  return y.is_cpu() && (bn_backward_fits(y) || !silu_keeps_z(y, activation));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_backward(
    const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& residual, double eps, int64_t activation, double activation_param,
    bool signed_weight, bool training, std::array<bool, 4> output_mask, bool relu, const OptTensor& dx_out) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  check_channel_vector(var, y, "var");
  const auto [need_x, need_w, need_b, need_r] = output_mask;
  TORCH_CHECK(!need_w || weight.has_value(), "inplace_abn: bn_backward asked for dweight without a weight");
  TORCH_CHECK(!need_b || bias.has_value(), "inplace_abn: bn_backward asked for dbias without a bias");
  TORCH_CHECK(!need_r || residual.has_value(), "inplace_abn: bn_backward asked for dresidual without a residual");
  const auto [gy, kernel_relu] = relu_dy(dy, y, act, relu);
  const Groups grp(y, 0);
  const Geometry g = y.numel() > 0 ? geometry_of(y, "y") : Geometry{};  // the layout check before allocating
  const int64_t C = y.size(1), count = C ? y.numel() / C : 0;
  // The sums feed dweight, dbias and, in training, dx and dresidual; in eval mode
  // with frozen parameters nobody reads them: no reduce pass (docs/DESIGN.md section 6).
  const bool reduce = need_w || need_b || (training && (need_x || need_r));
  const bool input = need_x || need_r;
  // training: the kernel scales the raw sums by 1/n; eval: the statistics are constants
  const double scale = training && count ? 1.0 / static_cast<double>(count) : 0.0;

  c10::OptionalDeviceGuard guard(y.device());
  const auto acc = y.options().dtype(acc_type_of(y.scalar_type()));
  const auto none = [&] { return new_empty({0}, y.options()); };
  // the outputs (and the sums, which become dbias and, in signed mode, dweight) first:
  // they must stay normal tensors, not the TableGuard's
  at::Tensor sum_gz, sum_gzx;
  if (reduce) {
    sum_gz = y.numel() ? new_empty({C}, acc) : at::zeros({C}, acc);
    sum_gzx = y.numel() ? new_empty({C}, acc) : at::zeros({C}, acc);
  }
  if (dx_out.has_value()) {
    TORCH_CHECK(need_x, "inplace_abn: bn_backward got dx_out without dx in output_mask");
    TORCH_CHECK(dx_out->sizes() == y.sizes() && dx_out->strides() == y.strides() &&
                    dx_out->scalar_type() == y.scalar_type() && dx_out->device() == y.device(),
                "inplace_abn: dx_out must have y's shape, strides, dtype and device");
  }
  const bool fits = y.numel() && reduce && input && bn_backward_fits(y);
  // dx_out may be dy, still to be read: where dx cannot go there directly (bn_backward_dx_direct), dx in a new
  // tensor, then copied
  const bool via_copy = !bn_backward_dx_direct(y, activation);
  const at::Tensor dx = !input ? at::Tensor() : dx_out.has_value() && !via_copy ? *dx_out : new_like(y);
  const at::Tensor dres = need_r ? new_like(y) : at::Tensor();
  if (fits) {
    const TableGuard table_guard;
    RECORD_FUNCTION("inplace_abn::bn_backward (one pass)", std::vector<c10::IValue>());
    const std::array<ChannelInput, 3> in{grp.param(bias, 0.0, y, "bias"), grp.param(weight, 1.0, y, "weight"),
                                         grp.stat(var, 0.0, y, "var")};
    const at::Tensor coef = coef_table<Table::GnBackward>(
        y, in, {.eps = eps, .has_weight = weight.has_value(), .signed_weight = signed_weight});
    bn_backward_stub({.x = y, .dy = like(gy, y), .residual = like(residual, y), .mask = mask, .coef = coef,
                      .out1 = dx, .out2 = dres, .relu = kernel_relu, .g = g, .act = act, .param = activation_param,
                      .sum_gz = sum_gz, .sum_gz_xhat = sum_gzx, .sums_scale = scale});
  } else if (y.numel()) {
    const TableGuard table_guard;
    const at::Tensor gyl = like(gy, y), res = like(residual, y);
    // SiLU: the reduce pass keeps its inverse (z, or h = z / y), the input pass starts from it and y
    const at::Tensor kept = reduce && need_x ? kept_inverse(y, activation, dx) : at::Tensor();
    // (profiler ranges: a profile shows the passes; tests/test_launches.py counts them)
    if (reduce) {
      RECORD_FUNCTION("inplace_abn::bn_backward (reduce pass)", std::vector<c10::IValue>());
      reduce_pass(grp, y, gyl, kernel_relu, mask, weight, bias, res, eps, act, activation_param, signed_weight,
                  kept, sum_gz, sum_gzx);
    }
    if (input) {
      RECORD_FUNCTION(kept.defined() ? "inplace_abn::bn_backward (input pass from z)"
                                     : "inplace_abn::bn_backward (input pass)",
                      std::vector<c10::IValue>());
      const auto in = input_args(y, grp, var, weight, bias, reduce ? OptTensor(sum_gz) : std::nullopt,
                                 reduce ? OptTensor(sum_gzx) : std::nullopt, scale);
      input_pass(grp, y, gyl, kernel_relu, kept, mask, in, weight.has_value(), res, eps, act, activation_param,
                 signed_weight, scale, dx, dres, g);
    }
  }
  if (dx_out.has_value() && via_copy) dx_out->copy_(dx);
  at::Tensor dw, db;
  if (need_w) dw = signed_weight ? cast(sum_gzx, weight->scalar_type()) : weight_grad(sum_gzx, *weight, false);
  if (need_b) db = cast(sum_gz, bias->scalar_type());
  return {need_x && !dx_out.has_value() ? dx : none(), need_w ? dw : none(), need_b ? db : none(),
          need_r ? dres : none()};
}

}  // namespace inplace_abn
