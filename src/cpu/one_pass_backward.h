// What the one-pass backward kernels share (gn_backward_kernel.cpp: a GroupNorm block, bn_backward_kernel.cpp: a
// BatchNorm channel): gz and zc of a vector of y, which of them a buffer keeps, and the sums of a span of vectors.
// Both then write dx = a gz + b zc + c0 while the block's y and dy are still in the cache.
#pragma once

#include <array>

#include "cpu/kernel_utils.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// gz = dy f'(z) and zc = z - shift [- residual] of the vector at element e, whose SiLU bit is `bit` of `mask`;
// RELU (identity, y holds z): gz = dy where z > 0. Lanes past cnt give 0 (to the sums).
template <typename S, Act A, bool RES, bool RELU = false>
struct GzZc {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  const S *y, *dy, *res;
  MaskBits mask;
  V p;
  template <bool FULL>
  void operator()(int64_t e, int64_t bit, int cnt, const V& sh, V& gz, V& zc) const {
    const V left = A == Act::Silu ? from_bits<F>(mask(bit, cnt)) : V(F(0));
    V d;
    const V z = Activation<A, VecMath<F>>::inverse_deriv(io::template ld<FULL>(y + e, cnt), left, p, d);
    gz = io::template ld<FULL>(dy + e, cnt) * d;
    if constexpr (RELU) gz = sel<Cmp::Ge>(V(F(0)), z, V(F(0)), gz);  // threshold_backward(dy, z, 0): NaN z keeps dy
    zc = z - sh;
    if constexpr (RES) zc = zc - io::template ld<FULL>(res + e, cnt);
    if constexpr (!FULL) {
      gz = set_first(V(F(0)), gz, cnt);
      zc = set_first(V(F(0)), zc, cnt);
    }
  }
};

// SiLU's and ELU's inverses cost more than a store and a load of zc and gz: these are kept in the buffer; identity
// and leaky_relu recompute them from y and dy, which the first pass left in the cache.
template <Act A>
constexpr bool kBuffer = A == Act::Silu || A == Act::Elu;

// Adds sum gz and sum gz zc of a span of n elements to s1, s2, as reduce2's planes: four vectors pairwise in F, then
// double. kept(j, cnt, full, gz, zc): gz and zc of the vector at offset j (and keeps them where kBuffer).
template <typename F, class Kept>
inline void add_span(int64_t n, const Kept& kept, DPair<F>& s1, DPair<F>& s2) {
  using V = Vectorized<F>;
  constexpr int W = V::size();
  auto add = [&](const V& u, const V& uv) {
    const DPair<F> du = todp(u), dw = todp(uv);
    for (int k = 0; k < DPair<F>::N; ++k) {
      s1.v[k] = s1.v[k] + du.v[k];
      s2.v[k] = s2.v[k] + dw.v[k];
    }
  };
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    V u0, v0, u1, v1, u2, v2, u3, v3;
    kept(j, W, std::true_type{}, u0, v0);
    kept(j + W, W, std::true_type{}, u1, v1);
    kept(j + 2 * W, W, std::true_type{}, u2, v2);
    kept(j + 3 * W, W, std::true_type{}, u3, v3);
    add((u0 + u1) + (u2 + u3), at::vec::fmadd(u1, v1, u0 * v0) + at::vec::fmadd(u3, v3, u2 * v2));
  }
  for_vectors<W>(n - j, [&](int64_t jj, int cnt, auto full) {
    V u, v;
    kept(j + jj, cnt, full, u, v);
    add(u, u * v);
  });
}

// The second pass over a span of n elements at e (memory) / o (buffer): dx = a gz + b zc + c0 from the buffer
// (kBuffer) or from y and dy again, and gz into dres when wanted.
template <typename S, Act A, bool RES, bool RELU, typename F = typename IO<S>::F>
inline void dx_span(int64_t n, int64_t e, int64_t o, const GzZc<S, A, RES, RELU>& el, const Vectorized<F>& sh,
                    const std::array<Vectorized<F>, 3>& row, const F* gzb, const F* zcb, S* dx, S* dres) {
  using V = Vectorized<F>;
  for_vectors<V::size()>(n, [&](int64_t j, int cnt, auto full) {
    constexpr bool FULL = decltype(full)::value;
    V gz, zc;
    if constexpr (kBuffer<A>) {
      gz = V::loadu(gzb + o + j);
      zc = V::loadu(zcb + o + j);
    } else {
      el.template operator()<FULL>(e + j, e + j, cnt, sh, gz, zc);
    }
    IO<S>::template st<FULL>(dx + e + j, at::vec::fmadd(row[0], gz, at::vec::fmadd(row[1], zc, row[2])), cnt);
    if (dres) IO<S>::template st<FULL>(dres + e + j, gz, cnt);
  });
}

// A DPair of zeros.
template <typename F>
inline DPair<F> dzero() {
  DPair<F> s;
  for (int k = 0; k < DPair<F>::N; ++k) s.v[k] = Vectorized<double>(0.0);
  return s;
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
