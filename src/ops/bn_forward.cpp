// inplace_abn::bn_forward_: the local BatchNorm layer's training forward in one operator call: batch_stats (with the
// running-statistics update) and forward_ with those statistics. A contiguous CPU x whose channels fit the cache is
// normalised channel by channel right after its statistics are taken, so that x comes from memory once
// (src/cpu/bn_forward_kernel.cpp, docs/DESIGN.md section 6.2); its statistics and y are those of the two operators
// to the bit. Elsewhere it calls the two. The local layer's autograd (src/ops/autograd.cpp) calls it.
#include <ATen/record_function.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub bn_forward_stub;

namespace {

// A channel of at most 2^16 elements (x in float32: 256 KB, and its residual) stays in L2 between the two passes.
constexpr int64_t kBnForwardMaxChannel = int64_t(1) << 16;

// Whether the one-pass kernel serves x: a contiguous CPU x whose channels fit, with planes of at least 32 elements
// (batch_stats walks planes there, src/cpu/kernel_utils.h walk_of, so the kernel can sum as it does) of whole SiLU
// mask words (so that no two threads write the same word).
bool bn_forward_fits(const at::Tensor& x, Act act) {
  if (!x.is_cpu() || x.dim() < 3 || x.numel() == 0 || !x.is_contiguous()) return false;
  const int64_t N = x.size(0), C = x.size(1), P = x.numel() / (N * C);
  return P >= 32 && N * P <= kBnForwardMaxChannel && (act != Act::Silu || P % 32 == 0);
}

// A (C,) tensor's values as float64 (fill where absent), into out.
void put_double(const OptTensor& t, double fill, double* out, int64_t C) {
  if (!t.has_value()) return std::fill(out, out + C, fill);
  const DoubleReader r(*t);
  for (int64_t c = 0; c < C; ++c) out[c] = r[c];
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_forward_(
    const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean,
    const OptTensor& running_var, const OptTensor& residual, double momentum, double eps, int64_t activation,
    double activation_param, bool signed_weight, const OptTensor& z_out, const OptTensor& source) {
  check_input(x, "x");
  const Act act = to_act(activation);
  const at::Tensor& in = source.has_value() ? *source : x;  // (check_forward: source has x's shape and strides)
  if (!bn_forward_fits(x, act)) {
    auto [mean, var] = batch_stats(in, running_mean, running_var, momentum, 0);
    at::Tensor mask = forward_(x, mean, var, weight, bias, residual, eps, activation, activation_param,
                               signed_weight, z_out, 0, source);
    return {mask, mean, var};
  }
  const int64_t n = check_batch_stats(in, running_mean, running_var), C = x.size(1);
  const Groups grp(x, 0);
  check_channel_vector(weight, x, "weight");
  check_channel_vector(bias, x, "bias");
  const at::Tensor mask = check_forward(x, residual, act, z_out, grp, source);
  const auto acc = acc_type_of(x.scalar_type());
  const at::Tensor mean = new_empty({C}, x.options().dtype(acc)), var = new_empty({C}, x.options().dtype(acc));
  {
    const TableGuard table_guard;  // (after the outputs: they must stay normal tensors)
    RECORD_FUNCTION("inplace_abn::bn_forward_ (one pass)", std::vector<c10::IValue>());
    const at::Tensor wb = new_empty({2, C}, x.options().dtype(at::kDouble));
    put_double(weight, 1.0, wb.data_ptr<double>(), C);
    put_double(bias, 0.0, wb.data_ptr<double>() + C, C);
    bn_forward_stub({.x = x, .source = source.value_or(at::Tensor()), .residual = like(residual, x), .mask = mask,
                     .coef = wb, .out1 = mean, .out2 = var, .z = z_out.value_or(at::Tensor()), .g = geometry_of(x, "x"),
                     .act = act, .param = activation_param,
                     .spec = {.eps = eps, .has_weight = weight.has_value(), .signed_weight = signed_weight,
                              .acc_float = acc == at::kFloat}});
  }
  update_running_stats(in, running_mean, running_var, mean, var, n, momentum);
  return {mask, mean, var};
}

}  // namespace inplace_abn
