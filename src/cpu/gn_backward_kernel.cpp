// gn_backward on the CPU (GroupNorm): the backward of one block at a time, in one pass over memory: a (sample, group)
// of a contiguous y, a sample of a channels-last one. zc = z - shift [- residual] and gz = dy f'(z) of the block go
// to a per-thread buffer (blocks are L2-sized: gn_backward_fits, src/ops/gn_backward.cpp), its per-channel sums give
// the group means, and dx = a gz + b zc + c0 is computed from the buffer: the activation is inverted once, and y and
// dy come from memory once (identity and leaky_relu read them again from the cache, see kBuffer).
#define IABN_INLINE_SILU_INVERSE  // (src/activations.h)
#include "cpu/one_pass_backward.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// What both layouts share: the table, outputs, per-(n, c) sums.
template <typename S, Act A, bool RES>
struct GnArgs {
  using F = typename IO<S>::F;
  int64_t N, C, P, cg, m;
  GzZc<S, A, RES> el;
  S *dx, *dres;
  const F *shift, *gain, *rstd;  // rows of the (kGnRows, N C) table
  std::vector<double> sums;      // per (n, c): sum gz, sum gz zc
  explicit GnArgs(const KernelArgs& a)
      : N(a.g.N), C(a.g.C), P(a.g.S), cg(C / a.groups), m(cg * P),
        el{a.x.const_data_ptr<S>(), a.dy.const_data_ptr<S>(), RES ? a.residual.const_data_ptr<S>() : nullptr,
           mask_bits(a.mask, A == Act::Silu),
           Vectorized<F>(static_cast<F>(a.param))},
        dx(a.out1.data_ptr<S>()), dres(a.out2.defined() ? a.out2.data_ptr<S>() : nullptr),
        shift(a.coef.const_data_ptr<F>() + kGnShift * N * C), gain(shift + (kGnGain - kGnShift) * N * C),
        rstd(shift + (kGnRstd - kGnShift) * N * C), sums(2 * N * C) {}
  // the (n, group) means of g~ gz and g~ gz xhat (= sum gz zc) from the sums of its channels
  std::array<double, 2> group_means(int64_t col0) const {
    double mz = 0.0, mzx = 0.0;
    for (int64_t c = 0; c < cg; ++c) {
      mz += static_cast<double>(gain[col0 + c]) * sums[2 * (col0 + c)];
      mzx += sums[2 * (col0 + c) + 1];
    }
    return {mz / static_cast<double>(m), mzx / static_cast<double>(m)};
  }
  // the sums over the samples, in order (the same for any thread count)
  void finish(const KernelArgs& a) const {
    F* sg = a.sum_gz.data_ptr<F>();
    F* sgx = a.sum_gz_xhat.data_ptr<F>();
    for (int64_t c = 0; c < C; ++c) {
      double t1 = 0.0, t2 = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        t1 += sums[2 * (n * C + c)];
        t2 += sums[2 * (n * C + c) + 1];
      }
      sg[c] = static_cast<F>(t1);
      sgx[c] = static_cast<F>(t2 / static_cast<double>(gain[c]));
    }
  }
};

// Contiguous (N, C, P): a block is one (sample, group), cg planes of P elements.
template <typename S, Act A, bool RES>
void gn_backward_planes(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  constexpr int W = V::size();
  GnArgs<S, A, RES> ga(a);
  const int64_t cg = ga.cg, P = ga.P, m = ga.m;
  at::parallel_for(0, ga.N * a.groups, std::max<int64_t>(1, kGrain / kCost<A> / m), [&](int64_t b0, int64_t b1) {
    std::vector<F> buf(kBuffer<A> ? 2 * (m + W) : 0);  // zc, then gz; a vector of slack for partial stores
    F *const zcb = buf.data(), *const gzb = zcb + m + W;
    // local copies: the captured originals' addresses escape into the thread pool, so
    // every store to the buffer would reload them (see forward_kernel.cpp)
    const GzZc<S, A, RES> el = ga.el;
    S *const dx = ga.dx, *const dres = ga.dres;
    double* const sums = ga.sums.data();
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t col0 = blk * cg;  // the (n, c) column of the block's first channel
      for (int64_t c = 0; c < cg; ++c) {
        const int64_t col = col0 + c, e = col * P, o = c * P;
        const V sh(ga.shift[col]);
        auto kept = [&](int64_t j, int cnt, auto full, V& gz, V& zc) {
          el.template operator()<decltype(full)::value>(e + j, e + j, cnt, sh, gz, zc);
          if constexpr (kBuffer<A>) {
            gz.store(gzb + o + j);
            zc.store(zcb + o + j);
          }
        };
        DPair<F> s1 = dzero<F>(), s2 = dzero<F>();
        add_span<F>(P, kept, s1, s2);
        sums[2 * col] = lane_sum(s1);
        sums[2 * col + 1] = lane_sum(s2);
      }
      const auto [mz, mzx] = ga.group_means(col0);
      for (int64_t c = 0; c < cg; ++c) {
        const int64_t col = col0 + c, e = col * P, o = c * P;
        double row[3];
        gn_input_row(ga.gain[col], ga.rstd[col], mzx, mz, row);
        const std::array<V, 3> coef{V(static_cast<F>(row[0])), V(static_cast<F>(row[1])), V(static_cast<F>(row[2]))};
        dx_span(P, e, o, el, V(ga.shift[col]), coef, gzb, zcb, dx, dres);
      }
    }
  });
  ga.finish(a);
}

