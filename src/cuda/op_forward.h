// Host side of inplace_abn::forward_: normalise, affine, activation, in place; SiLU mask.
// One header per operator, so that each CUDA translation unit instantiates the
// kernels of its operator only (helpers: ops_impl.h).
#pragma once

#include "ops_impl.h"

namespace inplace_abn {
namespace gpu {

inline at::Tensor forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, double eps, int64_t activation,
                           double activation_param, bool signed_weight) {
  check_input(x, "x");
  backend::check_device(x, x, "x");
  check_vector(mean, x, "mean");
  check_vector(var, x, "var");
  check_vector(weight, x, "weight");
  check_vector(bias, x, "bias");
  check_same_shape(residual, x, "residual");
  const Act act = to_act(activation);
  backend::Guard guard(x);
  const int64_t numel = x.numel();
  at::Tensor mask = at::empty({act == Act::Silu ? mask_words(numel) : 0}, x.options().dtype(at::kInt));
  if (numel == 0) return mask;
  const Layout lay = checked_layout(x, "x");
  const Geometry g = geometry_of(x, lay);
  const at::Tensor res = residual.has_value() ? like(*residual, x, lay) : at::Tensor();
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "inplace_abn_forward_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const auto accopts = x.options().dtype(acc_type_of(x.scalar_type()));
    at::Tensor coef = at::empty({kFwdRows * g.C}, accopts);
    const ChanParam none{nullptr, 0, kParamNone};
    launch_coef<acc_t>(kCoefForward, g.C, make_param(mean, "mean"), make_param(var, "var"), make_param(weight, "weight"),
                       make_param(bias, "bias"), none, none, eps, signed_weight, coef);
    scalar_t* xp = x.mutable_data_ptr<scalar_t>();
    const scalar_t* rp = res.defined() ? res.const_data_ptr<scalar_t>() : nullptr;
    uint32_t* mp = act == Act::Silu ? reinterpret_cast<uint32_t*>(mask.mutable_data_ptr<int32_t>()) : nullptr;
    const acc_t* cp = coef.const_data_ptr<acc_t>();
    const bool vec = aligned16(xp) && aligned16(rp);
    const EwConfig cfg = ew_config(numel, vec ? KV : 1, g, sms, backend::kMaxFixedBlocks);
    const dim3 grid(static_cast<unsigned>(cfg.blocks)), block(cfg.threads);
    const acc_t param = static_cast<acc_t>(activation_param);
    dispatch_act(act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      auto go = [&](auto kernel) {
        backend::launch(kernel, grid, block, backend::stream(), xp, rp, mp, cp, param, numel, g.inner(), g.C);
      };
      if (vec)
        cfg.fixed ? go(&forward_kernel<scalar_t, acc_t, A, KV, true>) : go(&forward_kernel<scalar_t, acc_t, A, KV, false>);
      else
        cfg.fixed ? go(&forward_kernel<scalar_t, acc_t, A, 1, true>) : go(&forward_kernel<scalar_t, acc_t, A, 1, false>);
    });
  });
  return mask;
}

}  // namespace gpu
}  // namespace inplace_abn
