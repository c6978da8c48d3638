// CPU implementations of the operators declared in src/ops.cpp: argument
// checks, outputs, the per-channel coefficients (computed in double, then
// rounded once to the compute type), and the call into the vectorised
// kernels of the best SIMD level this machine and PyTorch allow
// (kernels_impl.h, built per level in kernels_{default,avx2,avx512}.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

#include "common.h"
#include "cpu/kernel_api.h"

namespace inplace_abn {
namespace cpu {
namespace {

// The kernels of the SIMD level PyTorch itself uses (ATEN_CPU_CAPABILITY
// overrides it, as for PyTorch's own kernels), if this build has them.
const KernelTable& kernels() {
  static const KernelTable* table = []() -> const KernelTable* {
#if defined(IABN_CPU_X86_DISPATCH)
    // "DEFAULT", "AVX2" or "AVX512" (at::native::get_cpu_capability is not
    // exported by libtorch; this is its exported string form).
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512" && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return &AVX512::kernel_table();
    if ((cap == "AVX2" || cap == "AVX512") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return &AVX2::kernel_table();
#endif
    return &DEFAULT::kernel_table();
  }();
  return *table;
}

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::Float;
    case at::kDouble:
      return DType::Double;
    case at::kHalf:
      return DType::Half;
    case at::kBFloat16:
      return DType::BFloat16;
    default:
      TORCH_CHECK(false, "inplace_abn: ", name, " must be float32, float64, float16 or bfloat16, got ",
                  t.scalar_type());
  }
  return DType::Float;
}

// Contiguous tensors with planes smaller than kRowsMaxPlane elements use the
// rows path when one row of the channel pattern (C S elements) is at most
// kRowsMaxPeriod: its coefficient arrays and (reductions) double accumulators
// then stay within L2.
constexpr int64_t kRowsMaxPlane = 512;
constexpr int64_t kRowsMaxPeriod = 32768;

Geometry geometry_of(const at::Tensor& x, const char* name) {
  const Layout l = layout_of(x);
  TORCH_CHECK(l != Layout::Other, "inplace_abn: the CPU kernels need ", name,
              " contiguous or channels-last (got sizes ", x.sizes(), ", strides ", x.strides(),
              "); make it contiguous first");
  Geometry g;
  g.numel = x.numel();
  g.C = x.size(1);
  const int64_t nc = x.size(0) * g.C;
  g.S = nc > 0 ? g.numel / nc : 1;
  if (l == Layout::ChannelsLast) {
    g.S = 1;
    g.rows = true;
  } else {
    // Small planes go through the rows path (no partial vector and no
    // horizontal sum per plane) while its per-position arrays stay small.
    g.rows = g.S == 1 || (g.S < kRowsMaxPlane && g.C * g.S <= kRowsMaxPeriod);
  }
  return g;
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "inplace_abn: ", name, " must be a CPU tensor, got ", t.device());
}

// `t` with ref's dtype and memory order: t itself when it has them, else a
// copy (a gradient may arrive in another layout; a residual may differ).
at::Tensor like(const at::Tensor& t, const at::Tensor& ref) {
  const bool same_order = layout_of(ref) == Layout::Contiguous
                              ? t.is_contiguous()
                              : t.is_contiguous(ref.dim() == 4 ? at::MemoryFormat::ChannelsLast
                                                               : at::MemoryFormat::ChannelsLast3d);
  if (t.scalar_type() == ref.scalar_type() && same_order) return t;
  return at::empty_like(ref, at::MemoryFormat::Preserve).copy_(t);
}

// A length-C float vector of any float dtype, as doubles (or `fill` when absent).
std::vector<double> channel_values(const std::optional<at::Tensor>& t, int64_t C, double fill) {
  std::vector<double> v(C, fill);
  if (t.has_value()) {
    // read in place (any float dtype, any stride): no temporary tensor per call
    const at::Tensor& s = *t;
    const int64_t st = s.stride(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "inplace_abn_channel_values", [&] {
      const scalar_t* p = s.const_data_ptr<scalar_t>();
      for (int64_t c = 0; c < C; ++c) v[c] = static_cast<double>(p[c * st]);
    });
  }
  return v;
}

// Writes v into t, a contiguous float32 or float64 tensor of v.size() elements.
void fill_from(at::Tensor& t, const std::vector<double>& v) {
  if (t.scalar_type() == at::kDouble) {
    std::copy(v.begin(), v.end(), t.data_ptr<double>());
  } else {
    float* p = t.data_ptr<float>();
    for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<float>(v[i]);
  }
}

void check_vector(const at::Tensor& t, const at::Tensor& x, const char* name) {
  check_channel_vector(std::optional<at::Tensor>(t), x, name);
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "inplace_abn: ", name, " must be a floating point tensor, got ",
              t.scalar_type());
}

void check_optional_vector(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (t.has_value()) check_vector(*t, x, name);
}

