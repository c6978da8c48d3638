// Shared code of the CPU kernels (src/cpu/<op>_kernel.cpp) on at::vec::Vectorized and at::parallel_for. Each kernel
// file is compiled once per ISA with its flags and CPU_CAPABILITY (setup.py): everything here lives in namespace
// inplace_abn::cpu::CPU_CAPABILITY, in an unnamed namespace, so the per-ISA copies never collide at link time.
// The element-wise math is activations.h's, instantiated with the vector policy VecMath below.
//
// Memory is walked in its own order (see Walk) as segments that each keep their channel pattern:
//  - planar (contiguous N, C, S): a segment is (part of) one (n, c) plane; coefficients are broadcast scalars;
//  - rows (channels-last and (N, C); contiguous with small planes): a segment is (part of) a "super-row" of R = k C
//    inner elements (k rows of the channel pattern, R >= 256 unless the tensor is shorter, so that short rows still
//    fill vectors); coefficients are arrays over the super-row, loaded at the segment offset.
// Within a segment: full vectors, then one partial vector (masked load / store). Every element goes through the same
// vector code, so results do not depend on where segment or thread boundaries fall.
//
// Reductions use a partition that depends on the shape only (planes or plane parts; blocks of super-rows), one
// partial result per unit in its own slot, combined in a fixed order: bitwise reproducible for any thread count. Sums
// accumulate in double (groups of four vectors, or of a few super-rows, are first added in the compute type, see
// reduce2).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "activations.h"
#include "cpu/silu_table.h"
#include "ops/kernel.h"

// The partial loads and stores run once per plane or segment: GCC outlined them from the big kernel bodies (a call
// each, 4% of a bfloat16 layer step's samples at 16x512x7x7).
#define IABN_IO_INLINE inline __attribute__((always_inline))

#ifndef CPU_CAPABILITY
#error "compile the CPU kernels with -DCPU_CAPABILITY=<ISA> (setup.py does)"
#endif

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// ---------------------------------------------------------------------------
// Lane-wise helpers on at::vec.

template <typename F>
using IntOf = std::conditional_t<sizeof(F) == 4, int32_t, int64_t>;

inline uint32_t low_bits(int cnt) { return static_cast<uint32_t>((uint64_t(1) << cnt) - 1); }

// Comparisons and selects. AVX512 uses mask registers: at::vec's AVX512 compares return vectors that blendv compares
// again (SiLU backward_reduce 34% slower, 16x64x56x56 float, 1 thread).
enum class Cmp { Lt, Ge, Ne };  // ordered <, ordered >=, unordered !=

template <Cmp P, typename F>
inline Vectorized<F> cmp(const Vectorized<F>& v, const Vectorized<F>& w) {
  return P == Cmp::Lt ? v < w : P == Cmp::Ge ? v >= w : v != w;
}

// cmp(v, w) ? a : b
template <Cmp P, typename F>
inline Vectorized<F> sel(const Vectorized<F>& v, const Vectorized<F>& w, const Vectorized<F>& a,
                         const Vectorized<F>& b) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int k = P == Cmp::Lt ? _CMP_LT_OQ : P == Cmp::Ge ? _CMP_GE_OQ : _CMP_NEQ_UQ;
  if constexpr (std::is_same_v<F, float>)
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, w, k), b, a);
  else
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, w, k), b, a);
#else
  return Vectorized<F>::blendv(b, a, cmp<P>(v, w));
#endif
}

// Bit i set where lane i of v is < w; AVX512 float takes the compare's mask register as it is (see Cmp: 34%).
template <typename F>
inline uint32_t lt_bits(const Vectorized<F>& v, const Vectorized<F>& w) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<F, float>) return _mm512_cmp_ps_mask(v, w, _CMP_LT_OQ);
#endif
  return ~static_cast<uint32_t>((v < w).zero_mask()) & low_bits(Vectorized<F>::size());
}

// A branch flag per lane from bit i (activations.h): 0 where clear; set lanes are 1 on AVX512 and all bits set
// elsewhere, as selects and silu_table take them (rather than 0/1 lanes: SiLU backward_reduce 4.13 -> 3.87 ms).
template <typename F>
inline Vectorized<F> from_bits(uint32_t bits) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<F, float>) return _mm512_maskz_mov_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(1.f));
#endif
  using VI = Vectorized<IntOf<F>>;
  alignas(64) static constexpr IntOf<F> kLane[16] = {1,     2,     4,     8,     16,    32,     64,     128,
                                                    1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15};
  const VI lane = VI::loadu(kLane);
  return at::vec::cast<F>((VI(static_cast<IntOf<F>>(bits)) & lane) == lane);
}

// sign bit of v set ? a : b (-0 and negative NaNs give a); AVX512 float: the sign bits as a mask (see Cmp: 34%)
template <typename F>
inline Vectorized<F> select_signbit(const Vectorized<F>& v, const Vectorized<F>& a, const Vectorized<F>& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<F, float>)
    return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(v)), b, a);
#endif
  using I = IntOf<F>;
  const auto sign = at::vec::cast<I>(v) >> Vectorized<I>(I(sizeof(F) * 8 - 1));  // all-ones where set
  return Vectorized<F>::blendv(b, a, at::vec::cast<F>(sign));
}

// max / min without NaN handling beyond the hardware's (x86 max / min return
// their second operand when either is NaN: vmax(a, b) = max(b, a) keeps a NaN a)
template <typename F>
inline Vectorized<F> vmax(const Vectorized<F>& a, const Vectorized<F>& b) {
  return at::vec::clamp_min(a, b);
}
template <typename F>
inline Vectorized<F> vmin(const Vectorized<F>& a, const Vectorized<F>& b) {
  return at::vec::clamp_max(a, b);
}

// x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite), e^r = 1 + r + r^2 P(r) with Cephes' expf polynomial P by Estrin's
// scheme (the SiLU inverse is one dependency chain per vector): e^x = 2^n fma(P, r^2, r + 1).
struct ExpParts {
  Vectorized<float> n, r, r2, P;
  explicit ExpParts(const Vectorized<float>& x) {
    using V = Vectorized<float>;
    n = (x * V(1.44269504088896341f)).round();
    r = at::vec::fnmadd(n, V(0.693359375f), x);
    r = at::vec::fnmadd(n, V(-2.12194440e-4f), r);
    r2 = r * r;
    const V p5 = at::vec::fmadd(V(1.9875691500e-4f), r, V(1.3981999507e-3f));
    const V p3 = at::vec::fmadd(V(8.3334519073e-3f), r, V(4.1665795894e-2f));
    const V p1 = at::vec::fmadd(V(1.6666665459e-1f), r, V(5.0000001201e-1f));
    P = at::vec::fmadd(r2 * r2, p5, at::vec::fmadd(r2, p3, p1));
  }
};

// 2^n for integral n in [-126, 127], from its exponent bits.
inline Vectorized<float> pow2(const Vectorized<float>& n) {
  using VI = Vectorized<int32_t>;
  return at::vec::cast<float>((at::vec::convert_to_int_of_same_size(n) + VI(127)) << VI(23));
}

