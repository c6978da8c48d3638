// bn_backward on the CPU (BatchNorm, contiguous y): the reduce and input passes one channel at a time, so that y and
// dy come from memory once. A channel's N planes are summed (gz and gz zc, zc = z - shift [- residual]), its input
// row (a, b, c0) follows from the two sums, and dx = a gz + b zc + c0 is written while the channel's y and dy are
// still in the cache (the front end takes this kernel only where a channel fits: bn_backward_fits,
// src/ops/bn_backward.cpp). SiLU and ELU keep gz and zc in a per-thread buffer instead of inverting twice (kBuffer,
// one_pass_backward.h).
// Each channel's sums are one thread's, in a fixed order: the same bits at any thread count.
#define IABN_INLINE_SILU_INVERSE  // (src/activations.h)
#include "cpu/one_pass_backward.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename S, Act A, bool RES, bool RELU>
void bn_backward_planes(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  constexpr int W = V::size();
  const int64_t N = a.g.N, C = a.g.C, P = a.g.S, m = N * P;
  const GzZc<S, A, RES, RELU> el0{a.x.const_data_ptr<S>(), a.dy.const_data_ptr<S>(),
                                  RES ? a.residual.const_data_ptr<S>() : nullptr, mask_bits(a.mask, A == Act::Silu),
                                  V(static_cast<F>(a.param))};
  S* const dx0 = a.out1.data_ptr<S>();
  S* const dres0 = a.out2.defined() ? a.out2.data_ptr<S>() : nullptr;
  const F* const shift = a.coef.const_data_ptr<F>() + kGnShift * C;
  const F* const gain = a.coef.const_data_ptr<F>() + kGnGain * C;
  const F* const rstd = a.coef.const_data_ptr<F>() + kGnRstd * C;
  F* const sum_gz = a.sum_gz.data_ptr<F>();
  F* const sum_gz_xhat = a.sum_gz_xhat.data_ptr<F>();
  const double scale = a.sums_scale;
  const ChannelWalk walk(N, C, P);  // (software prefetch along it)
  at::parallel_for(0, C, std::max<int64_t>(1, kGrain / kCost<A> / m), [&](int64_t c0, int64_t c1) {
    std::vector<F> buf(kBuffer<A> ? 2 * (m + W) : 0);  // zc, then gz; a vector of slack for partial stores
    F *const zcb = buf.data(), *const gzb = zcb + m + W;
    // local copies: the captured originals' addresses escape into the thread pool (see forward_kernel.cpp)
    const GzZc<S, A, RES, RELU> el = el0;
    S *const dx = dx0, *const dres = dres0;
    for (int64_t c = c0; c < c1; ++c) {
      const V sh(shift[c]);
      DPair<F> s1 = dzero<F>(), s2 = dzero<F>();
      for (int64_t n = 0; n < N; ++n) {
        const int64_t e = (n * C + c) * P, o = n * P;
        const int64_t next = walk.next_plane(e, n, c);
        add_span<F>(P, [&](int64_t j, int cnt, auto full, V& gz, V& zc) {
          if constexpr (decltype(full)::value) {
            const int64_t t = walk.target(e, next, j);
            prefetch(el.y + t);
            prefetch(el.dy + t);
            if constexpr (RES) prefetch(el.res + t);
          }
          el.template operator()<decltype(full)::value>(e + j, e + j, cnt, sh, gz, zc);
          if constexpr (kBuffer<A>) {
            gz.store(gzb + o + j);
            zc.store(zcb + o + j);
          }
        }, s1, s2);
      }
      const double t1 = lane_sum(s1), t2 = lane_sum(s2), g = static_cast<double>(gain[c]);
      sum_gz[c] = static_cast<F>(t1);
      sum_gz_xhat[c] = static_cast<F>(t2 / g);
      // the channel's means of gz zc and g~ gz (in eval the statistics are constants: scale 0 drops them)
      double row[3];
      gn_input_row(g, static_cast<double>(rstd[c]), scale ? t2 * scale : 0.0, scale ? g * t1 * scale : 0.0, row);
      const std::array<V, 3> coef{V(static_cast<F>(row[0])), V(static_cast<F>(row[1])), V(static_cast<F>(row[2]))};
      for (int64_t n = 0; n < N; ++n) dx_span(P, (n * C + c) * P, n * P, el, sh, coef, gzb, zcb, dx, dres);
    }
  });
}

void bn_backward_kernel(const KernelArgs& a) {
  dispatch_relu(a, a.relu, [&](auto s, auto act, auto res, auto relu) {
    bn_backward_planes<decltype(s), decltype(act)::value, decltype(res)::value, decltype(relu)::value>(a);
  });
}

}  // namespace

IABN_REGISTER_CPU_KERNEL(bn_backward_stub, &bn_backward_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
