// Host side of inplace_abn::backward_reduce: per-channel sums of gz and gz xhat.
// One header per operator, so that each CUDA translation unit instantiates the
// kernels of its operator only (helpers: ops_impl.h).
#pragma once

#include "ops_impl.h"

namespace inplace_abn {
namespace gpu {

inline std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& y, const at::Tensor& dy,
                                                          const at::Tensor& mask, const std::optional<at::Tensor>& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          const std::optional<at::Tensor>& residual, double eps,
                                                          int64_t activation, double activation_param,
                                                          bool signed_weight) {
  const Act act = check_backward_args(y, dy, mask, weight, bias, residual, activation, activation_param);
  backend::check_device(y, y, "y");
  check_same_shape(dy, y, "dy");
  check_same_shape(residual, y, "residual");
  backend::Guard guard(y);
  const int64_t C = y.size(1);
  const auto opts = y.options().dtype(acc_type_of(y.scalar_type()));
  if (y.numel() == 0) return {at::zeros({C}, opts), at::zeros({C}, opts)};
  const Layout lay = checked_layout(y, "y");
  const Geometry g = geometry_of(y, lay);
  const at::Tensor dy_ = like(dy, y, lay);
  const at::Tensor res = residual.has_value() ? like(*residual, y, lay) : at::Tensor();
  at::Tensor sum_gz = at::empty({C}, opts), sum_gz_xhat = at::empty({C}, opts);
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "inplace_abn_backward_reduce_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    at::Tensor coef = at::empty({kRedRows * C}, opts);
    const ChanParam none{nullptr, 0, kParamNone};
    launch_coef<acc_t>(kCoefReduce, C, none, none, make_param(weight, "weight"), make_param(bias, "bias"), none, none,
                       eps, signed_weight, coef);
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const scalar_t* dyp = dy_.const_data_ptr<scalar_t>();
    const scalar_t* rp = res.defined() ? res.const_data_ptr<scalar_t>() : nullptr;
    const uint32_t* mp = act == Act::Silu ? reinterpret_cast<const uint32_t*>(mask.const_data_ptr<int32_t>()) : nullptr;
    const acc_t* cp = coef.const_data_ptr<acc_t>();
    const acc_t param = static_cast<acc_t>(activation_param);
    const bool aligned = aligned16(yp) && aligned16(dyp) && aligned16(rp);
    int64_t nchunks;
    at::Tensor part;
    if (!g.rows) {
      const bool vec = aligned && g.S % KV == 0;
      const int64_t K = vec ? KV : 1;
      const ContigConfig cfg = contig_config(g.N, C, g.S / K, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({2 * nchunks * C}, opts);
      acc_t* pp = part.mutable_data_ptr<acc_t>();
      const dim3 grid(static_cast<unsigned>(cfg.chunks), static_cast<unsigned>(cfg.grid_y)), block(cfg.threads);
      dispatch_act(act, [&](auto tag) {
        constexpr Act A = decltype(tag)::value;
        if (vec)
          backend::launch(&bwd_reduce_contig_kernel<scalar_t, acc_t, A, KV>, grid, block, backend::stream(), yp, dyp,
                          rp, mp, cp, param, g.N, C, g.S, cfg.chunk_len, nchunks, pp);
        else
          backend::launch(&bwd_reduce_contig_kernel<scalar_t, acc_t, A, 1>, grid, block, backend::stream(), yp, dyp,
                          rp, mp, cp, param, g.N, C, g.S, cfg.chunk_len, nchunks, pp);
      });
    } else {
      const bool vec = aligned && C % KV == 0;
      const int64_t K = vec ? KV : 1;
      const int64_t M = g.N * g.S;
      const RowsConfig cfg = rows_config(M, C, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({2 * nchunks * C}, opts);
      acc_t* pp = part.mutable_data_ptr<acc_t>();
      const dim3 grid(static_cast<unsigned>(cfg.tiles), static_cast<unsigned>(cfg.chunks)), block(cfg.bx, cfg.by);
      dispatch_act(act, [&](auto tag) {
        constexpr Act A = decltype(tag)::value;
        if (vec)
          backend::launch(&bwd_reduce_cl_kernel<scalar_t, acc_t, A, KV>, grid, block, backend::stream(), yp, dyp, rp,
                          mp, cp, param, M, C, cfg.rows_per_chunk, nchunks, pp);
        else
          backend::launch(&bwd_reduce_cl_kernel<scalar_t, acc_t, A, 1>, grid, block, backend::stream(), yp, dyp, rp,
                          mp, cp, param, M, C, cfg.rows_per_chunk, nchunks, pp);
      });
    }
    backend::launch(&finalize_sums_kernel<acc_t>, dim3(static_cast<unsigned>(fin_blocks(C))), dim3(kFinThreads),
                    backend::stream(), part.const_data_ptr<acc_t>(), nchunks, C, cp + kRedGain * C,
                    sum_gz.mutable_data_ptr<acc_t>(), sum_gz_xhat.mutable_data_ptr<acc_t>());
  });
  return {sum_gz, sum_gz_xhat};
}

}  // namespace gpu
}  // namespace inplace_abn
