// The element-wise CPU kernels, forward_ and backward_input, as templates: forward_kernel.cpp and
// backward_input_kernel.cpp instantiate them walking every vector in memory order, paired_rows_kernel.cpp walking
// the super-rows of the rows layout in pairs (for_each_pair), in a file of its own (see there).
//
// forward_ on the CPU: x <- f((x - mean_hi - mean_lo) scale + shift [+ residual]), in place (or from source, when
// given, into x); SiLU: the branch bits [z < z*] in memory order. ZOUT (ReLU, with identity): z into out1 (the
// compute type), max(z, 0) into x.
//
// backward_input on the CPU: dx = a gz + b (z - shift [- residual]) + c0, dresidual = gz,
// with z = f^-1(y), gz = dy f'(z); RELU (identity): gz = dy [z > 0].
#pragma once
#include "cpu/kernel_utils.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {

// The kernels with the super-rows in pairs, for the activations of kPairedRows (paired_rows_kernel.cpp).
void forward_paired_kernel(const KernelArgs& a);
void backward_input_paired_kernel(const KernelArgs& a);

namespace {

// Whose rows walk pairs super-rows: the cheap activations, whose kernels the four coefficient loads per vector held
// back. Not SiLU, whose forward_ writes its mask in memory order.
template <Act A>
constexpr bool kPairedRows = kCost<A> == 1;

// forward_'s element step, shared with bn_forward's kernel: z from the input vector at element i and the
// coefficient vectors (ForwardRow), y = f(z) into x (ZOUT: z into z_out, max(z, 0) into x); SiLU: z's branch bits
// into bw.
template <typename S, Act A, bool RES, bool ZOUT>
struct ForwardStep {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  S* x;
  const S *in, *res;
  F* zout;
  V p;
  ForwardStep(const KernelArgs& a, const at::Tensor& z_out)
      : x(a.x.data_ptr<S>()),
        in(a.source.defined() ? a.source.const_data_ptr<S>() : x),
        res(RES ? a.residual.const_data_ptr<S>() : nullptr),
        zout(ZOUT ? z_out.data_ptr<F>() : nullptr),
        p(static_cast<F>(a.param)) {}
  template <bool FULL>
  void operator()(int64_t i, int cnt, const V& mean_hi, const V& mean_lo, const V& scale, const V& shift,
                  BitWriter& bw) const {
    V z = at::vec::fmadd((io::template ld<FULL>(in + i, cnt) - mean_hi) - mean_lo, scale, shift);
    if constexpr (RES) z = z + io::template ld<FULL>(res + i, cnt);
    if constexpr (ZOUT) {
      if constexpr (FULL)
        z.store(zout + i);
      else
        z.store(zout + i, cnt);
      io::template st<FULL>(x + i, at::vec::clamp_min(z, V(F(0))), cnt);  // NaN stays NaN, as torch.relu
    } else {
      io::template st<FULL>(x + i, Activation<A, VecMath<F>>::forward(z, p), cnt);
    }
    if constexpr (A == Act::Silu) {  // Silu::branch(z) = [z < z*], one compare
      const uint32_t bits = lt_bits(z, V(static_cast<F>(kSiluZStar)));
      bw.put(FULL ? bits : bits & low_bits(cnt), cnt);
    }
  }
};

template <typename S, Act A, bool RES, bool ZOUT, bool PAIRED>
void forward_t(const KernelArgs& a) {
  using F = typename IO<S>::F;
  constexpr bool MASK = A == Act::Silu;
  static_assert(!(MASK && PAIRED), "the mask bits are written in memory order");
  const Walk g = walk_of(a.g, kCost<A>, true);
  const CoefRows<F, kFwdRows> cr(a, g);
  int32_t* mask = MASK ? a.mask.data_ptr<int32_t>() : nullptr;
  const ForwardStep<S, A, RES, ZOUT> fs(a, a.out1);
  // Tasks start on mask-word boundaries so that no two write the same word.
  at::parallel_for(0, (g.numel + 31) / 32, kGrain / kCost<A> / 32, [&](int64_t w0, int64_t w1) {
    BitWriter bw(MASK ? mask + w0 : nullptr);
    // by value: by reference, each vector store reloaded the pointers (forward_ 0.50 -> 0.38 ms; see for_each_vector)
    const auto step = [=, &bw](int64_t i, int64_t j, int cnt, auto full, const auto& co) {
      fs.template operator()<decltype(full)::value>(i, cnt, co.get(kFwdMeanHi, j), co.get(kFwdMeanLo, j),
                                                    co.get(kFwdScale, j), co.get(kFwdShift, j), bw);
    };
    for_each_vector<PAIRED>(g, cr, w0 * 32, std::min(w1 * 32, g.numel), step);
    if (MASK) bw.flush();
  });
}

template <bool PAIRED>
void forward_kernel_t(const KernelArgs& a) {
  dispatch(a, [&](auto s, auto act, auto res) {
    constexpr Act A = decltype(act)::value;
    if constexpr (!PAIRED && kPairedRows<A>)
      if (walk_of(a.g, kCost<A>, true).rows) return forward_paired_kernel(a);
    if constexpr (PAIRED && !kPairedRows<A>) {
      TORCH_INTERNAL_ASSERT(false, "inplace_abn: no paired rows walk for this activation");
    } else {
      if constexpr (A == Act::Identity)  // the ReLU path exists for the identity only
        if (a.out1.defined()) return forward_t<decltype(s), A, decltype(res)::value, true, PAIRED>(a);
      forward_t<decltype(s), A, decltype(res)::value, false, PAIRED>(a);
    }
  });
}

template <typename S, Act A, bool RES, bool FROMZ, bool RELU, bool PAIRED>
void backward_input_t(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  using Ac = Activation<A, VecMath<F>>;
  const Walk g = walk_of(a.g, kCost<A>, true);
  const CoefRows<F, kInRows> cr(a, g);
  const S* y = a.x.const_data_ptr<S>();
  const S* dy = a.dy.const_data_ptr<S>();
  const S* res = RES ? a.residual.const_data_ptr<S>() : nullptr;
  const MaskBits mask = mask_bits(a.mask, A == Act::Silu && !FROMZ);
  const F* kept = FROMZ ? a.z.const_data_ptr<F>() : nullptr;  // in the compute type (half y: a float buffer)
  S* dx = a.out1.data_ptr<S>();
  S* dres = a.out2.defined() ? a.out2.data_ptr<S>() : nullptr;
  const V p(static_cast<F>(a.param));
  at::parallel_for(0, g.numel, kGrain, [&](int64_t e0, int64_t e1) {
    // captures by value (see for_each_vector)
    for_each_vector<PAIRED>(g, cr, e0, e1, [=](int64_t i, int64_t j, int cnt, auto full, const auto& co) {
      constexpr bool FULL = decltype(full)::value;
      const V yv = io::template ld<FULL>(y + i, cnt), gv = io::template ld<FULL>(dy + i, cnt);
      V d, z;
      if constexpr (FROMZ) {  // from what backward_reduce kept (backward_input_from_z_)
        z = Ac::from_kept(yv, IO<F>::template ld<FULL>(kept + i, cnt), d);
      } else {
        const V left = A == Act::Silu ? from_bits<F>(mask(i, cnt)) : V(F(0));
        z = Ac::inverse_deriv(yv, left, p, d);
      }
      V gz = gv * d;
      if constexpr (RELU) gz = sel<Cmp::Ge>(V(F(0)), z, V(F(0)), gz);  // as backward_reduce
      V zc = z - co.get(kInShift, j);
      if constexpr (RES) zc = zc - io::template ld<FULL>(res + i, cnt);
      const V dxv = at::vec::fmadd(co.get(kInA, j), gz, at::vec::fmadd(co.get(kInB, j), zc, co.get(kInC0, j)));
      io::template st<FULL>(dx + i, dxv, cnt);
      if (dres) io::template st<FULL>(dres + i, gz, cnt);
    });
  });
}

template <bool PAIRED>
void backward_input_kernel_t(const KernelArgs& a) {
  dispatch(a, [&](auto s, auto act, auto res) {
    using S = decltype(s);
    constexpr Act A = decltype(act)::value;
    constexpr bool R = decltype(res)::value;
    if constexpr (!PAIRED && kPairedRows<A>)
      if (walk_of(a.g, kCost<A>, true).rows) return backward_input_paired_kernel(a);
    if constexpr (PAIRED && !kPairedRows<A>) {
      TORCH_INTERNAL_ASSERT(false, "inplace_abn: no paired rows walk for this activation");
    } else {
      if constexpr (A == Act::Silu)
        if (a.from_z) return backward_input_t<S, A, R, true, false, PAIRED>(a);
      TORCH_CHECK(!a.from_z, "inplace_abn: the input pass from a kept z is for SiLU only");
      if constexpr (A == Act::Identity)  // the ReLU layer's z (kernel.h)
        if (a.relu) return backward_input_t<S, A, R, false, true, PAIRED>(a);
      backward_input_t<S, A, R, false, false, PAIRED>(a);
    }
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
