// backward_reduce on CUDA: per-block sums of gz and gz zc (bwd_reduce_*_kernel),
// then one warp per channel divides the second by g~ (finalize_sums_kernel).
#include "cuda/launch.cuh"

namespace inplace_abn {
namespace gpu {
namespace {

void backward_reduce_kernel(const KernelArgs& a) {
  const Geometry& g = a.g;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "inplace_abn_backward_reduce_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const scalar_t* yp = a.x.const_data_ptr<scalar_t>();
    const scalar_t* dyp = a.dy.const_data_ptr<scalar_t>();
    const scalar_t* rp = ptr_or_null<scalar_t>(a.residual);
    const acc_t* cp = a.coef.const_data_ptr<acc_t>();
    const ReduceGrid r = reduce_grid(g, KV, aligned16(yp) && aligned16(dyp) && aligned16(rp), sm_count());
    at::Tensor part = at::empty({2 * r.nchunks * g.C}, a.out1.options());
    dispatch_act(a.act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      auto go = [&](auto kernel, auto... sizes) {
        launch(kernel, r.grid, r.block, yp, dyp, rp, mask_ptr(a), cp, static_cast<acc_t>(a.param), sizes..., r.len,
               r.nchunks, part.mutable_data_ptr<acc_t>());
      };
      if (!rows(g))  // sizes (N, C, S)
        r.K == KV ? go(&bwd_reduce_contig_kernel<scalar_t, acc_t, A, KV>, g.N, g.C, g.S)
                  : go(&bwd_reduce_contig_kernel<scalar_t, acc_t, A, 1>, g.N, g.C, g.S);
      else  // sizes (rows, C)
        r.K == KV ? go(&bwd_reduce_cl_kernel<scalar_t, acc_t, A, KV>, g.N * g.S, g.C)
                  : go(&bwd_reduce_cl_kernel<scalar_t, acc_t, A, 1>, g.N * g.S, g.C);
    });
    launch(&finalize_sums_kernel<acc_t>, dim3(static_cast<unsigned>(fin_blocks(g.C))), dim3(kFinThreads),
           part.const_data_ptr<acc_t>(), r.nchunks, g.C, cp + kRedGain * g.C, a.out1.mutable_data_ptr<acc_t>(),
           a.out2.mutable_data_ptr<acc_t>());
  });
}

}  // namespace

IABN_REGISTER_CUDA_KERNEL(backward_reduce_stub, &backward_reduce_kernel);

}  // namespace gpu
}  // namespace inplace_abn
