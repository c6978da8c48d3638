// backward_input on CUDA: dx (and the residual gradient) from y
// (backward_input_kernel, a grid-stride element-wise kernel).
#include "cuda/launch.cuh"

namespace inplace_abn {
namespace gpu {
namespace {

void backward_input_kernel_cuda(const KernelArgs& a) {
  const Geometry& g = a.g;
  const int sms = sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "inplace_abn_backward_input_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const scalar_t* yp = a.x.const_data_ptr<scalar_t>();
    const scalar_t* dyp = a.dy.const_data_ptr<scalar_t>();
    const scalar_t* rp = ptr_or_null<scalar_t>(a.residual);
    const uint32_t* mp = mask_ptr(a);
    scalar_t* dxp = a.out1.mutable_data_ptr<scalar_t>();
    scalar_t* drp = a.out2.defined() ? a.out2.mutable_data_ptr<scalar_t>() : nullptr;
    const acc_t* cp = a.coef.const_data_ptr<acc_t>();
    const acc_t param = static_cast<acc_t>(a.param);
    const bool vec = aligned16(yp) && aligned16(dyp) && aligned16(rp) && aligned16(dxp) && aligned16(drp);
    const EwConfig cfg = ew_config(g.numel, vec ? KV : 1, g, sms);
    const dim3 grid(static_cast<unsigned>(cfg.blocks)), block(cfg.threads);
    dispatch_act(a.act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      auto go = [&](auto kernel) {
        launch(kernel, grid, block, yp, dyp, rp, mp, cp, param, g.numel, g.inner(), g.C, dxp, drp);
      };
      if (vec)
        cfg.fixed ? go(&backward_input_kernel<scalar_t, acc_t, A, KV, true>)
                  : go(&backward_input_kernel<scalar_t, acc_t, A, KV, false>);
      else
        cfg.fixed ? go(&backward_input_kernel<scalar_t, acc_t, A, 1, true>)
                  : go(&backward_input_kernel<scalar_t, acc_t, A, 1, false>);
    });
  });
}

}  // namespace

IABN_REGISTER_CUDA_KERNEL(backward_input_stub, &backward_input_kernel_cuda);

}  // namespace gpu
}  // namespace inplace_abn