// g~ per channel (1 without a weight).
std::vector<double> eff_weight(const std::optional<at::Tensor>& weight, int64_t C, double eps, bool signed_mode) {
  std::vector<double> g = channel_values(weight, C, 1.0);
  if (weight.has_value())
    for (auto& v : g) v = effective_weight<double>(v, eps, signed_mode);
  return g;
}

// Per-channel vectors (computed in double) as the kernels read them, in the
// compute type: the doubles themselves for double inputs, float copies
// (owned here) otherwise. cv[k] is the k-th vector's data.
class ComputeVectors {
 public:
  ComputeVectors(DType dt, std::initializer_list<const std::vector<double>*> vs) {
    floats_.reserve(vs.size());
    for (const std::vector<double>* v : vs) {
      if (dt == DType::Double) {
        ptrs_.push_back(v->data());
      } else {
        floats_.emplace_back(v->begin(), v->end());
        ptrs_.push_back(floats_.back().data());
      }
    }
  }
  const void* operator[](size_t k) const { return ptrs_[k]; }

 private:
  std::vector<std::vector<float>> floats_;
  std::vector<const void*> ptrs_;
};

// ---------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> batch_stats_cpu(const at::Tensor& x) {
  check_input(x, "x");
  check_cpu(x, "x");
  const DType dt = dtype_of(x, "x");
  const int64_t C = x.size(1);
  const auto acc = acc_type_of(x.scalar_type());
  at::Tensor mean = at::zeros({C}, x.options().dtype(acc));
  at::Tensor var = at::zeros({C}, x.options().dtype(acc));
  if (x.numel() == 0) return {mean, var};
  const Geometry g = geometry_of(x, "x");
  std::vector<double> m(C), v(C);
  StatsArgs a{x.data_ptr(), dt, g, m.data(), v.data()};
  kernels().batch_stats(a);
  fill_from(mean, m);
  fill_from(var, v);
  return {mean, var};
}

at::Tensor forward_cpu(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var,
                       const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, double eps, int64_t activation,
                       double activation_param, bool signed_weight) {
  check_input(x, "x");
  check_cpu(x, "x");
  const DType dt = dtype_of(x, "x");
  const Act act = to_act(activation);
  check_vector(mean, x, "mean");
  check_vector(var, x, "var");
  check_optional_vector(weight, x, "weight");
  check_optional_vector(bias, x, "bias");
  check_like(residual, x, "residual");
  const int64_t C = x.size(1);
  at::Tensor mask = at::empty({act == Act::Silu ? mask_words(x.numel()) : 0}, x.options().dtype(at::kInt));
  if (x.numel() == 0) return mask;
  const Geometry g = geometry_of(x, "x");
  at::Tensor res;
  if (residual.has_value()) res = like(*residual, x);

  const std::vector<double> mu = channel_values(mean, C, 0.0);
  const std::vector<double> vr = channel_values(var, C, 0.0);
  const std::vector<double> gt = eff_weight(weight, C, eps, signed_weight);
  const std::vector<double> beta = channel_values(bias, C, 0.0);
  std::vector<double> scale(C), mhi(C), mlo(C);
  const bool dbl = dt == DType::Double;
  for (int64_t c = 0; c < C; ++c) {
    scale[c] = gt[c] / std::sqrt(vr[c] + eps);
    // the mean as a float pair (hi + lo), so x - mean keeps its accuracy in
    // float when |mean| >> std
    mhi[c] = dbl ? mu[c] : static_cast<double>(static_cast<float>(mu[c]));
    mlo[c] = mu[c] - mhi[c];
  }
  ForwardArgs a;
  a.x = x.data_ptr();
  a.residual = res.defined() ? res.data_ptr() : nullptr;
  a.dtype = dt;
  a.g = g;
  a.act = static_cast<int>(act);
  a.param = activation_param;
  a.mask = act == Act::Silu ? mask.data_ptr<int32_t>() : nullptr;
  const ComputeVectors cv(dt, {&mhi, &mlo, &scale, &beta});
  a.mean_hi = cv[0];
  a.mean_lo = cv[1];
  a.scale = cv[2];
  a.shift = cv[3];
  kernels().forward(a);
  return mask;
}