// Channels-last (N, P, C): a block is one sample, P rows of C channels, its groups interleaved in every row;
// per-channel sums in the compute type over kRows rows, then in double (as reduce2's rows). The SiLU mask is the
// samples' masks, each padded to whole 32-bit words (Groups).
template <typename S, Act A, bool RES>
void gn_backward_rows(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  constexpr int W = V::size();
  constexpr int64_t kRows = sizeof(F) == sizeof(float) ? 4 : 1;
  GnArgs<S, A, RES> ga(a);
  const int64_t C = ga.C, P = ga.P, G = a.groups, cg = ga.cg, words = (P * C + 31) / 32;  // (Groups::mask_size)
  at::parallel_for(0, ga.N, 1, [&](int64_t n0, int64_t n1) {
    const int64_t CP = (C + W - 1) / W * W;  // a row padded to whole vectors
    std::vector<F> buf(kBuffer<A> ? 2 * (P * C + W) : 0), acc(2 * CP), coef(3 * CP);
    std::vector<double> dacc(2 * C);
    F *const zcb = buf.data(), *const gzb = zcb + P * C + W;
    const GzZc<S, A, RES> el0 = ga.el;
    S *const dx = ga.dx, *const dres = ga.dres;
    for (int64_t n = n0; n < n1; ++n) {
      GzZc<S, A, RES> el = el0;
      if constexpr (A == Act::Silu) el.mask = MaskBits(a.mask.const_data_ptr<int32_t>() + n * words, words);
      const int64_t base = n * P * C, col0 = n * C;
      const F* const sh = ga.shift + col0;
      std::fill(acc.begin(), acc.end(), F(0));
      std::fill(dacc.begin(), dacc.end(), 0.0);
      auto flush = [&] {
        for (int64_t c = 0; c < C; ++c) {
          dacc[c] += static_cast<double>(acc[c]);
          dacc[C + c] += static_cast<double>(acc[CP + c]);
        }
        std::fill(acc.begin(), acc.end(), F(0));
      };
      for (int64_t s = 0; s < P; ++s) {
        for_vectors<W>(C, [&](int64_t j, int cnt, auto full) {
          constexpr bool FULL = decltype(full)::value;
          const int64_t o = s * C + j;
          V gz, zc;
          el.template operator()<FULL>(base + o, o, cnt, FULL ? V::loadu(sh + j) : V::loadu(sh + j, cnt), gz, zc);
          if constexpr (kBuffer<A>) {
            gz.store(gzb + o);
            zc.store(zcb + o);
          }
          (V::loadu(acc.data() + j) + gz).store(acc.data() + j);
          at::vec::fmadd(gz, zc, V::loadu(acc.data() + CP + j)).store(acc.data() + CP + j);
        });
        if (s % kRows == kRows - 1 || s + 1 == P) flush();
      }
      for (int64_t c = 0; c < C; ++c) {
        ga.sums[2 * (col0 + c)] = dacc[c];
        ga.sums[2 * (col0 + c) + 1] = dacc[C + c];
      }
      for (int64_t g = 0; g < G; ++g) {
        const auto [mz, mzx] = ga.group_means(col0 + g * cg);
        for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
          double row[3];
          gn_input_row(ga.gain[col0 + c], ga.rstd[col0 + c], mzx, mz, row);
          for (int k = 0; k < 3; ++k) coef[k * CP + c] = static_cast<F>(row[k]);
        }
      }
      for (int64_t s = 0; s < P; ++s) {
        for_vectors<W>(C, [&](int64_t j, int cnt, auto full) {
          constexpr bool FULL = decltype(full)::value;
          const int64_t o = s * C + j;
          V gz, zc;
          if constexpr (kBuffer<A>) {
            gz = V::loadu(gzb + o);
            zc = V::loadu(zcb + o);
          } else {
            el.template operator()<FULL>(base + o, o, cnt, FULL ? V::loadu(sh + j) : V::loadu(sh + j, cnt), gz, zc);
          }
          const V dxv = at::vec::fmadd(V::loadu(coef.data() + j), gz,
                                       at::vec::fmadd(V::loadu(coef.data() + CP + j), zc,
                                                      V::loadu(coef.data() + 2 * CP + j)));
          io::template st<FULL>(dx + base + o, dxv, cnt);
          if (dres) io::template st<FULL>(dres + base + o, gz, cnt);
        });
      }
    }
  });
  ga.finish(a);
}

void gn_backward_kernel(const KernelArgs& a) {
  dispatch(a, [&](auto s, auto act, auto res) {
    using S = decltype(s);
    constexpr Act A = decltype(act)::value;
    constexpr bool R = decltype(res)::value;
    a.g.channels_last ? gn_backward_rows<S, A, R>(a) : gn_backward_planes<S, A, R>(a);
  });
}

}  // namespace

IABN_REGISTER_CPU_KERNEL(gn_backward_stub, &gn_backward_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
