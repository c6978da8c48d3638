// bn_forward on the CPU (BatchNorm training forward, contiguous x): batch_stats and forward_ one channel at a time,
// so that x comes from memory once. A channel's N planes are summed as batch_stats sums them (plane_sums, the same
// order: the same mean and var to the bit), its forward column follows (table_column, as forward_'s coefficient
// table), and y is written while the channel is still in the cache (the front end takes this kernel only where a
// channel fits and batch_stats walks planes: bn_forward_fits, src/ops/bn_forward.cpp). Element-wise, y is forward_'s
// (ForwardStep). Each channel is one thread's: the same bits at any thread count.
#include "cpu/elementwise_kernels.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename S, Act A, bool RES, bool ZOUT>
void bn_forward_planes(const KernelArgs& a) {
  using F = typename IO<S>::F;
  using V = Vectorized<F>;
  constexpr bool MASK = A == Act::Silu;
  const int64_t N = a.g.N, C = a.g.C, P = a.g.S;
  TORCH_INTERNAL_ASSERT(!walk_of(a.g, 1).rows && P <= kPart && (!MASK || P % 32 == 0),
                        "inplace_abn: bn_forward's kernel needs batch_stats' planes walk, one part per plane and "
                        "(SiLU) planes of whole mask words");
  const ForwardStep<S, A, RES, ZOUT> fs0(a, a.z);
  const S* const in0 = fs0.in;
  int32_t* const mask0 = MASK ? a.mask.data_ptr<int32_t>() : nullptr;
  const double* const wb = a.coef.const_data_ptr<double>();  // (2, C): weight, bias
  F* const mean = a.out1.data_ptr<F>();
  F* const var = a.out2.data_ptr<F>();
  const TableSpec spec = a.spec;
  const double n = static_cast<double>(N * P);
  const ChannelWalk walk(N, C, P);  // (software prefetch along it)
  at::parallel_for(0, C, std::max<int64_t>(1, kGrain / kCost<A> / (N * P)), [&](int64_t c0, int64_t c1) {
    // local copies: the captured originals' addresses escape into the thread pool (see forward_kernel.cpp)
    const ForwardStep<S, A, RES, ZOUT> fs = fs0;
    const S* const in = in0;
    int32_t* const mask = mask0;
    for (int64_t c = c0; c < c1; ++c) {
      const F K = static_cast<F>(in[c * P]);  // batch_stats' shift: the channel's first element
      const V k(K);
      double s1 = 0.0, s2 = 0.0;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t e = (i * C + c) * P;
        const int64_t next = walk.next_plane(e, i, c);
        const auto sums = plane_sums<F>(P, [&](int64_t j, int cnt, auto full, V& u, V& v) {
          if constexpr (decltype(full)::value) {
            const int64_t t = walk.target(e, next, j);
            prefetch(in + t);
            if constexpr (RES) prefetch(fs.res + t);  // read by the second pass, which then finds it cached
          }
          shifted_pair<decltype(full)::value>(in + e + j, cnt, k, u, v);
        });
        s1 += sums.first;
        s2 += sums.second;
      }
      channel_stats(K, s1, s2, n, mean[c], var[c]);
      const double v[4] = {static_cast<double>(mean[c]), static_cast<double>(var[c]), wb[c], wb[C + c]};
      double col[kFwdRows];
      table_column<Table::Forward>(spec, v, col);
      const V mean_hi(static_cast<F>(col[kFwdMeanHi])), mean_lo(static_cast<F>(col[kFwdMeanLo]));
      const V scale(static_cast<F>(col[kFwdScale])), shift(static_cast<F>(col[kFwdShift]));
      for (int64_t i = 0; i < N; ++i) {
        const int64_t e = (i * C + c) * P;
        BitWriter bw(MASK ? mask + e / 32 : nullptr);
        for_vectors<V::size()>(P, [&](int64_t j, int cnt, auto full) {
          fs.template operator()<decltype(full)::value>(e + j, cnt, mean_hi, mean_lo, scale, shift, bw);
        });
        if (MASK) bw.flush();
      }
    }
  });
}

void bn_forward_kernel(const KernelArgs& a) {
  dispatch_relu(a, a.z.defined(), [&](auto s, auto act, auto res, auto relu) {  // ReLU: z into a.z
    bn_forward_planes<decltype(s), decltype(act)::value, decltype(res)::value, decltype(relu)::value>(a);
  });
}

}  // namespace

IABN_REGISTER_CPU_KERNEL(bn_forward_stub, &bn_forward_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