// e^x, float, from ExpParts (about 1 ulp; at::vec's exp calls Sleef, which costs more than all of this). n stays in
// [-126, 127]: e^x capped at e^88.03 below the overflow threshold 88.72, inf above it; 0 below -87.34. kSat = false
// (exp_capped): x <= 87 only, 2^-126 e^r instead of 0 below -87.34, for the SiLU inverse's e^-z, z >= zmin, where
// the two saturating selects cost 5% of the AVX2 inverse.
template <bool kSat = true>
inline Vectorized<float> vexp(const Vectorized<float>& x) {
  using V = Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  // AVX512: p 2^n by vscalefps, which saturates to 0 / inf itself; the clamp keeps r accurate (beyond |x| ~ 1e4,
  // n ln2 is no longer exact: e^-1e30 gave inf, then NaN through scalef).
  const V lo = vmax(x, V(-110.f));  // keeps NaN
  const V xv = kSat ? vmin(lo, V(89.f)) : lo;
#else
  const V lo = vmax(x, V(-87.3365447504f));
  const V xv = kSat ? vmin(lo, V(88.02969193f)) : lo;
#endif
  const ExpParts e(xv);
  const V p = at::vec::fmadd(e.P, e.r2, e.r + V(1.f));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(p, e.n);
#else
  const V res = p * pow2(e.n);
  if constexpr (!kSat) return res;
  return sel<Cmp::Lt>(V(88.7228391f), x, V(INFINITY), sel<Cmp::Lt>(x, V(-87.3365447504f), V(0.f), res));
#endif
}
template <bool kSat = true>
inline Vectorized<double> vexp(const Vectorized<double>& x) { return x.exp(); }

// e^x - 1, float: 2^n (e^r - 1) + (2^n - 1) in one fma (2^n - 1 exact): 1.6 ulp at most over [-30, 88] (the Kahan
// form: 2.8). x is clamped to [-20, 88.03] (e^x - 1 is -1 in float below -17.4; n <= 127 above, capped as in vexp),
// inf beyond the overflow threshold. ELU forward_ 1.05 ms against 3.51 with the Kahan form (an exp, a log, a division).
inline Vectorized<float> vexpm1(const Vectorized<float>& x) {
  using V = Vectorized<float>;
  const V xv = vmin(vmax(x, V(-20.f)), V(88.02969193f));  // keeps NaN
  const ExpParts e(xv);
  const V t = pow2(e.n);
  const V em1 = at::vec::fmadd(e.P, e.r2, e.r);
  return sel<Cmp::Lt>(V(88.7228391f), x, V(INFINITY), at::vec::fmadd(t, em1, t - V(1.f)));
}

// log(x), x > 0 normal, float: x = m 2^e, m in [sqrt(1/2), sqrt(2)), Cephes' logf polynomial for log1p(m - 1) (about
// 1 ulp). kP1: log1p(t) for x = 1 + t (rounded): where e = 0 the polynomial takes t itself (no bits of a small t lost),
// elsewhere rounding 1 + t costs <= ~1.5 ulp. ELU backward_reduce 1.72 ms against 2.01 with log(u) t / (u - 1).
template <bool kP1 = false>
inline Vectorized<float> vlog(const Vectorized<float>& x, const Vectorized<float>& t = {}) {
  using V = Vectorized<float>;
  using VI = Vectorized<int32_t>;
  const VI bits = at::vec::cast<int32_t>(x);
  V e = at::vec::convert_to_fp_of_same_size<float>((bits >> VI(23)) - VI(126));
  const V m = at::vec::cast<float>((bits & VI(0x007fffff)) | VI(0x3f000000));  // [0.5, 1)
  const V small = m < V(0.707106781186547524f);
  e = e - (small & V(1.f));
  V f = (m - V(1.f)) + (small & m);  // 2m - 1 or m - 1
  if constexpr (kP1) f = sel<Cmp::Ne>(e, V(0.f), f, t);
  const V z = f * f;
  V p = V(7.0376836292e-2f);
  p = at::vec::fmadd(p, f, V(-1.1514610310e-1f));
  p = at::vec::fmadd(p, f, V(1.1676998740e-1f));
  p = at::vec::fmadd(p, f, V(-1.2420140846e-1f));
  p = at::vec::fmadd(p, f, V(1.4249322787e-1f));
  p = at::vec::fmadd(p, f, V(-1.6668057665e-1f));
  p = at::vec::fmadd(p, f, V(2.0000714765e-1f));
  p = at::vec::fmadd(p, f, V(-2.4999993993e-1f));
  p = at::vec::fmadd(p, f, V(3.3333331174e-1f));
  p = p * f * z;
  p = at::vec::fmadd(e, V(-2.12194440e-4f), p);
  p = at::vec::fmadd(z, V(-0.5f), p);
  return at::vec::fmadd(e, V(0.693359375f), f + p);
}
inline Vectorized<double> vlog(const Vectorized<double>& x) { return x.log(); }

// ---------------------------------------------------------------------------
// The vector math policy of activations.h.
template <typename F>
struct VecMath {
  using Scalar = F;
  using T = Vectorized<F>;
  static T c(double v) { return T(static_cast<F>(v)); }
  static T fma(const T& a, const T& b, const T& c) { return at::vec::fmadd(a, b, c); }
  static T exp(const T& x) { return vexp(x); }
  static T exp_capped(const T& x) { return vexp<false>(x); }
  static T log(const T& x) { return vlog(x); }
  static T sqrt(const T& x) { return x.sqrt(); }
  // AVX512 float: 14-bit estimate + one Newton step (error ~2^-28) instead of vdivps (AVX2 rcp_ps + two steps: SiLU
  // kernels 25% slower than vdivps). At x = inf the step gives inf * 0 = NaN: the estimate (0) is kept there.
  static T rcp(const T& x) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<F, float>) {
      const __m512 r = _mm512_rcp14_ps(x);
      const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
      return _mm512_mask_mul_ps(r, finite, r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f)));
    }
