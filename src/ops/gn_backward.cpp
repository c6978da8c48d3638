// inplace_abn::gn_backward: the backward of the GroupNorm layer from its output (docs/DESIGN.md section 10): dx,
// dresidual and the per-channel sums over the batch of gz and gz xhat. A CPU y whose blocks ((sample, group) when
// contiguous, samples when channels-last) fit the kernel's buffers takes one pass over memory
// (src/cpu/gn_backward_kernel.cpp); other shapes and devices run the reduce pass, the group means and the input
// pass (src/ops/backward_passes.h), which read y and dy twice.
#include <ATen/record_function.h>

#include "ops/backward_passes.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub gn_backward_stub;

namespace {

// The kernel keeps two blocks of its compute type per thread: 2^16 elements are 512 KB in float32, within L2.
constexpr int64_t kGnBackwardMaxBlock = int64_t(1) << 16;

// Whether the one-pass kernel serves y.
bool gn_backward_fits(const at::Tensor& y, int64_t groups) {
  if (!y.is_cpu() || y.dim() < 3 || y.numel() == 0 || groups <= 0 || y.size(1) % groups) return false;
  const int64_t C = y.size(1), P = y.numel() / (y.size(0) * C);
  // a block, (sample, group) or (channels-last) sample, within kGnBackwardMaxBlock,
  // whose planes or rows hold at least a vector
  if (is_channels_last(y)) return C >= 16 && P * C <= kGnBackwardMaxBlock;
  return y.is_contiguous() && P >= 16 && (C / groups) * P <= kGnBackwardMaxBlock;
}

// Other shapes and devices: the reduce pass's (N, C) sums, their group means, then the input pass; SiLU on the CPU
// keeps its inverse between the two (in dx's buffer, or apart in float32 for half precision: section 7.2).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> two_pass(
    const Groups& grp, const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var,
    const OptTensor& weight, const OptTensor& bias, const OptTensor& residual, double eps, Act act, double param,
    bool signed_weight, bool residual_grad) {
  const int64_t N = y.size(0), C = y.size(1), G = grp.G, m = y.numel() / (N * G);  // m: elements per (n, group)
  const auto acc = y.options().dtype(acc_type_of(y.scalar_type()));
  c10::OptionalDeviceGuard guard(y.device());
  // the outputs first: they must stay normal tensors, not the TableGuard's
  const at::Tensor s_gz = new_empty({N, C}, acc), s_gzx = new_empty({N, C}, acc);
  const at::Tensor dx = new_like(y);
  const at::Tensor dres = residual_grad ? new_like(y) : new_empty({0}, y.options());
  {
    const TableGuard table_guard;
    const at::Tensor kept = kept_inverse(y, static_cast<int64_t>(act), dx);
    const at::Tensor res = like(residual, y);
    {  // (profiler ranges, as bn_backward's: a profile shows the passes)
      RECORD_FUNCTION("inplace_abn::gn_backward (reduce pass)", std::vector<c10::IValue>());
      reduce_pass(grp, y, dy, false, mask, weight, bias, res, eps, act, param, signed_weight, kept, s_gz, s_gzx);
    }
    // g~ per channel: the gain row of the reduce pass's table
    const at::Tensor g = coef_table<Table::Reduce>(y, {ChannelInput{std::nullopt, 0.0}, ChannelInput{weight, 1.0}},
                                                   {.eps = eps, .has_weight = weight.has_value(),
                                                    .signed_weight = signed_weight})[kRedGain];
    // group means of g~ gz and g~ gz xhat, per sample (N, G)
    const at::Tensor mean_ggz = (s_gz * g).view({N, G, C / G}).sum(2) / m;
    const at::Tensor mean_ggzx = (s_gzx * g).view({N, G, C / G}).sum(2) / m;
    RECORD_FUNCTION(kept.defined() ? "inplace_abn::gn_backward (input pass from z)"
                                   : "inplace_abn::gn_backward (input pass)",
                    std::vector<c10::IValue>());
    input_pass(grp, y, dy, false, kept, mask, input_args(y, grp, var, weight, bias, mean_ggz, mean_ggzx, 1.0),
               weight.has_value(), res, eps, act, param, signed_weight, 1.0, dx,
               residual_grad ? dres : at::Tensor(), Geometry{});  // (GroupNorm: the pass takes the view's)
  }
  return {dx, dres, s_gz.sum(0), s_gzx.sum(0)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gn_backward(
    const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& residual, int64_t groups, double eps, int64_t activation,
    double activation_param, bool signed_weight, bool residual_grad) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  TORCH_CHECK(groups > 0, "inplace_abn: gn_backward needs groups > 0, got ", groups);
  const Groups grp(y, groups);
  if (y.numel() > 0 && !gn_backward_fits(y, groups))
    return two_pass(grp, y, like(dy, y), mask, var, weight, bias, residual, eps, act, activation_param,
                    signed_weight, residual_grad);
  const std::array<ChannelInput, 3> in{grp.param(bias, 0.0, y, "bias"), grp.param(weight, 1.0, y, "weight"),
                                       grp.stat(var, 0.0, y, "var")};
  at::Tensor dx = new_like(y);
  at::Tensor dres = residual_grad ? new_like(y) : new_empty({0}, y.options());
  const auto opts = y.options().dtype(acc_type_of(y.scalar_type()));
  if (y.numel() == 0) return {dx, dres, at::zeros({y.size(1)}, opts), at::zeros({y.size(1)}, opts)};
  const at::Tensor sum_gz = new_empty({y.size(1)}, opts), sum_gz_xhat = new_empty({y.size(1)}, opts);
  const TableGuard table_guard;
  RECORD_FUNCTION("inplace_abn::gn_backward (one pass)", std::vector<c10::IValue>());
  const at::Tensor coef = coef_table<Table::GnBackward>(
      grp.view(y), in, {.eps = eps, .has_weight = weight.has_value(), .signed_weight = signed_weight}, grp.columns(y));
  gn_backward_stub({.x = y, .dy = like(dy, y), .residual = like(residual, y), .mask = mask, .coef = coef,
                    .out1 = dx, .out2 = residual_grad ? dres : at::Tensor(), .g = geometry_of(y, "y"), .act = act,
                    .param = activation_param, .groups = groups, .sum_gz = sum_gz, .sum_gz_xhat = sum_gz_xhat});
  return {dx, dres, sum_gz, sum_gz_xhat};
}

}  // namespace inplace_abn
