// batch_stats on the CPU: sums of d = x - K_c and d^2, K_c = the channel's first element (a sample value, so
// |sum d| / n is of the order of the standard deviation and the variance does not cancel); d in the compute type
// (exact when |x - K| <= |K|, the hostile case |mean| >> std), pairs of d and d^2 in the compute type, sums in double.
#include "cpu/kernel_utils.h"

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename S>
void batch_stats_t(const KernelArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  const Walk g = walk_of(a.g, 1);
  const int64_t C = g.C;
  const S* x = a.x.const_data_ptr<S>();
  std::vector<F> K(C);
  for (int64_t c = 0; c < C; ++c) K[c] = static_cast<F>(x[c * g.inner]);
  std::vector<double> s1(C), s2(C);
  reduce2<F>(
      g, K.data(),
      [=](int64_t i, int64_t j, int cnt, auto full, const auto& co, V& u, V& v) {
        constexpr bool FULL = decltype(full)::value;
        if constexpr (FULL) prefetch(x + i + kPrefetch);
        shifted_pair<FULL>(x + i, cnt, co.get(0, j), u, v);
      },
      s1.data(), s2.data());
  const double n = static_cast<double>(g.numel / C);
  F* mean = a.out1.data_ptr<F>();
  F* var = a.out2.data_ptr<F>();
  for (int64_t c = 0; c < C; ++c) channel_stats(K[c], s1[c], s2[c], n, mean[c], var[c]);
}

void batch_stats_kernel(const KernelArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "inplace_abn_batch_stats_cpu",
                                  [&] { batch_stats_t<scalar_t>(a); });
}

}  // namespace

IABN_REGISTER_CPU_KERNEL(batch_stats_stub, &batch_stats_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