#endif
    return T(F(1)) / x;
  }
  // at::vec's expm1 / log1p call Sleef versions that are very slow in libtorch builds. float: vexpm1 and vlog<true>
  // above; double: Kahan's compensated forms, accurate to a few ulp:
  //   expm1(x) = (u - 1) x / log(u), u = e^x;  log1p(x) = log(u) x / (u - 1), u = 1 + x
  static T expm1(const T& x) {
    if constexpr (std::is_same_v<F, float>) return vexpm1(x);
    const T one(F(1)), zero(F(0));
    T u = exp(x);
    T um1 = u - one;
    T r = sel<Cmp::Ne>(u, one, um1 * x / log(u), x);  // u == 1: x
    r = sel<Cmp::Ne>(u, zero, r, T(F(-1)));           // u == 0: -1
    return sel<Cmp::Lt>(u, T(F(2)), r, um1);          // u >= 2: u - 1 is exact enough
  }
  static T log1p(const T& x) {
    if constexpr (std::is_same_v<F, float>) return vlog<true>(x + T(1.f), x);
    const T one(F(1));
    T u = x + one;
    return sel<Cmp::Ne>(u, one, log(u) * x / (u - one), x);  // u == 1: x
  }
  static T max(const T& a, const T& b) { return vmax(a, b); }
  static T min(const T& a, const T& b) { return vmin(a, b); }
  static T if_nonneg(const T& v, const T& a, const T& b) { return sel<Cmp::Ge>(v, T(F(0)), a, b); }
  static T if_signbit(const T& v, const T& a, const T& b) { return select_signbit(v, a, b); }
  static T if_less(const T& v, const T& w, const T& a, const T& b) { return sel<Cmp::Lt>(v, w, a, b); }
  static T if_set(const T& flag, const T& a, const T& b) { return sel<Cmp::Ne>(flag, T(F(0)), a, b); }
  static bool any(const T& flag) { return flag.zero_mask() != static_cast<int>(low_bits(T::size())); }

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  static constexpr bool kSiluTable = std::is_same_v<F, float>;
  // h = z / y from the fit of src/cpu/silu_table.h, for y >= y* on the branch `left` (a flag, see from_bits); returns
  // a flag set where y is outside the fitted range (AVX2: the compare's all-ones lanes). Coefficients come from one
  // register permute (vpermps) of a table sized for it: at::vec::gather made the inverse 4.5x slower than Halley's.
  static T silu_table(const T& y, const T& left, T& h) {
#if defined(CPU_CAPABILITY_AVX512)
    using Tab = silu_table::Avx512;
#else
    using Tab = silu_table::Avx2;
#endif
    static_assert(2 * Tab::kSegments == T::size(), "one permute holds the segments of both branches");
    namespace st = silu_table;
    const T d = vmax((y - T(st::kYStarHi)) - T(st::kYStarLo), T(0.f)).sqrt();
    // segment k of the right branch, kSegments + k of the left; one compare of
    // `left` serves every per-branch choice (unordered: an all-ones flag is a NaN)
#if defined(CPU_CAPABILITY_AVX512)
    const __mmask16 lm = _mm512_cmp_ps_mask(left, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    auto branch = [&](float r, float l) { return T(_mm512_mask_blend_ps(lm, _mm512_set1_ps(r), _mm512_set1_ps(l))); };
    const T s = d * branch(Tab::kScaleRight, Tab::kScaleLeft);
    __m512i k = _mm512_min_epi32(_mm512_cvttps_epi32(s), _mm512_set1_epi32(Tab::kSegments - 1));
    const T u = s - T(_mm512_cvtepi32_ps(k)) - T(0.5f);
    k = _mm512_mask_add_epi32(k, lm, k, _mm512_set1_epi32(Tab::kSegments));
    auto coef = [&](int j) { return T(_mm512_permutexvar_ps(k, _mm512_load_ps(Tab::kH[j]))); };
#else
    const __m256 lm = _mm256_cmp_ps(left, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    auto branch = [&](float r, float l) { return T(_mm256_blendv_ps(_mm256_set1_ps(r), _mm256_set1_ps(l), lm)); };
    const T s = d * branch(Tab::kScaleRight, Tab::kScaleLeft);
    __m256i k = _mm256_min_epi32(_mm256_cvttps_epi32(s), _mm256_set1_epi32(Tab::kSegments - 1));
    const T u = s - T(_mm256_cvtepi32_ps(k)) - T(0.5f);
    k = _mm256_add_epi32(k, _mm256_and_si256(_mm256_castps_si256(lm), _mm256_set1_epi32(Tab::kSegments)));
    auto coef = [&](int j) { return T(_mm256_permutevar8x32_ps(_mm256_load_ps(Tab::kH[j]), k)); };
#endif
    constexpr int kCoefs = sizeof(Tab::kH) / sizeof(Tab::kH[0]);
    // Estrin's scheme (the inverse is one dependency chain per vector)
    T c[kCoefs];
    for (int j = 0; j < kCoefs; ++j) c[j] = coef(j);
    T x = u;
    for (int n = kCoefs; n > 1; n = (n + 1) / 2, x = x * x) {
      for (int i = 0; i < n / 2; ++i) c[i] = at::vec::fmadd(c[2 * i + 1], x, c[2 * i]);
      if (n % 2) c[n / 2] = c[n - 1];
    }
    h = c[0];
    const T lim = branch(st::kYRightMax, st::kYLeftMax);
#if defined(CPU_CAPABILITY_AVX512)
    return sel<Cmp::Lt>(lim, y, T(1.f), T(0.f));
#else
    return T(_mm256_cmp_ps(lim, y, _CMP_LT_OQ));
#endif
  }
#else
  // at::vec has no register permute; its gather was 4.5x slower than the Halley step where measured (AVX2, AVX512)
  static constexpr bool kSiluTable = false;
#endif
};

// The traversal of the kernels: numel elements in memory order, C channels,
// the channel of e is (e / inner) % C; rows: see the top of the file.
struct Walk {
  int64_t numel, C, inner;
  bool rows;
};

// ---------------------------------------------------------------------------
// Loads and stores of W = Vectorized<F>::size() elements of the storage type, converted to / from the compute type F.
// Partial variants touch n < W elements only; the other lanes load as zero. ld / st: full when FULL.
template <typename S, class Base>
struct IOFull : Base {
  using V = typename Base::V;
  template <bool FULL>
  static V ld(const S* p, int64_t n) {
    return FULL ? Base::load(p) : Base::load(p, n);
  }
  template <bool FULL>
  static void st(S* p, const V& v, int64_t n) {
    FULL ? Base::store(p, v) : Base::store(p, v, n);
  }
};
#if defined(CPU_CAPABILITY_AVX2)
// AVX2 partial loads by the masked moves: at::vec's fill a stack buffer piece by piece (a memcpy call) and then load
// it whole, a failed store forward (bfloat16 bn_forward_ at 16x512x7x7, planes of 49: 28% of its samples on the
// two loads after them; layers 0.70-0.90x as long without). Lanes [0, n) of a window of the table are set;
// masked-off lanes never fault.
alignas(32) constexpr int32_t kMask32[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i mask32(int64_t n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMask32 + 8 - n)); }
inline __m256i mask64(int64_t n) {
  return _mm256_cvtepi32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMask32 + 8 - n)));
}
IABN_IO_INLINE Vectorized<float> load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, mask32(n)); }
IABN_IO_INLINE Vectorized<double> load_first(const double* p, int64_t n) { return _mm256_maskload_pd(p, mask64(n)); }
// n < 8 16-bit values: the whole 32-bit pairs masked, an odd last one broadcast and blended into its lane
IABN_IO_INLINE __m128i load_first16(const void* p, int64_t n) {
  alignas(16) static constexpr int16_t kLast[15] = {0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0};
  const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMask32 + 8 - (n >> 1)));
  __m128i h = _mm_maskload_epi32(static_cast<const int*>(p), m);
  if (n & 1) {
    int16_t last;
    std::memcpy(&last, static_cast<const int16_t*>(p) + n - 1, sizeof(last));
    h = _mm_blendv_epi8(h, _mm_set1_epi16(last), _mm_loadu_si128(reinterpret_cast<const __m128i*>(kLast + 8 - n)));
  }
  return h;
}
#endif

