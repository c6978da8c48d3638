// backward_input on the CPU: dx = a gz + b (z - shift [- residual]) + c0, dresidual = gz,
// with z = f^-1(y), gz = dy f'(z); RELU (identity): gz = dy [z > 0].
#include "cpu/kernel_utils.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename S, Act A, bool RES, bool FROMZ, bool RELU>
void backward_input_t(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  using Ac = Activation<A, VecMath<F>>;
  const Walk g = walk_of(a.g, kCost<A>);
  const CoefRows<F, kInRows> cr(a, g);
  const S* y = a.x.const_data_ptr<S>();
  const S* dy = a.dy.const_data_ptr<S>();
  const S* res = RES ? a.residual.const_data_ptr<S>() : nullptr;
  const MaskBits mask = mask_bits(a.mask, A == Act::Silu && !FROMZ);
  const S* kept = FROMZ ? a.z.const_data_ptr<S>() : nullptr;
  S* dx = a.out1.data_ptr<S>();
  S* dres = a.out2.defined() ? a.out2.data_ptr<S>() : nullptr;
  const V p(static_cast<F>(a.param));
  at::parallel_for(0, g.numel, kGrain, [&](int64_t e0, int64_t e1) {
    // captures by value (see for_each_vector)
    for_each_vector(g, cr, e0, e1, [=](int64_t i, int64_t j, int cnt, auto full, const auto& co) {
      constexpr bool FULL = decltype(full)::value;
      const V yv = io::template ld<FULL>(y + i, cnt), gv = io::template ld<FULL>(dy + i, cnt);
      V d, z;
      if constexpr (FROMZ) {  // from what backward_reduce kept (backward_input_from_z_)
        z = Ac::from_kept(yv, io::template ld<FULL>(kept + i, cnt), d);
      } else {
        const V left = A == Act::Silu ? from_bits<F>(mask(i, cnt)) : V(F(0));
        z = Ac::inverse_deriv(yv, left, p, d);
      }
      V gz = gv * d;
      if constexpr (RELU) gz = sel<Cmp::Ge>(V(F(0)), z, V(F(0)), gz);  // as backward_reduce
      V zc = z - co.get(kInShift, j);
      if constexpr (RES) zc = zc - io::template ld<FULL>(res + i, cnt);
      io::template st<FULL>(dx + i, at::vec::fmadd(co.get(kInA, j), gz, at::vec::fmadd(co.get(kInB, j), zc, co.get(kInC0, j))), cnt);
      if (dres) io::template st<FULL>(dres + i, gz, cnt);
    });
  });
}

void backward_input_kernel(const KernelArgs& a) {
  dispatch(a, [&](auto s, auto act, auto res) {
    using S = decltype(s);
    constexpr Act A = decltype(act)::value;
    constexpr bool R = decltype(res)::value;
    if constexpr (A == Act::Silu && std::is_same_v<S, typename IO<S>::F>)
      if (a.from_z) return backward_input_t<S, A, R, true, false>(a);
    TORCH_CHECK(!a.from_z, "inplace_abn: backward_input_from_z_ is for SiLU in float32/float64");
    if constexpr (A == Act::Identity)  // the ReLU layer's z (kernel.h)
      if (a.relu) return backward_input_t<S, A, R, false, true>(a);
    backward_input_t<S, A, R, false, false>(a);
  });
}

}  // namespace

IABN_REGISTER_CPU_KERNEL(backward_input_stub, &backward_input_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
