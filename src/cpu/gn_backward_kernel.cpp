// gn_backward on the CPU (GroupNorm, contiguous y): the backward of one
// (sample, group) block at a time, in one pass over memory. zc = z - shift
// [- residual] and gz = dy f'(z) of the block go to a per-thread buffer
// (blocks are L2-sized, see gn_backward_fits), its per-channel sums give the
// group means, and dx = a gz + b zc + c0 is computed from the buffer: the
// activation is inverted once, and y and dy are read once.
#include "cpu/kernel_utils.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename S, Act A, bool RES>
void gn_backward_t(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  using Ac = Activation<A, VecMath<F>>;
  constexpr int W = V::size();
  constexpr int NP = DPair<F>::N;
  // SiLU's and ELU's inverses cost more than a store and a load of zc and gz: kept in
  // the buffer; identity and leaky_relu recompute them from y and dy (in the cache)
  constexpr bool kBuffer = A == Act::Silu || A == Act::Elu;
  using D = Vectorized<double>;
  const int64_t N = a.g.N, C = a.g.C, P = a.g.S, cg = C / a.groups, m = cg * P;
  const S* y_ = a.x.const_data_ptr<S>();
  const S* dy_ = a.dy.const_data_ptr<S>();
  const S* res_ = RES ? a.residual.const_data_ptr<S>() : nullptr;
  const int32_t* mask_ = A == Act::Silu ? a.mask.const_data_ptr<int32_t>() : nullptr;
  S* dx_ = a.out1.data_ptr<S>();
  S* dres_ = a.out2.defined() ? a.out2.data_ptr<S>() : nullptr;
  const F* tab = a.coef.const_data_ptr<F>();  // (kGnRows, N C)
  const F *shift_ = tab + kGnShift * N * C, *gain_ = tab + kGnGain * N * C, *rstd_ = tab + kGnRstd * N * C;
  std::vector<double> sums_(2 * N * C);  // per (n, c): sum gz, sum gz zc
  const V p(static_cast<F>(a.param));
  at::parallel_for(0, N * a.groups, std::max<int64_t>(1, kGrain / kCost<A> / m), [&](int64_t b0, int64_t b1) {
    std::vector<F> buf(kBuffer ? 2 * (m + W) : 0);  // zc, then gz; a vector of slack for partial stores
    F *const zcb = buf.data(), *const gzb = zcb + m + W;
    // local copies: the captured originals' addresses escape into the thread pool, so
    // every store to the buffer would reload them (see forward_kernel.cpp)
    const S *const y = y_, *const dy = dy_, *const res = res_;
    const int32_t* const mask = mask_;
    S *const dx = dx_, *const dres = dres_;
    const F *const shift = shift_, *const gain = gain_, *const rstd = rstd_;
    double* const sums = sums_.data();
    const V p_ = p;
    // gz and zc of the vector at element e; lanes past cnt give 0 (to the sums)
    auto elem = [&](int64_t e, int cnt, auto full, const V& sh, V& gz, V& zc) {
      constexpr bool FULL = decltype(full)::value;
      const V left = A == Act::Silu ? from_bits<F>(read_bits(mask, e, cnt)) : V(F(0));
      V d;
      const V z = Ac::inverse_deriv(io::template ld<FULL>(y + e, cnt), left, p_, d);
      gz = io::template ld<FULL>(dy + e, cnt) * d;
      zc = z - sh;
      if constexpr (RES) zc = zc - io::template ld<FULL>(res + e, cnt);
      if constexpr (!FULL) {
        gz = V::set(V(F(0)), gz, cnt);
        zc = V::set(V(F(0)), zc, cnt);
      }
    };
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t col0 = blk * cg;  // the (n, c) column of the block's first channel
      for (int64_t c = 0; c < cg; ++c) {
        const int64_t col = col0 + c, e = col * P, o = c * P;
        const V sh(shift[col]);
        auto kept = [&](int64_t j, int cnt, auto full, V& gz, V& zc) {
          elem(e + j, cnt, full, sh, gz, zc);
          if constexpr (kBuffer) {
            gz.store(gzb + o + j);
            zc.store(zcb + o + j);
          }
        };
        // the sums as reduce2's planes: four vectors pairwise in F, then double
        DPair<F> s1, s2;
        for (int k = 0; k < NP; ++k) s1.v[k] = s2.v[k] = D(0.0);
        auto add = [&](const V& u, const V& uv) {
          const DPair<F> du = todp(u), dw = todp(uv);
          for (int k = 0; k < NP; ++k) {
            s1.v[k] = s1.v[k] + du.v[k];
            s2.v[k] = s2.v[k] + dw.v[k];
          }
        };
        int64_t j = 0;
        for (; j + 4 * W <= P; j += 4 * W) {
          V u0, v0, u1, v1, u2, v2, u3, v3;
          kept(j, W, std::true_type{}, u0, v0);
          kept(j + W, W, std::true_type{}, u1, v1);
          kept(j + 2 * W, W, std::true_type{}, u2, v2);
          kept(j + 3 * W, W, std::true_type{}, u3, v3);
          add((u0 + u1) + (u2 + u3), at::vec::fmadd(u1, v1, u0 * v0) + at::vec::fmadd(u3, v3, u2 * v2));
        }
        for_vectors<W>(P - j, [&](int64_t jj, int cnt, auto full) {
          V u, v;
          kept(j + jj, cnt, full, u, v);
          add(u, u * v);
        });
        sums[2 * col] = lane_sum(s1);
        sums[2 * col + 1] = lane_sum(s2);
      }
      // the group means of g~ gz and g~ gz xhat (= sum gz zc)
      double mz = 0.0, mzx = 0.0;
      for (int64_t c = 0; c < cg; ++c) {
        mz += static_cast<double>(gain[col0 + c]) * sums[2 * (col0 + c)];
        mzx += sums[2 * (col0 + c) + 1];
      }
      mz /= static_cast<double>(m);
      mzx /= static_cast<double>(m);
      for (int64_t c = 0; c < cg; ++c) {
        const int64_t col = col0 + c, e = col * P, o = c * P;
        const auto row = gn_input_row<double>(gain[col], rstd[col], mzx, mz);
        const V ca(static_cast<F>(row[0])), cb(static_cast<F>(row[1])), c0(static_cast<F>(row[2]));
        const V sh(shift[col]);
        for_vectors<W>(P, [&](int64_t j, int cnt, auto full) {
          constexpr bool FULL = decltype(full)::value;
          V gz, zc;
          if constexpr (kBuffer) {
            gz = V::loadu(gzb + o + j);
            zc = V::loadu(zcb + o + j);
          } else {  // again from y and dy, which the block's first pass left in the cache
            elem(e + j, cnt, full, sh, gz, zc);
          }
          io::template st<FULL>(dx + e + j, at::vec::fmadd(ca, gz, at::vec::fmadd(cb, zc, c0)), cnt);
          if (dres) io::template st<FULL>(dres + e + j, gz, cnt);
        });
      }
    }
  });
  // over the samples, in order (the same for any thread count)
  F* sg = a.sum_gz.data_ptr<F>();
  F* sgx = a.sum_gz_xhat.data_ptr<F>();
  for (int64_t c = 0; c < C; ++c) {
    double t1 = 0.0, t2 = 0.0;
    for (int64_t n = 0; n < N; ++n) {
      t1 += sums_[2 * (n * C + c)];
      t2 += sums_[2 * (n * C + c) + 1];
    }
    sg[c] = static_cast<F>(t1);
    sgx[c] = static_cast<F>(t2 / static_cast<double>(gain_[c]));
  }
}

void gn_backward_kernel(const KernelArgs& a) {
  dispatch(a, [&](auto s, auto act, auto res) {
    gn_backward_t<decltype(s), decltype(act)::value, decltype(res)::value>(a);
  });
}

}  // namespace

IABN_REGISTER_CPU_KERNEL(gn_backward_stub, &gn_backward_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