// Lanes [0, n) of b, the others of a: at::vec's set, which AVX2 builds call out of line (a switch over n).
template <typename F>
IABN_IO_INLINE Vectorized<F> set_first(const Vectorized<F>& a, const Vectorized<F>& b, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<F, float>) return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(mask32(n)));
  if constexpr (std::is_same_v<F, double>) return _mm256_blendv_pd(a, b, _mm256_castsi256_pd(mask64(n)));
#endif
  return Vectorized<F>::set(a, b, n);
}

// The first n bytes of a stored vector, in fixed-size pieces (moves, where at::vec calls memcpy).
template <int BYTES>
IABN_IO_INLINE void copy_first(void* dst, const void* src, int64_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  int64_t o = 0;
  auto piece = [&](auto size) {
    if (bytes & size) {
      std::memcpy(d + o, s + o, size);
      o += size;
    }
  };
  if constexpr (BYTES > 32) piece(std::integral_constant<int64_t, 32>{});
  if constexpr (BYTES > 16) piece(std::integral_constant<int64_t, 16>{});
  piece(std::integral_constant<int64_t, 8>{});
  piece(std::integral_constant<int64_t, 4>{});
  piece(std::integral_constant<int64_t, 2>{});
  piece(std::integral_constant<int64_t, 1>{});
}

template <typename S>
struct IOPlain {
  using F = S;
  using V = Vectorized<F>;
  static constexpr int W = V::size();
  static V load(const S* p) { return V::loadu(p); }
  IABN_IO_INLINE static V load(const S* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
    return load_first(p, n);
#else
    return V::loadu(p, n);
#endif
  }
  static void store(S* p, const V& v) { v.store(p); }
  IABN_IO_INLINE static void store(S* p, const V& v, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
    alignas(32) S buf[W];
    v.store(buf);
    copy_first<sizeof(buf)>(p, buf, n * sizeof(S));
#else
    v.store(p, n);
#endif
  }
};
template <typename H>
struct IOReduced {
  using F = float;
  using V = Vectorized<float>;
  static constexpr int W = V::size();
  static V load(const H* p) {
    V out;
    at::vec::load_to_float<H>(p, out);
    return out;
  }
  IABN_IO_INLINE static V load(const H* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
    // at::vec's masked load: with the buffer below, the bfloat16 one-pass kernels at 16x512x7x7 (planes of 49) took
    // twice float32's time
    return std::get<0>(at::vec::convert_to_float<H>(Vectorized<H>::loadu(p, n)));
#elif defined(CPU_CAPABILITY_AVX2)
    __m256 out;
    if constexpr (std::is_same_v<H, at::BFloat16>)
      at::vec::cvtbf16_fp32(load_first16(p, n), out);
    else
      at::vec::cvtfp16_fp32(load_first16(p, n), out);
    return out;
#else
    H buf[W];
    for (int i = 0; i < W; ++i) buf[i] = H(0.f);
    std::memcpy(buf, p, n * sizeof(H));
    return load(buf);
#endif
  }
  // A full vector: converted to W halves and stored whole, with at::vec's rounding (bitwise as convert_from_float);
  // the generic path (two vectors, a stack buffer) made bfloat16 forward_ SiLU take 5x float32's time.
  static void store(H* p, const V& v) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    // W halves in one __m128i (AVX2) or __m256i (AVX512); the memcpy is one unaligned store
    const auto h = std::is_same_v<H, at::BFloat16> ? at::vec::cvtfp32_bf16(v) : at::vec::cvtfp32_fp16(v);
    static_assert(sizeof(h) == W * sizeof(H));
    std::memcpy(p, &h, sizeof(h));
#else
    at::vec::convert_from_float<H>(v, v).store(p, W);
#endif
  }
  IABN_IO_INLINE static void store(H* p, const V& v, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
    const auto h = std::is_same_v<H, at::BFloat16> ? at::vec::cvtfp32_bf16(v) : at::vec::cvtfp32_fp16(v);
    copy_first<sizeof(h)>(p, &h, n * sizeof(H));
#else
    at::vec::convert_from_float<H>(v, v).store(p, n);
#endif
  }
};
template <typename S>
using IO = IOFull<S, std::conditional_t<sizeof(S) == 2, IOReduced<S>, IOPlain<S>>>;

// ---------------------------------------------------------------------------
// Walking memory by segments (see the top of the file).

// Length of the super-row: k whole rows of P = C S, at least kMinRow elements, but no more rows than the tensor has:
// expansions, accumulators and folds cost R per call whatever the size (2x64: 256k -> 204k instructions, AVX2).
constexpr int64_t kMinRow = 256;
inline int64_t super_row(const Walk& g) {
  const int64_t P = g.C * g.inner;
  const int64_t rows = std::max<int64_t>(1, (g.numel + P - 1) / P);
  return P * std::min(rows, std::max<int64_t>(1, (kMinRow + P - 1) / P));
}

// Calls fn(e, n, key) for consecutive segments covering [e0, e1); key: the channel (planar) or super-row offset (rows).
template <class Fn>
inline void walk(const Walk& g, int64_t R, int64_t e0, int64_t e1, const Fn& fn) {
  if (!g.rows) {
    const int64_t p = e0 / g.inner;
    int64_t o = e0 - p * g.inner;
    int64_t c = p % g.C;  // counted on, not divided per plane: small planes (GroupNorm mode)
    while (e0 < e1) {
      int64_t n = std::min(e1 - e0, g.inner - o);
      fn(e0, n, c);
      e0 += n;
      c = c + 1 == g.C ? 0 : c + 1;
      o = 0;
    }
  } else {
    int64_t o = e0 % R;
    while (e0 < e1) {
      int64_t n = std::min(e1 - e0, R - o);
      fn(e0, n, o);
      e0 += n;
      o = 0;
    }
  }
}

// A per-channel vector spread over the super-row into out[0, R) (position r holds channel (r / S) % C), followed
// by one vector of zeros so that a partial vector at the end of a segment can be loaded whole.
template <typename F>
void expand(const F* src, const Walk& g, int64_t R, F* out) {
  F* o = out;
  for (int64_t k = 0; k < R / (g.C * g.inner); ++k)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t s = 0; s < g.inner; ++s) *o++ = src[c];
  std::fill(o, o + Vectorized<F>::size(), F(0));
}

// Per-channel coefficient source of one segment: broadcast scalars (planar) or arrays at the segment offset (rows).
template <typename F, int K, bool ROWS>
struct Coef {
  using V = Vectorized<F>;
  static constexpr bool kRows = ROWS;
  V bc[K];
  const F* arr[K];
  V get(int k, int64_t j) const {
    if constexpr (ROWS)
      return V::loadu(arr[k] + j);
    else
      return bc[k];
  }
  // key: the channel (planar) or the offset in the super-row (rows)
  void set(int k, const F* per_channel, const F* expanded, int64_t key) {
    if constexpr (ROWS)
      arr[k] = expanded + key;
    else
      bc[k] = V(per_channel[key]);
  }
};

// Runs body(co) with the coefficients of the segment at `key`, from src[k] (planar) or their expansions exp[k] (rows).
template <typename F, int K, class Body>
inline void with_coef(bool rows, int64_t key, const F* const* src, const F* const* exp, const Body& body) {
  if (rows) {
    Coef<F, K, true> co;
    for (int k = 0; k < K; ++k) co.set(k, src[k], exp[k], key);
    body(co);
  } else {
    Coef<F, K, false> co;
    for (int k = 0; k < K; ++k) co.set(k, src[k], exp[k], key);
    body(co);
  }
}

