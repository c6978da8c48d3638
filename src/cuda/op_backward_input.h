// Host side of inplace_abn::backward_input: dx (and the residual gradient).
// One header per operator, so that each CUDA translation unit instantiates the
// kernels of its operator only (helpers: ops_impl.h).
#pragma once

#include "ops_impl.h"

namespace inplace_abn {
namespace gpu {

inline std::tuple<at::Tensor, at::Tensor> backward_input(
    const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat, double eps,
    int64_t activation, double activation_param, bool signed_weight, bool residual_grad) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  backend::check_device(y, y, "y");
  check_same_shape(dy, y, "dy");
  check_vector(var, y, "var");
  check_same_shape(residual, y, "residual");
  check_vector(mean_gz, y, "mean_gz");
  check_vector(mean_gz_xhat, y, "mean_gz_xhat");
  backend::Guard guard(y);
  // Same dtype and memory format as y (x's storage): preserve_format keeps
  // the strides of a dense tensor, so memory positions match.
  at::Tensor dx = at::empty_like(y);
  at::Tensor dres = residual_grad ? at::empty_like(y) : at::empty({0}, y.options());
  const int64_t numel = y.numel();
  if (numel == 0) return {dx, dres};
  const Layout lay = checked_layout(y, "y");
  const Geometry g = geometry_of(y, lay);
  TORCH_CHECK(dx.strides() == y.strides() && (!residual_grad || dres.strides() == y.strides()),
              "inplace_abn: unexpected gradient layout");
  const at::Tensor dy_ = like(dy, y, lay);
  const at::Tensor res = residual.has_value() ? like(*residual, y, lay) : at::Tensor();
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "inplace_abn_backward_input_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const auto accopts = y.options().dtype(acc_type_of(y.scalar_type()));
    at::Tensor coef = at::empty({kInRows * g.C}, accopts);
    const ChanParam none{nullptr, 0, kParamNone};
    launch_coef<acc_t>(kCoefInput, g.C, none, make_param(var, "var"), make_param(weight, "weight"),
                       make_param(bias, "bias"), make_param(mean_gz, "mean_gz"), make_param(mean_gz_xhat, "mean_gz_xhat"),
                       eps, signed_weight, coef);
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const scalar_t* dyp = dy_.const_data_ptr<scalar_t>();
    const scalar_t* rp = res.defined() ? res.const_data_ptr<scalar_t>() : nullptr;
    const uint32_t* mp = act == Act::Silu ? reinterpret_cast<const uint32_t*>(mask.const_data_ptr<int32_t>()) : nullptr;
    scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
    scalar_t* drp = residual_grad ? dres.mutable_data_ptr<scalar_t>() : nullptr;
    const acc_t* cp = coef.const_data_ptr<acc_t>();
    const acc_t param = static_cast<acc_t>(activation_param);
    const bool vec = aligned16(yp) && aligned16(dyp) && aligned16(rp) && aligned16(dxp) && aligned16(drp);
    const EwConfig cfg = ew_config(numel, vec ? KV : 1, g, sms, backend::kMaxFixedBlocks);
    const dim3 grid(static_cast<unsigned>(cfg.blocks)), block(cfg.threads);
    dispatch_act(act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      auto go = [&](auto kernel) {
        backend::launch(kernel, grid, block, backend::stream(), yp, dyp, rp, mp, cp, param, numel, g.inner(), g.C, dxp,
                        drp);
      };
      if (vec)
        cfg.fixed ? go(&backward_input_kernel<scalar_t, acc_t, A, KV, true>)
                  : go(&backward_input_kernel<scalar_t, acc_t, A, KV, false>);
      else
        cfg.fixed ? go(&backward_input_kernel<scalar_t, acc_t, A, 1, true>)
                  : go(&backward_input_kernel<scalar_t, acc_t, A, 1, false>);
    });
  });
  return {dx, dres};
}

}  // namespace gpu
}  // namespace inplace_abn
