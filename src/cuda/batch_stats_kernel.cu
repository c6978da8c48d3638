// batch_stats on CUDA: Welford per thread, Chan's combination per block
// (stats_*_kernel), then one warp per channel (finalize_stats_kernel).
#include "cuda/launch.cuh"

namespace inplace_abn {
namespace gpu {
namespace {

void batch_stats_kernel(const KernelArgs& a) {
  const Geometry& g = a.g;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "inplace_abn_batch_stats_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const scalar_t* xp = a.x.const_data_ptr<scalar_t>();
    const ReduceGrid r = reduce_grid(g, KV, aligned16(xp), sm_count());
    at::Tensor part = at::empty({3 * r.nchunks * g.C}, a.out1.options());
    auto go = [&](auto kernel, auto... sizes) {
      launch(kernel, r.grid, r.block, xp, sizes..., r.len, r.nchunks, part.mutable_data_ptr<acc_t>());
    };
    if (!rows(g))  // sizes (N, C, S)
      r.K == KV ? go(&stats_contig_kernel<scalar_t, acc_t, KV>, g.N, g.C, g.S)
                : go(&stats_contig_kernel<scalar_t, acc_t, 1>, g.N, g.C, g.S);
    else  // sizes (rows, C)
      r.K == KV ? go(&stats_cl_kernel<scalar_t, acc_t, KV>, g.N * g.S, g.C)
                : go(&stats_cl_kernel<scalar_t, acc_t, 1>, g.N * g.S, g.C);
    launch(&finalize_stats_kernel<acc_t>, dim3(static_cast<unsigned>(fin_blocks(g.C))), dim3(kFinThreads),
           part.const_data_ptr<acc_t>(), r.nchunks, g.C, a.out1.mutable_data_ptr<acc_t>(),
           a.out2.mutable_data_ptr<acc_t>());
  });
}

}  // namespace

IABN_REGISTER_CUDA_KERNEL(batch_stats_stub, &batch_stats_kernel);

}  // namespace gpu
}  // namespace inplace_abn