// Runs step(j, cnt, full) over a segment of n elements: full vectors, then one partial vector.
template <int W, class Step>
inline void for_vectors(int64_t n, const Step& step) {
  int64_t j = 0;
  for (; j + W <= n; j += W) step(j, W, std::true_type{});
  if (j < n) step(j, static_cast<int>(n - j), std::false_type{});
}

// Row k of the coefficient table (compute type F).
template <typename F>
inline const F* coef_row(const KernelArgs& a, int k) {
  return a.coef.const_data_ptr<F>() + k * a.g.C;
}

// K per-channel arrays (src) and, for rows, their expansions over the super-row of length R (exp), in one allocation
// without a zero pass (malloc and a zeroed vector each took twice stock's share of a 2x32x7x7 step).
template <typename F, int K>
struct CoefRows {
  const F* src[K];
  const F* exp[K] = {};
  std::unique_ptr<F[]> mem;
  int64_t R;
  // rows k = 0..K-1 of a table at first + k * stride
  CoefRows(const F* first, int64_t stride, const Walk& g) : R(g.rows ? super_row(g) : 0) {
    for (int k = 0; k < K; ++k) src[k] = first + k * stride;
    if (!g.rows) return;
    const int64_t len = R + Vectorized<F>::size();
    mem.reset(new F[K * len]);
    for (int k = 0; k < K; ++k) {
      F* e = mem.get() + k * len;
      expand(src[k], g, R, e);
      exp[k] = e;
    }
  }
  // the K rows of the kernel's coefficient table
  CoefRows(const KernelArgs& a, const Walk& g) : CoefRows(coef_row<F>(a, 0), a.g.C, g) {}
};

// How far on the second super-row of a pair starts (reduce2, for_each_pair): h rows, or up to three fewer, whichever
// puts the two streams furthest from the same offset modulo 4 KiB (the same L1 sets, for them and their prefetches): at
// 16x512x7x7 channels-last (halves 48 KiB apart; 1 thread, AVX2, in cache) backward_reduce took 0.100 ms, 0.093 with
// this, 0.083-0.091 with adjacent rows. Half inputs are half as far apart, which keeps them off the same offset too.
inline int64_t pair_distance(int64_t h, int64_t R, int64_t elem_bytes) {
  int64_t best = h, far = -1;
  for (int64_t k = h; k >= std::max<int64_t>(1, h - 3); --k) {
    const int64_t m = (k * R * elem_bytes) % 4096;
    if (std::min(m, 4096 - m) > far) {
      far = std::min(m, 4096 - m);
      best = k;
    }
  }
  return best;
}

template <typename F, int K, class Step>
bool for_each_pair(const Walk& g, const CoefRows<F, K>& cr, int64_t e0, int64_t e1, const Step& step);

// Runs step(i, j, cnt, full, co) for the vectors of [e0, e1): i the flat
// index, j the offset in the segment, co its coefficients (element-wise kernels).
// PAIRED (rows): the whole super-rows in pairs, see for_each_pair; only the order of the vectors changes.
template <bool PAIRED = false, typename F, int K, class Step>
inline void for_each_vector(const Walk& g, const CoefRows<F, K>& cr, int64_t e0, int64_t e1, const Step& step) {
  if constexpr (PAIRED)
    if (g.rows && for_each_pair(g, cr, e0, e1, step)) return;
  constexpr int W = Vectorized<F>::size();
  walk(g, cr.R, e0, e1, [&](int64_t e, int64_t n, int64_t key) {
    with_coef<F, K>(g.rows, key, cr.src, cr.exp, [&](const auto& co) {
      // a local copy of step (which captures by value): through a reference, GCC reloaded every captured pointer
      // per vector, as a vector store may alias any memory (two loads each; 16x512x7x7 channels-last forward_)
      const Step st = step;
      int64_t j = 0;  // (no lambda level more than needed: GCC stops inlining the SiLU body)
      for (; j + W <= n; j += W) st(e + j, j, W, std::true_type{}, co);
      if (j < n) st(e + j, j, static_cast<int>(n - j), std::false_type{}, co);
    });
  });
}

// for_each_vector's PAIRED walk of [e0, e1) (rows): its whole super-rows two at a time, r and r + h (about half of
// them on, two sequential streams, see pair_distance), the coefficient vectors loaded once for both; the partial rows
// at either end, and the up to seven whole rows that h leaves over, one at a time; false, doing nothing, where
// [e0, e1) holds fewer than two whole super-rows. Four coefficient loads per vector kept the load ports
// busy: forward_ identity at 16x64x56x56 channels-last took twice the contiguous layout's time (0.26 against 0.13 ms,
// AVX2, 2 threads). Paired instantiations live in paired_rows_kernel.cpp, apart from the kernels' other ones: in
// the same file, GCC inlined less elsewhere (ELU backward_input 4096x512, AVX2: 1.52-1.83 against 1.03 ms).
template <typename F, int K, class Step>
bool for_each_pair(const Walk& g, const CoefRows<F, K>& cr, int64_t e0, int64_t e1, const Step& step) {
  constexpr int W = Vectorized<F>::size();
  const int64_t R = cr.R;
  const int64_t ra = (e0 + R - 1) / R, rb = e1 / R;  // the whole super-rows [ra, rb)
  if (rb - ra < 2) return false;
  const int64_t h = pair_distance((rb - ra) / 2, R, sizeof(F));
  for_each_vector(g, cr, e0, ra * R, step);
  const Step st = step;  // (a local copy, see for_each_vector)
  for (int64_t r = ra; r < ra + h; ++r) {
    const int64_t ea = r * R, eb = ea + h * R;
    Coef<F, K, false> co;
    int64_t j = 0;
    for (; j + W <= R; j += W) {
      for (int k = 0; k < K; ++k) co.bc[k] = Vectorized<F>::loadu(cr.exp[k] + j);
      st(ea + j, j, W, std::true_type{}, co);
      st(eb + j, j, W, std::true_type{}, co);
    }
    if (j < R) {  // (the expansions end in a vector of zeros: whole loads)
      for (int k = 0; k < K; ++k) co.bc[k] = Vectorized<F>::loadu(cr.exp[k] + j);
      st(ea + j, j, static_cast<int>(R - j), std::false_type{}, co);
      st(eb + j, j, static_cast<int>(R - j), std::false_type{}, co);
    }
  }
  for_each_vector(g, cr, (ra + 2 * h) * R, e1, step);
  return true;
}

// Packed mask bits, written 32 at a time from a word-aligned start.
struct BitWriter {
  int32_t* w;
  uint64_t acc = 0;
  int nb = 0;
  explicit BitWriter(int32_t* p) : w(p) {}
  void put(uint32_t bits, int cnt) {
    acc |= static_cast<uint64_t>(bits) << nb;
    nb += cnt;
    if (nb >= 32) {
      *w++ = static_cast<int32_t>(static_cast<uint32_t>(acc));
      acc >>= 32;
      nb -= 32;
    }
  }
  void flush() {
    if (nb > 0) *w = static_cast<int32_t>(static_cast<uint32_t>(acc));
  }
};

