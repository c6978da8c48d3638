// forward_ on CUDA: normalise, affine, activation, in place (or from source into x); SiLU mask
// (forward_kernel, a grid-stride element-wise kernel).
#include "cuda/launch.cuh"

namespace inplace_abn {
namespace gpu {
namespace {

void forward_kernel_cuda(const KernelArgs& a) {
  const Geometry& g = a.g;
  const int sms = sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "inplace_abn_forward_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    scalar_t* xp = a.x.mutable_data_ptr<scalar_t>();
    const scalar_t* sp = a.source.defined() ? a.source.const_data_ptr<scalar_t>() : xp;  // read from
    const scalar_t* rp = ptr_or_null<scalar_t>(a.residual);
    uint32_t* mp = const_cast<uint32_t*>(mask_ptr(a));
    const acc_t* cp = a.coef.const_data_ptr<acc_t>();
    const bool vec = aligned16(xp) && aligned16(sp) && aligned16(rp);
    const EwConfig cfg = ew_config(g.numel, vec ? KV : 1, g, sms);
    const dim3 grid(static_cast<unsigned>(cfg.blocks)), block(cfg.threads);
    const acc_t param = static_cast<acc_t>(a.param);
    acc_t* zp = a.out1.defined() ? a.out1.mutable_data_ptr<acc_t>() : nullptr;  // ReLU path
    dispatch_act(a.act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      auto go = [&](auto kernel) { launch(kernel, grid, block, xp, sp, rp, mp, cp, param, g.numel, g.inner(), g.C, zp); };
      if (vec)
        cfg.fixed ? go(&forward_kernel<scalar_t, acc_t, A, KV, true>) : go(&forward_kernel<scalar_t, acc_t, A, KV, false>);
      else
        cfg.fixed ? go(&forward_kernel<scalar_t, acc_t, A, 1, true>) : go(&forward_kernel<scalar_t, acc_t, A, 1, false>);
    });
  });
}

}  // namespace

IABN_REGISTER_CUDA_KERNEL(forward_stub, &forward_kernel_cuda);

}  // namespace gpu
}  // namespace inplace_abn
