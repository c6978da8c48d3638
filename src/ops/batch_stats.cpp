// inplace_abn::batch_stats: per-channel mean and biased variance, in the accumulation dtype, and (optionally) the
// running-statistics update of torch.nn.BatchNorm folded into the same call. Kernels:
// src/cpu/batch_stats_kernel.cpp, src/cuda/batch_stats_kernel.cu.
#include <ATen/core/grad_mode.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

KernelStub batch_stats_stub;

namespace {

// r <- running_update(r, s, factor, m) (channel_math.h), in float64, rounded to
// r's dtype: one loop on the CPU, one launch for both statistics on a GPU.
void move_running(const at::Tensor& r, const at::Tensor& s, double factor, double m) {
  if (!r.is_contiguous()) {  // (a strided view of a buffer: updated through a copy)
    const at::Tensor t = r.contiguous();
    move_running(t, s, factor, m);
    r.copy_(t);
    return;
  }
  const DoubleReader sp(s);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.scalar_type(), "move_running", [&] {
    scalar_t* rp = r.data_ptr<scalar_t>();
    for (int64_t c = 0; c < r.numel(); ++c)
      rp[c] = static_cast<scalar_t>(running_update(static_cast<double>(rp[c]), sp[c], factor, m));
  });
}

// GroupNorm statistics (groups > 0): (N, G) mean and biased variance per (sample, group). Contiguous x: BatchNorm
// statistics of the (1, N G, rest) view. Channels-last x: sample n in memory is (S, G, C/G) contiguous, whose
// BatchNorm channels are the groups, one kernel call per sample (Groups).
std::tuple<at::Tensor, at::Tensor> group_stats(const at::Tensor& x, const OptTensor& running_mean,
                                               const OptTensor& running_var, int64_t groups) {
  TORCH_CHECK(!running_mean.has_value() && !running_var.has_value(),
              "inplace_abn: batch_stats with groups > 0 (GroupNorm) keeps no running statistics");
  const Groups grp(x, groups);
  const int64_t N = x.size(0), C = x.size(1), G = groups;
  const auto opts = x.options().dtype(acc_type_of(x.scalar_type()));
  if (x.numel() == 0) return {at::zeros({N, G}, opts), at::zeros({N, G}, opts)};
  c10::OptionalDeviceGuard guard(x.device());
  const at::Tensor mean = new_empty({N, G}, opts), var = new_empty({N, G}, opts);
  if (!grp.per_sample) {
    const at::Tensor xv = x.view({1, N * G, -1});
    batch_stats_stub({.x = xv, .out1 = mean.view(-1), .out2 = var.view(-1), .g = geometry_of(xv, "x")});
    return {mean, var};
  }
  std::vector<KernelArgs> parts(N);
  for (int64_t n = 0; n < N; ++n) {
    const at::Tensor xs = raw_view(x, {x.numel() / (N * C), G, C / G}, {C, C / G, 1}, n * x.stride(0));
    parts[n] = {.x = xs, .out1 = part(mean, n, 1, false), .out2 = part(var, n, 1, false), .g = geometry_of(xs, "x")};
  }
  Groups::for_samples(N, x.is_cpu(), [&](int64_t n) { batch_stats_stub(parts[n]); });
  return {mean, var};
}

}  // namespace

int64_t check_batch_stats(const at::Tensor& x, const OptTensor& running_mean, const OptTensor& running_var) {
  check_input(x, "x");
  check_channel_vector(running_mean, x, "running_mean");
  check_channel_vector(running_var, x, "running_var");
  const int64_t C = x.size(1), n = C > 0 ? x.numel() / C : 0;
  const bool update = running_mean.has_value() || running_var.has_value();
  // (n = 0: the running statistics stay as they are)
  TORCH_CHECK(!update || n != 1, "inplace_abn: expected more than 1 value per channel when training, got ", n);
  return n;
}

void update_running_stats(const at::Tensor& x, const OptTensor& running_mean, const OptTensor& running_var,
                          const at::Tensor& mean, const at::Tensor& var, int64_t n, double momentum) {
  if (n == 0 || !(running_mean.has_value() || running_var.has_value())) return;
  const at::NoGradGuard no_grad;  // buffers: no autograd history
  const double var_factor = double(n) / double(n - 1);
  if (!x.is_cpu()) {
    device_channel_stub(x).running(running_mean.value_or(at::Tensor()), mean, running_var.value_or(at::Tensor()),
                                   var, var_factor, momentum);
  } else {
    if (running_mean.has_value()) move_running(*running_mean, mean, 1.0, momentum);
    if (running_var.has_value()) move_running(*running_var, var, var_factor, momentum);
  }
}

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x, const OptTensor& running_mean,
                                               const OptTensor& running_var, double momentum, int64_t groups) {
  check_input(x, "x");
  if (groups != 0) return group_stats(x, running_mean, running_var, groups);
  const int64_t n = check_batch_stats(x, running_mean, running_var), C = x.size(1);
  const auto opts = x.options().dtype(acc_type_of(x.scalar_type()));
  if (x.numel() == 0) return {at::zeros({C}, opts), at::zeros({C}, opts)};
  c10::OptionalDeviceGuard guard(x.device());
  const at::Tensor mean = new_empty({C}, opts), var = new_empty({C}, opts);
  batch_stats_stub({.x = x, .out1 = mean, .out2 = var, .g = geometry_of(x, "x")});
  update_running_stats(x, running_mean, running_var, mean, var, n, momentum);
  return {mean, var};
}

}  // namespace inplace_abn