// Reads cnt (<= 25) bits from element e of a packed mask of `words` words, by one unaligned 32-bit load at e's byte b
// (bits 8b.., little-endian), moved back near the end to stay inside the words (as e + cnt <= 32 words, the bits still
// lie in the loaded 32). Two aligned words and a 64-bit shift: 42.3M against 41.4M instructions (SiLU backward_reduce).
struct MaskBits {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the mask is read as little-endian bytes");
  const unsigned char* p = nullptr;
  int64_t last = 0;  // the last byte a load may start at
  MaskBits() = default;
  MaskBits(const int32_t* w, int64_t words) : p(reinterpret_cast<const unsigned char*>(w)), last(4 * words - 4) {}
  uint32_t operator()(int64_t e, int cnt) const {
    const int64_t b = std::min(e >> 3, last);
    uint32_t v;
    std::memcpy(&v, p + b, sizeof v);
    return (v >> (e - 8 * b)) & low_bits(cnt);
  }
};
// The mask of a SiLU kernel (KernelArgs::mask), else none.
inline MaskBits mask_bits(const at::Tensor& m, bool silu) {
  return silu ? MaskBits(m.const_data_ptr<int32_t>(), m.numel()) : MaskBits();
}


// Software prefetch kPrefetch elements ahead in the reductions: with their work per vector (double accumulators) the
// hardware prefetchers alone leave DRAM bandwidth unused beyond the cache. prefetcht0: prefetchnta bypassed the caches,
// refetching from DRAM what the previous operator left in L2/L3 (backward_reduce: 3.0-3.6 against 0.71-0.99 ms).
constexpr int64_t kPrefetch = 2048;
template <typename S>
inline void prefetch(const S* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#endif
}

// Software prefetch on the one-pass kernels' channel-by-channel walk of a contiguous (N, C, P) tensor: a channel's N
// planes, then the next channel's. Its planes are short streams C P elements apart, on each of which the hardware
// prefetchers ramp up anew. The target kPrefetch (at most P) elements past offset j of plane (n, c) at e: within the
// plane, else in the walk's next plane.
struct ChannelWalk {
  int64_t N, C, P, ahead;
  ChannelWalk(int64_t n, int64_t c, int64_t p) : N(n), C(c), P(p), ahead(std::min(kPrefetch, p)) {}
  int64_t next_plane(int64_t e, int64_t n, int64_t c) const {
    return n + 1 < N ? e + C * P : c + 1 < C ? (c + 1) * P : e;
  }
  int64_t target(int64_t e, int64_t next, int64_t j) const {
    return j + ahead < P ? e + j + ahead : next + (j + ahead - P);
  }
};

// Grain of the element-wise kernels, in elements.
constexpr int64_t kGrain = 16384;

// Work per element relative to a memory-bound kernel: an exp, log or the SiLU inverse per element makes a layer of
// 10k elements worth two threads. forward_ and the reductions divide their grain and unit sizes by it;
// backward_input does not: GCC then compiled its from-z SiLU loop 20% slower.
template <Act A>
constexpr int64_t kCost = A == Act::Silu ? 4 : A == Act::Elu ? 2 : 1;

// ---------------------------------------------------------------------------
// Reductions: per channel, sum u and sum u v for per-element (u, v) in double. A unit of work is
//  planar: a part of a plane (at most kPart elements), sums in registers;
//  rows: a block of about kBlock elements (whole super-rows), sums in arrays of length R, folded to C at its end;
// each unit writes its own partial sums, combined afterwards in unit order: independent of the thread count.

constexpr int64_t kPart = 1 << 16;
constexpr int64_t kBlock = 1 << 15;

// A compute-type vector in double: two double vectors for float, one for double.
template <typename F>
struct DPair {
  static constexpr int N = sizeof(F) == sizeof(float) ? 2 : 1;
  Vectorized<double> v[N];
};
// (at::vec::convert<double> goes through partial loads here; this loop compiles to vcvtps2pd)
inline DPair<float> todp(const Vectorized<float>& x) {
  constexpr int W = Vectorized<float>::size();
  alignas(64) float f[W];
  alignas(64) double d[W];
  x.store(f);
  for (int i = 0; i < W; ++i) d[i] = f[i];
  return DPair<float>{{Vectorized<double>::loadu(d), Vectorized<double>::loadu(d + W / 2)}};
}
inline DPair<double> todp(const Vectorized<double>& x) { return DPair<double>{{x}}; }