std::tuple<at::Tensor, at::Tensor> backward_reduce_cpu(const at::Tensor& y, const at::Tensor& dy,
                                                       const at::Tensor& mask,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       const std::optional<at::Tensor>& residual, double eps,
                                                       int64_t activation, double activation_param,
                                                       bool signed_weight) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  check_cpu(y, "y");
  const DType dt = dtype_of(y, "y");
  check_optional_vector(weight, y, "weight");
  check_optional_vector(bias, y, "bias");
  const int64_t C = y.size(1);
  const auto acc = acc_type_of(y.scalar_type());
  at::Tensor sg = at::zeros({C}, y.options().dtype(acc));
  at::Tensor sgx = at::zeros({C}, y.options().dtype(acc));
  if (y.numel() == 0) return {sg, sgx};
  const Geometry g = geometry_of(y, "y");
  at::Tensor dyl = like(dy, y);
  at::Tensor res;
  if (residual.has_value()) res = like(*residual, y);

  const std::vector<double> gt = eff_weight(weight, C, eps, signed_weight);
  const std::vector<double> beta = channel_values(bias, C, 0.0);
  std::vector<double> s1(C), s2(C);
  BackwardReduceArgs a;
  a.y = y.data_ptr();
  a.dy = dyl.data_ptr();
  a.residual = res.defined() ? res.data_ptr() : nullptr;
  a.mask = act == Act::Silu ? mask.data_ptr<int32_t>() : nullptr;
  a.dtype = dt;
  a.g = g;
  a.act = static_cast<int>(act);
  a.param = activation_param;
  a.sum_gz = s1.data();
  a.sum_gz_zc = s2.data();
  const ComputeVectors cv(dt, {&beta});
  a.shift = cv[0];
  kernels().backward_reduce(a);
  for (int64_t c = 0; c < C; ++c) s2[c] /= gt[c];
  fill_from(sg, s1);
  fill_from(sgx, s2);
  return {sg, sgx};
}

std::tuple<at::Tensor, at::Tensor> backward_input_cpu(
    const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat,
    double eps, int64_t activation, double activation_param, bool signed_weight, bool residual_grad) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  check_cpu(y, "y");
  const DType dt = dtype_of(y, "y");
  check_vector(var, y, "var");
  check_optional_vector(weight, y, "weight");
  check_optional_vector(bias, y, "bias");
  check_vector(mean_gz, y, "mean_gz");
  check_vector(mean_gz_xhat, y, "mean_gz_xhat");
  const int64_t C = y.size(1);
  // layout check before allocating
  const Geometry g = y.numel() > 0 ? geometry_of(y, "y") : Geometry{};
  at::Tensor dx = at::empty_like(y, at::MemoryFormat::Preserve);
  at::Tensor dres = residual_grad ? at::empty_like(y, at::MemoryFormat::Preserve) : at::empty({0}, y.options());
  if (y.numel() == 0) return {dx, dres};
  at::Tensor dyl = like(dy, y);
  at::Tensor res;
  if (residual.has_value()) res = like(*residual, y);

  const std::vector<double> vr = channel_values(var, C, 0.0);
  const std::vector<double> gt = eff_weight(weight, C, eps, signed_weight);
  const std::vector<double> beta = channel_values(bias, C, 0.0);
  const std::vector<double> mg = channel_values(mean_gz, C, 0.0);
  const std::vector<double> mgx = channel_values(mean_gz_xhat, C, 0.0);
  // dx = g~ r (gz - mg - xhat mgx), xhat = zc / g~  ->  A gz + B zc + C0
  std::vector<double> A(C), B(C), C0(C);
  for (int64_t c = 0; c < C; ++c) {
    const double r = 1.0 / std::sqrt(vr[c] + eps);
    A[c] = gt[c] * r;
    B[c] = -r * mgx[c];
    C0[c] = -gt[c] * r * mg[c];
  }
  BackwardInputArgs a;
  a.y = y.data_ptr();
  a.dy = dyl.data_ptr();
  a.residual = res.defined() ? res.data_ptr() : nullptr;
  a.mask = act == Act::Silu ? mask.data_ptr<int32_t>() : nullptr;
  a.dtype = dt;
  a.g = g;
  a.act = static_cast<int>(act);
  a.param = activation_param;
  a.dx = dx.data_ptr();
  a.dres = residual_grad ? dres.data_ptr() : nullptr;
  const ComputeVectors cv(dt, {&beta, &A, &B, &C0});
  a.shift = cv[0];
  a.a_gz = cv[1];
  a.b_zc = cv[2];
  a.c0 = cv[3];
  kernels().backward_input(a);
  return {dx, dres};
}

// How many distinct threads at::parallel_for runs n unit-grain items on: a
// diagnostic of the build (at::parallel_for is a header template, serial
// unless this file is compiled with the pool's OpenMP), used by the tests.
int64_t parallel_threads(int64_t n) {
  std::vector<char> seen(std::max(1, at::get_num_threads()), 0);
  at::parallel_for(0, std::max<int64_t>(n, 1), 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < static_cast<int>(seen.size())) seen[t] = 1;
  });
  return std::count(seen.begin(), seen.end(), 1);
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_FRAGMENT(inplace_abn, m) {
  m.def("_cpu_parallel_threads(int n) -> int", &cpu::parallel_threads);
}

TORCH_LIBRARY_IMPL(inplace_abn, CPU, m) {
  m.impl("batch_stats", &cpu::batch_stats_cpu);
  m.impl("forward_", &cpu::forward_cpu);
  m.impl("backward_reduce", &cpu::backward_reduce_cpu);
  m.impl("backward_input", &cpu::backward_input_cpu);
}

}  // namespace inplace_abn
