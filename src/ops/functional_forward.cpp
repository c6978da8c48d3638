// inplace_abn::forward and inplace_abn::bn_forward: the functional twins of forward_ and bn_forward_, for compiled
// graphs (inplace_abn/functions.py under torch.compile): y in a new tensor in x's memory layout, x only read, nothing
// mutated. Through forward_, a compiled layer wrote y into an empty_like(x) that inductor lays out contiguous, with
// x as its source, which must share its strides; and inductor copies a custom operator's tensors to the strides seen
// while tracing unless its schema is tagged flexible_layout, as these are (src/ops/library.cpp). After inductor's
// channels-last CPU convolutions, each layer's x was copied to contiguous and its dx back. Here y takes x's layout,
// whatever it is; an x the kernels cannot walk is made contiguous first. docs/DESIGN.md section 5.1.
#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {
namespace {

// x itself where the kernels can walk it (contiguous, channels-last), else a contiguous copy.
at::Tensor walkable(const at::Tensor& x) { return x.is_contiguous() || is_channels_last(x) ? x : x.contiguous(); }

// y in x's layout and, for the ReLU path (keep_z), z in the accumulation dtype and the same layout; else an empty z.
std::pair<at::Tensor, at::Tensor> outputs(const at::Tensor& x, int64_t activation, bool keep_z) {
  TORCH_CHECK(!keep_z || to_act(activation) == Act::Identity,
              "inplace_abn: keep_z is the ReLU path and needs activation 0 (identity), got ", activation);
  return {new_like(x), keep_z ? new_like(x, acc_type_of(x.scalar_type())) : new_empty({0}, x.options())};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& mean,
                                                       const at::Tensor& var, const OptTensor& weight,
                                                       const OptTensor& bias, const OptTensor& residual, double eps,
                                                       int64_t activation, double activation_param,
                                                       bool signed_weight, bool keep_z, int64_t groups) {
  check_input(x, "x");
  const at::Tensor in = walkable(x);
  auto [y, z] = outputs(in, activation, keep_z);
  at::Tensor mask = forward_(y, mean, var, weight, bias, residual, eps, activation, activation_param, signed_weight,
                             keep_z ? OptTensor(z) : std::nullopt, groups, in);
  return {y, z, mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_forward(
    const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& residual, double eps,
    int64_t activation, double activation_param, bool signed_weight, bool keep_z) {
  check_input(x, "x");
  const at::Tensor in = walkable(x);
  auto [y, z] = outputs(in, activation, keep_z);
  auto [mask, mean, var] = bn_forward_(y, weight, bias, std::nullopt, std::nullopt, residual, 0.0, eps, activation,
                                       activation_param, signed_weight, keep_z ? OptTensor(z) : std::nullopt, in);
  return {y, z, mask, mean, var};
}

}  // namespace inplace_abn