// The lanes' sum as a fixed tree (the vectors, then halves of the lanes): three (AVX2) or four (AVX512) dependent
// additions instead of seven or fifteen, which weighed on units of a few vectors (8x8 px planes, GroupNorm mode).
template <typename F>
inline double lane_sum(const DPair<F>& a) {
  constexpr int H = Vectorized<double>::size();
  Vectorized<double> v = a.v[0];
  for (int k = 1; k < DPair<F>::N; ++k) v = v + a.v[k];
  double t[H];
  v.store(t);
  for (int w = H / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// reduce2's sums of one plane part of n elements (sum u, sum u v, in double): four vectors combined pairwise in F,
// then added in double; the last vectors one by one, their products taken in double. uv(j, cnt, full, u, v): the
// pair at offset j (invalid lanes: u = 0, v finite). bn_forward's kernel sums a channel's planes with it, so that its
// statistics are batch_stats' to the bit.
template <typename F, class UV>
inline std::pair<double, double> plane_sums(int64_t n, const UV& uv) {
  using V = Vectorized<F>;
  using D = Vectorized<double>;
  constexpr int W = V::size();
  constexpr int NP = DPair<F>::N;
  DPair<F> s1, s2;
  for (int k = 0; k < NP; ++k) s1.v[k] = s2.v[k] = D(0.0);
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    V u0, v0, u1, v1, u2, v2, u3, v3;
    uv(j, W, std::true_type{}, u0, v0);
    uv(j + W, W, std::true_type{}, u1, v1);
    uv(j + 2 * W, W, std::true_type{}, u2, v2);
    uv(j + 3 * W, W, std::true_type{}, u3, v3);
    const DPair<F> du = todp((u0 + u1) + (u2 + u3));
    const DPair<F> dw = todp(at::vec::fmadd(u1, v1, u0 * v0) + at::vec::fmadd(u3, v3, u2 * v2));
    for (int k = 0; k < NP; ++k) {
      s1.v[k] = s1.v[k] + du.v[k];
      s2.v[k] = s2.v[k] + dw.v[k];
    }
  }
  for_vectors<W>(n - j, [&](int64_t jj, int cnt, auto full) {
    V uu, vv;
    uv(j + jj, cnt, full, uu, vv);
    const DPair<F> du = todp(uu), dv = todp(vv);
    for (int k = 0; k < NP; ++k) {
      s1.v[k] = s1.v[k] + du.v[k];
      s2.v[k] = at::vec::fmadd(du.v[k], dv.v[k], s2.v[k]);
    }
  });
  return {lane_sum(s1), lane_sum(s2)};
}

// batch_stats' pair for reduce2 / plane_sums: d = x - K as both u and v (sum d, sum d^2), lanes past cnt read as K
// (d = 0 there). d is exact when |x - K| <= |K| (Sterbenz), i.e. wherever |mean| >> std.
template <bool FULL, typename S, typename F = typename IO<S>::F>
inline void shifted_pair(const S* x, int cnt, const Vectorized<F>& k, Vectorized<F>& u, Vectorized<F>& v) {
  const Vectorized<F> xv = FULL ? IO<S>::load(x) : set_first(k, IO<S>::load(x, cnt), cnt);
  u = xv - k;
  v = u;
}

// A channel's mean and biased variance from the sums s1, s2 of d = x - K over its n elements, rounded once to F.
template <typename F>
inline void channel_stats(F K, double s1, double s2, double n, F& mean, F& var) {
  const double m = s1 / n;
  mean = static_cast<F>(static_cast<double>(K) + m);
  var = static_cast<F>(std::max(s2 / n - m * m, 0.0));
}

// elem(i, j, cnt, full, co, u, v): for the vector of elements at flat index i, segment offset j (cnt valid lanes;
// invalid lanes must give u = 0 and a finite v), the compute-type vectors u, v; the sums are sum u and sum u v,
// taken in double. Planes: four consecutive vectors are first combined pairwise in the compute type (two more
// roundings, then double), which quarters the conversions. Rows are walked as two sequential streams per unit (rows
// r and r + h, see below), never back and forth within a page; their sums are kept in the compute type over a few
// super-rows, then added to double. coef: the per-channel coefficient that co.get(0, j) gives. elem should capture by
// value: it is copied into each parallel task.
template <typename F, class Elem>
void reduce2(const Walk& g, const F* coef, const Elem& elem, double* out1, double* out2, int64_t cost = 1) {
  // units of kBlock elements, down to kBlock / cost where a small tensor would otherwise split in fewer than four
  // (smaller units everywhere made SiLU 16x512x7x7 20% slower: more accumulators to fold)
  const int64_t block = std::min(kBlock, std::max(kBlock / cost, g.numel / 4));
  constexpr int K = 1;
  const F* const src[K] = {coef};
  using D = Vectorized<double>;
  using V = Vectorized<F>;
  constexpr int W = Vectorized<F>::size();
  constexpr int H = D::size();
  constexpr int NP = DPair<F>::N;
  const int64_t C = g.C;
  if (!g.rows) {
    const int64_t S = g.inner;
    const int64_t parts = (S + kPart - 1) / kPart;
    const int64_t part = (S + parts - 1) / parts;
    const int64_t planes = g.numel / S;
    const int64_t units = planes * parts;
    std::vector<double> buf(2 * units);
    const F* const noexp[K] = {};
    const int64_t grain = std::max<int64_t>(1, block / std::min(S, part));
    at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
      const Elem el = elem;  // a local copy stays in registers (see for_each_vector's callers)
      // plane, part and channel of unit u, counted on from u0 (two divisions per unit
      // were a large part of a unit of 64 elements, GroupNorm mode at 8x8 px)
      int64_t pl = u0 / parts, pt = u0 - pl * parts, c = pl % C;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = pl * S + pt * part;
        const int64_t n = std::min(part, S - pt * part);
        Coef<F, K, false> co;
        for (int k = 0; k < K; ++k) co.set(k, src[k], noexp[k], c);
        if (++pt == parts) {
          pt = 0;
          ++pl;
          c = c + 1 == C ? 0 : c + 1;
        }
        const auto sums = plane_sums<F>(n, [&](int64_t j, int cnt, auto full, V& uu, V& vv) {
          el(b + j, j, cnt, full, co, uu, vv);
        });
        buf[2 * u] = sums.first;
        buf[2 * u + 1] = sums.second;
      }
    });
    // per channel in unit order (samples, then plane parts), walking buf in memory order
    std::fill(out1, out1 + C, 0.0);
    std::fill(out2, out2 + C, 0.0);
    const double* bp = buf.data();
    for (int64_t nn = 0; nn < planes / C; ++nn)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t pt = 0; pt < parts; ++pt, bp += 2) {
          out1[c] += bp[0];
          out2[c] += bp[1];
        }
  } else {
    const int64_t R = super_row(g);
    const CoefRows<F, K> cr(coef, 0, g);
    const int64_t nsr = (g.numel + R - 1) / R;
    // super-rows per unit: about `block` elements, and at least 4 super-rows when these are long, so that clearing
    // and folding the accumulators stays small next to the data
    const int64_t br_min = R >= kBlock / 4 ? 4 : 1;
    int64_t br = std::max<int64_t>(br_min, block / R);
    int64_t units = (nsr + br - 1) / br;
    // Then units of equal size, their count rounded up to a multiple of four where the rows allow, so that two or
    // four threads get equal shares (16x512x7x7 channels-last, 2 threads: 1.05-1.08 -> 0.88-0.94 ns per element).
    if (units > 1) {
      const int64_t units4 = (units + 3) / 4 * 4;
      br = std::max(br_min, (nsr + units4 - 1) / units4);
      units = (nsr + br - 1) / br;
    }
    std::vector<double> buf(2 * C * units);
    // Sums over kRowGroup super-rows are kept in the compute type, then added to double: a double accumulator per
    // element cost four loads and stores per float vector (store-port bound). Same rounding class as the planar
    // pairs. Eight rather than four (fewer flushes): 16x512x7x7 layers 0.85-0.96x as long on AVX512.
    constexpr int64_t kRowGroup = sizeof(F) == sizeof(float) ? 8 : int64_t(1) << 40;
    static_assert(kRowGroup % 2 == 0, "super-rows are added in pairs");
    // padded accumulator length, a whole number of cache lines
    const int64_t RP = (R + W + 15) / 16 * 16;
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      const Elem el = elem;
      // 64-byte aligned accumulators (unaligned vector stores split lines). The compute-type sums are zeroed once
      // (each flush clears them), the double ones never (a unit's first flush stores): 2x32x7x7 cleared 77 KB per call.
      std::unique_ptr<double[]> dmem(new double[2 * RP + 8]);
      std::vector<F> fmem(2 * RP + 64 / sizeof(F));
      auto align = [](auto* p) {
        using P = std::remove_pointer_t<decltype(p)>;
        const uintptr_t mis = reinterpret_cast<uintptr_t>(p) % 64;
        return mis == 0 ? p : p + (64 - mis) / sizeof(P);
      };
      double* const dacc = align(dmem.get());
      F* const facc = align(fmem.data());
      F* const facc2 = facc + RP;  // (RP itself is shared with the pool: reloaded per vector)
      auto flush = [&](bool first) {  // double (+)= compute type, then clear the latter
        for (int64_t j = 0; j < 2 * RP; j += W) {
          DPair<F> d = todp(V::loadu(facc + j));
          for (int k = 0; k < NP; ++k)
            (first ? d.v[k] : D::loadu(dacc + j + k * H) + d.v[k]).store(dacc + j + k * H);
          V(F(0)).store(facc + j);
        }
      };
      Coef<F, K, true> co;  // every super-row starts at offset 0 of the pattern
      for (int k = 0; k < K; ++k) co.set(k, cr.src[k], cr.exp[k], 0);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * br, r1 = std::min(nsr, (u + 1) * br);
        // Whole super-rows in pairs, r and r + h (about half the unit on, see pair_distance), added into the
        // accumulators together: one load and store of them per two vectors (batch_stats 16x256x7x7 channels-last,
        // AVX2: 30.6 -> 24.5 us). Pairs of adjacent rows read each page back and forth, which the hardware
        // prefetchers do not follow: from DRAM, batch_stats 16x64x56x56 channels-last took 2.7x the contiguous
        // layout's time (AVX2). kRowGroup is even: a pair never spans a flush; the single rows come last.
        const int64_t whole = std::min(r1, g.numel / R);  // super-rows before this one are whole
        const int64_t h = whole - r0 >= 2 ? pair_distance((whole - r0) / 2, R, sizeof(F)) : 0;
        int64_t added = 0;
        auto rows_added = [&](int64_t k) {
          added += k;
          if (added % kRowGroup == 0 || added == r1 - r0) flush(added <= kRowGroup);
        };
        for (int64_t k = 0; k < h; ++k) {
          const int64_t ea = (r0 + k) * R, eb = ea + h * R;
          for_vectors<W>(R, [&](int64_t j, int cnt, auto full) {
            V ua, va, ub, vb;
            el(ea + j, j, cnt, full, co, ua, va);
            el(eb + j, j, cnt, full, co, ub, vb);
            F* p1 = facc + j;
            F* p2 = facc2 + j;
            (V::loadu(p1) + (ua + ub)).store(p1);
            at::vec::fmadd(ub, vb, at::vec::fmadd(ua, va, V::loadu(p2))).store(p2);
          });
          rows_added(2);
        }
        for (int64_t r = r0 + 2 * h; r < r1; ++r) {
          const int64_t e = r * R;
          for_vectors<W>(std::min(R, g.numel - e), [&](int64_t j, int cnt, auto full) {
            V uu, vv;
            el(e + j, j, cnt, full, co, uu, vv);
            F* p1 = facc + j;
            F* p2 = facc2 + j;
            (V::loadu(p1) + uu).store(p1);
            at::vec::fmadd(uu, vv, V::loadu(p2)).store(p2);
          });
          rows_added(1);
        }
        // fold the super-row to channels (a fixed order: rows, then positions)
        double* o = buf.data() + 2 * C * u;
        std::fill(o, o + 2 * C, 0.0);
        // channels-last and (N, C): the same additions in the same order, vectorised over channels (two lane sums of
        // empty vectors per position cost 13% of the four operators' instructions at 16x512x7x7 channels-last)
        if (g.inner == 1) {
          for (int64_t k = 0; k < R / C; ++k) {
            const double* p1 = dacc + k * C;
            const double* p2 = p1 + RP;
            for (int64_t c = 0; c < C; ++c) {
              o[c] += p1[c];
              o[C + c] += p2[c];
            }
          }
        } else {
          for (int64_t k = 0; k < R / (C * g.inner); ++k)
            for (int64_t c = 0; c < C; ++c) {
              const double* p1 = dacc + (k * C + c) * g.inner;
              const double* p2 = p1 + RP;
              D v1(0.0), v2(0.0);
              int64_t sidx = 0;
              for (; sidx + H <= g.inner; sidx += H) {
                v1 = v1 + D::loadu(p1 + sidx);
                v2 = v2 + D::loadu(p2 + sidx);
              }
              double t1 = lane_sum<double>(DPair<double>{{v1}});
              double t2 = lane_sum<double>(DPair<double>{{v2}});
              for (; sidx < g.inner; ++sidx) {
                t1 += p1[sidx];
                t2 += p2[sidx];
              }
              o[c] += t1;
              o[C + c] += t2;
            }
        }
      }
    });
    // per channel in unit order, walking buf in memory order (channel-major, a
    // stride of 2 C doubles per step, took a third of the time at 4096x512)
    std::fill(out1, out1 + C, 0.0);
    std::fill(out2, out2 + C, 0.0);
    for (int64_t u = 0; u < units; ++u) {
      const double* o = buf.data() + 2 * C * u;
      for (int64_t c = 0; c < C; ++c) {
        out1[c] += o[c];
        out2[c] += o[C + c];
      }
    }
  }
}


