// Host side of inplace_abn::batch_stats: per-channel mean and biased variance.
// One header per operator, so that each CUDA translation unit instantiates the
// kernels of its operator only (helpers: ops_impl.h).
#pragma once

#include "ops_impl.h"

namespace inplace_abn {
namespace gpu {

inline std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x) {
  check_input(x, "x");
  backend::check_device(x, x, "x");
  backend::Guard guard(x);
  const int64_t C = x.size(1);
  const auto opts = x.options().dtype(acc_type_of(x.scalar_type()));
  if (x.numel() == 0) return {at::zeros({C}, opts), at::zeros({C}, opts)};
  const Layout lay = checked_layout(x, "x");
  const Geometry g = geometry_of(x, lay);
  at::Tensor mean = at::empty({C}, opts), var = at::empty({C}, opts);
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "inplace_abn_batch_stats_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    int64_t nchunks;
    at::Tensor part;
    if (!g.rows) {
      const bool vec = g.S % KV == 0 && aligned16(xp);
      const int64_t K = vec ? KV : 1;
      const ContigConfig cfg = contig_config(g.N, C, g.S / K, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({3 * nchunks * C}, opts);
      const dim3 grid(static_cast<unsigned>(cfg.chunks), static_cast<unsigned>(cfg.grid_y));
      if (vec)
        backend::launch(&stats_contig_kernel<scalar_t, acc_t, KV>, grid, dim3(cfg.threads), backend::stream(), xp,
                        g.N, C, g.S, cfg.chunk_len, nchunks, part.mutable_data_ptr<acc_t>());
      else
        backend::launch(&stats_contig_kernel<scalar_t, acc_t, 1>, grid, dim3(cfg.threads), backend::stream(), xp,
                        g.N, C, g.S, cfg.chunk_len, nchunks, part.mutable_data_ptr<acc_t>());
    } else {
      const bool vec = C % KV == 0 && aligned16(xp);
      const int64_t K = vec ? KV : 1;
      const int64_t M = g.N * g.S;
      const RowsConfig cfg = rows_config(M, C, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({3 * nchunks * C}, opts);
      const dim3 grid(static_cast<unsigned>(cfg.tiles), static_cast<unsigned>(cfg.chunks));
      const dim3 block(cfg.bx, cfg.by);
      if (vec)
        backend::launch(&stats_cl_kernel<scalar_t, acc_t, KV>, grid, block, backend::stream(), xp, M, C,
                        cfg.rows_per_chunk, nchunks, part.mutable_data_ptr<acc_t>());
      else
        backend::launch(&stats_cl_kernel<scalar_t, acc_t, 1>, grid, block, backend::stream(), xp, M, C,
                        cfg.rows_per_chunk, nchunks, part.mutable_data_ptr<acc_t>());
    }
    backend::launch(&finalize_stats_kernel<acc_t>, dim3(static_cast<unsigned>(fin_blocks(C))), dim3(kFinThreads),
                    backend::stream(), part.const_data_ptr<acc_t>(), nchunks, C, mean.mutable_data_ptr<acc_t>(),
                    var.mutable_data_ptr<acc_t>());
  });
  return {mean, var};
}

}  // namespace gpu
}  // namespace inplace_abn
