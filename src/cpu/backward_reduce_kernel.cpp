// backward_reduce on the CPU: per channel, sum gz and sum gz (z - shift
// [- residual]) / gain, with z = f^-1(y), gz = dy f'(z); RELU (identity): gz = dy [z > 0].
#include "cpu/kernel_utils.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename S, Act A, bool RES, bool ZOUT, bool RELU>
void backward_reduce_t(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  using Ac = Activation<A, VecMath<F>>;
  constexpr bool MASK = A == Act::Silu;
  const S* y = a.x.const_data_ptr<S>();
  const S* dy = a.dy.const_data_ptr<S>();
  const S* res = RES ? a.residual.const_data_ptr<S>() : nullptr;
  const MaskBits mask = mask_bits(a.mask, MASK);
  // what the input pass from z needs of the inverse besides y (SiLU), in the compute type (half y: a float32 buffer)
  F* zout = ZOUT ? a.z.data_ptr<F>() : nullptr;
  const V p(static_cast<F>(a.param));
  const int64_t C = a.g.C;
  std::vector<double> s1(C), s2(C);
  reduce2<F>(
      walk_of(a.g, kCost<A>), coef_row<F>(a, kRedShift),
      [=](int64_t i, int64_t j, int cnt, auto full, const auto& co, V& u, V& v) {
        constexpr bool FULL = decltype(full)::value;
        if constexpr (FULL) {
          prefetch(y + i + kPrefetch);
          prefetch(dy + i + kPrefetch);
          if constexpr (RES) prefetch(res + i + kPrefetch);
        }
        const V left = MASK ? from_bits<F>(mask(i, cnt)) : V(F(0));
        V d, z;
        if constexpr (ZOUT) {
          V kept;
          z = Ac::inverse_deriv(io::template ld<FULL>(y + i, cnt), left, p, d, Ac::kIters, &kept);
          IO<F>::template st<FULL>(zout + i, kept, cnt);
        } else {
          z = Ac::inverse_deriv(io::template ld<FULL>(y + i, cnt), left, p, d);
        }
        V gz = io::template ld<FULL>(dy + i, cnt) * d;
        if constexpr (RELU) gz = sel<Cmp::Ge>(V(F(0)), z, V(F(0)), gz);  // threshold_backward(dy, z, 0): NaN z keeps dy
        V zc = z - co.get(0, j);
        if constexpr (RES) zc = zc - io::template ld<FULL>(res + i, cnt);
        if constexpr (!FULL) {
          gz = set_first(V(F(0)), gz, cnt);
          zc = set_first(V(F(0)), zc, cnt);
        }
        u = gz;
        v = zc;
      },
      s1.data(), s2.data(), kCost<A>);
  const F* gain = coef_row<F>(a, kRedGain);
  F* sum_gz = a.out1.data_ptr<F>();
  F* sum_gz_xhat = a.out2.data_ptr<F>();
  for (int64_t c = 0; c < C; ++c) {
    sum_gz[c] = static_cast<F>(s1[c]);
    sum_gz_xhat[c] = static_cast<F>(s2[c] / static_cast<double>(gain[c]));
  }
}

void backward_reduce_kernel(const KernelArgs& a) {
  dispatch(a, [&](auto s, auto act, auto res) {
    using S = decltype(s);
    constexpr Act A = decltype(act)::value;
    constexpr bool R = decltype(res)::value;
    if constexpr (A == Act::Silu)  // z in the compute type (a half-precision y's in float32)
      if (a.z.defined()) return backward_reduce_t<S, A, R, true, false>(a);
    if constexpr (A == Act::Identity)  // the ReLU layer's z (kernel.h)
      if (a.relu) return backward_reduce_t<S, A, R, false, true>(a);
    backward_reduce_t<S, A, R, false, false>(a);
  });
}

}  // namespace

IABN_REGISTER_CPU_KERNEL(backward_reduce_stub, &backward_reduce_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