// ---------------------------------------------------------------------------
// How a kernel walks memory: the channel of position e is (e / inner) % C. Contiguous tensors with small planes take
// the rows path where the channel pattern (P = C S) is at most kRowsMaxPeriod (coefficients and accumulators stay in
// L2) and, with cost = kCost (1 for batch_stats), S < 16 or S < 32 with N >= 8 (cost 1), S < kRowsMaxPlane with
// N >= 8 or with P <= 4096 (cost > 1): rows cost a K P expansion per call and a P-long fold per reduction unit, planes
// a partial vector per plane, which costly activations pay in full (16x256x2x2 leaky_relu: rows 30, planes 108 us).
// elementwise (forward_, backward_input), cost 1: planes of 16 elements are whole vectors on every ISA, and there
// rows pay for their coefficient loads per vector unless N >= 16 or P < 8192 (identity and leaky_relu layers
// 0.84-0.91x as long with planes at 8x{512,1024,2048}x4x4, AVX512 and AVX2); the reductions keep rows there (as fast,
// and a SiLU layer, whose other kernels walk rows, took 1.06-1.11x as long at 8x1024x4x4 with batch_stats on planes).
constexpr int64_t kRowsMaxPlane = 128;
constexpr int64_t kRowsMaxPeriod = 32768;

inline Walk walk_of(const Geometry& g, int64_t cost, bool elementwise = false) {
  Walk w{g.numel, g.C, g.inner(), true};
  if (!g.channels_last) {
    const int64_t P = g.C * g.S;
    const bool whole16 = elementwise && g.S == 16 && g.N < 16 && P >= 8192;
    const bool rows = cost > 1 ? g.S < kRowsMaxPlane && (g.N >= 8 || P <= 4096)
                               : g.S < 16 || (g.S < 32 && g.N >= 8 && !whole16);
    w.rows = g.S == 1 || (rows && P <= kRowsMaxPeriod);
  }
  return w;
}

// f(S{}, std::integral_constant<Act, A>{}, std::bool_constant<residual>{}):
// the kernel's template arguments, dispatched once per call.
template <class Fn>
void dispatch(const KernelArgs& a, const Fn& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "inplace_abn_cpu", [&] {
    dispatch_act(a.act, [&](auto act) {
      if (a.residual.defined())
        f(scalar_t{}, act, std::true_type{});
      else
        f(scalar_t{}, act, std::false_type{});
    });
  });
}

// dispatch with the ReLU path as a fourth argument, f(s, act, res, relu): relu = std::true_type where the flag is set
// (the identity's only: the ReLU layer's z, kernel.h), else std::false_type.
template <class Fn>
void dispatch_relu(const KernelArgs& a, bool relu, const Fn& f) {
  dispatch(a, [&](auto s, auto act, auto res) {
    if constexpr (decltype(act)::value == Act::Identity)
      if (relu) return f(s, act, res, std::true_type{});
    f(s, act, res, std::false_type{});
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
