// Vectorised CPU kernels of In-Place ABN, written once and compiled per SIMD
// level: kernels_default.cpp, kernels_avx2.cpp and kernels_avx512.cpp include
// this header after setting CPU_CAPABILITY / CPU_CAPABILITY_<ISA> (which
// select at::vec::Vectorized's implementation) and the compiler's target ISA.
// Everything here lives in namespace inplace_abn::cpu::CPU_CAPABILITY, inside
// an unnamed namespace, so the per-ISA copies never collide at link time; the
// only external symbol is kernel_table().
//
// The element-wise math comes from activations.h, instantiated with the
// vector policy VecMath below.
//
// Memory is walked in its own order (see Geometry in kernel_api.h) as a
// sequence of segments that each keep their channel pattern:
//  - planar (contiguous N, C, S): a segment is (part of) one (n, c) plane, the
//    channel coefficients are broadcast scalars;
//  - rows (channels-last and (N, C); contiguous with small planes): a segment
//    is (part of) a "super-row" of R = k C S elements (k rows of the channel
//    pattern, R >= 256 so short rows still fill vectors), the coefficients are
//    arrays over the super-row, loaded at the segment offset.
// Within a segment: full vectors, then one partial vector (masked load /
// store). Every element goes through the same vector code, so results do not
// depend on where segment or thread boundaries fall.
//
// Reductions use a partition that depends on the shape only (planes or plane
// parts; blocks of super-rows), with one partial result per unit written to
// its own slot and combined in a fixed order: results are bitwise
// reproducible for any thread count. Sums accumulate in double (in planes,
// groups of four vectors are added in the compute type first, see reduce2).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "activations.h"
#include "cpu/kernel_api.h"

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY before including kernels_impl.h"
#endif

namespace inplace_abn {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// ---------------------------------------------------------------------------
// ISA helpers: lane masks <-> bits, float -> double.

// Bit i set where lane i of a comparison result (all-ones lanes) is set.
inline uint32_t movemask(const Vectorized<float>& m) {
#if defined(CPU_CAPABILITY_AVX512)
  return static_cast<uint32_t>(_mm512_movepi32_mask(_mm512_castps_si512(m)));
#elif defined(CPU_CAPABILITY_AVX2)
  return static_cast<uint32_t>(_mm256_movemask_ps(m));
#else
  uint32_t lanes[Vectorized<float>::size()];
  m.store(lanes);
  uint32_t r = 0;
  for (int i = 0; i < Vectorized<float>::size(); ++i) r |= (lanes[i] != 0 ? 1u : 0u) << i;
  return r;
#endif
}
inline uint32_t movemask(const Vectorized<double>& m) {
#if defined(CPU_CAPABILITY_AVX512)
  return static_cast<uint32_t>(_mm512_movepi64_mask(_mm512_castpd_si512(m)));
#elif defined(CPU_CAPABILITY_AVX2)
  return static_cast<uint32_t>(_mm256_movemask_pd(m));
#else
  uint64_t lanes[Vectorized<double>::size()];
  m.store(lanes);
  uint32_t r = 0;
  for (int i = 0; i < Vectorized<double>::size(); ++i) r |= (lanes[i] != 0 ? 1u : 0u) << i;
  return r;
#endif
}

// Bit i set where lane i of v is < w (ordered).
inline uint32_t lt_bits(const Vectorized<float>& v, const Vectorized<float>& w) {
#if defined(CPU_CAPABILITY_AVX512)
  return static_cast<uint32_t>(_mm512_cmp_ps_mask(v, w, _CMP_LT_OQ));
#elif defined(CPU_CAPABILITY_AVX2)
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, w, _CMP_LT_OQ)));
#else
  return movemask(v < w);
#endif
}
inline uint32_t lt_bits(const Vectorized<double>& v, const Vectorized<double>& w) {
#if defined(CPU_CAPABILITY_AVX512)
  return static_cast<uint32_t>(_mm512_cmp_pd_mask(v, w, _CMP_LT_OQ));
#elif defined(CPU_CAPABILITY_AVX2)
  return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_cmp_pd(v, w, _CMP_LT_OQ)));
#else
  return movemask(v < w);
#endif
}

// Lane i = 1 where bit i is set, else 0.
template <typename F>
inline Vectorized<F> from_bits(uint32_t bits);
template <>
inline Vectorized<float> from_bits<float>(uint32_t bits) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(1.f));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane);
  __m256i m = _mm256_cmpeq_epi32(b, lane);
  return _mm256_and_ps(_mm256_castsi256_ps(m), _mm256_set1_ps(1.f));
#else
  float lanes[Vectorized<float>::size()];
  for (int i = 0; i < Vectorized<float>::size(); ++i) lanes[i] = ((bits >> i) & 1u) ? 1.f : 0.f;
  return Vectorized<float>::loadu(lanes);
#endif
}
template <>
inline Vectorized<double> from_bits<double>(uint32_t bits) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_mov_pd(static_cast<__mmask8>(bits), _mm512_set1_pd(1.0));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i lane = _mm256_setr_epi64x(1, 2, 4, 8);
  __m256i b = _mm256_and_si256(_mm256_set1_epi64x(static_cast<long long>(bits)), lane);
  __m256i m = _mm256_cmpeq_epi64(b, lane);
  return _mm256_and_pd(_mm256_castsi256_pd(m), _mm256_set1_pd(1.0));
#else
  double lanes[Vectorized<double>::size()];
  for (int i = 0; i < Vectorized<double>::size(); ++i) lanes[i] = ((bits >> i) & 1u) ? 1.0 : 0.0;
  return Vectorized<double>::loadu(lanes);
#endif
}

// sign bit of v set ? a : b, lane-wise.
inline Vectorized<float> select_signbit(const Vectorized<float>& v, const Vectorized<float>& a,
                                        const Vectorized<float>& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(v)), b, a);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_blendv_ps(b, a, v);
#else
  constexpr int W = Vectorized<float>::size();
  float vv[W], av[W], bv[W];
  v.store(vv);
  a.store(av);
  b.store(bv);
  for (int i = 0; i < W; ++i) av[i] = std::signbit(vv[i]) ? av[i] : bv[i];
  return Vectorized<float>::loadu(av);
#endif
}
inline Vectorized<double> select_signbit(const Vectorized<double>& v, const Vectorized<double>& a,
                                         const Vectorized<double>& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_blend_pd(_mm512_movepi64_mask(_mm512_castpd_si512(v)), b, a);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_blendv_pd(b, a, v);
#else
  constexpr int W = Vectorized<double>::size();
  double vv[W], av[W], bv[W];
  v.store(vv);
  a.store(av);
  b.store(bv);
  for (int i = 0; i < W; ++i) av[i] = std::signbit(vv[i]) ? av[i] : bv[i];
  return Vectorized<double>::loadu(av);
#endif
}

// A float vector as two double vectors (low lanes, high lanes).
static_assert(Vectorized<float>::size() == 2 * Vectorized<double>::size(), "vector widths");
inline void to_double(const Vectorized<float>& v, Vectorized<double>& lo, Vectorized<double>& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
#else
  constexpr int W = Vectorized<float>::size();
  float f[W];
  double d[W];
  v.store(f);
  for (int i = 0; i < W; ++i) d[i] = f[i];
  lo = Vectorized<double>::loadu(d);
  hi = Vectorized<double>::loadu(d + W / 2);
#endif
}

// ---------------------------------------------------------------------------
// Lane-wise primitives of the vector math policy, per ISA: compare-and-blend
// through mask registers (AVX512) or blendv (AVX2) instead of at::vec's
// generic mask-vector round trips, and max / min without at::vec's extra NaN
// handling (x86 max/min return their second operand when either is NaN, so
// vmax(a, b) = max(b, a) still returns a NaN `a`).

#if defined(CPU_CAPABILITY_AVX512)
inline Vectorized<float> vmax(const Vectorized<float>& a, const Vectorized<float>& b) { return _mm512_max_ps(b, a); }
inline Vectorized<float> vmin(const Vectorized<float>& a, const Vectorized<float>& b) { return _mm512_min_ps(b, a); }
inline Vectorized<double> vmax(const Vectorized<double>& a, const Vectorized<double>& b) { return _mm512_max_pd(b, a); }
inline Vectorized<double> vmin(const Vectorized<double>& a, const Vectorized<double>& b) { return _mm512_min_pd(b, a); }
// cmp(v, w) ? a : b
template <int P>
inline Vectorized<float> sel(const Vectorized<float>& v, const Vectorized<float>& w, const Vectorized<float>& a,
                             const Vectorized<float>& b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, w, P), b, a);
}
template <int P>
inline Vectorized<double> sel(const Vectorized<double>& v, const Vectorized<double>& w, const Vectorized<double>& a,
                              const Vectorized<double>& b) {
  return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, w, P), b, a);
}
template <int P>
inline bool any_cmp(const Vectorized<float>& v, const Vectorized<float>& w) {
  return _mm512_cmp_ps_mask(v, w, P) != 0;
}
template <int P>
inline bool any_cmp(const Vectorized<double>& v, const Vectorized<double>& w) {
  return _mm512_cmp_pd_mask(v, w, P) != 0;
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Vectorized<float> vmax(const Vectorized<float>& a, const Vectorized<float>& b) { return _mm256_max_ps(b, a); }
inline Vectorized<float> vmin(const Vectorized<float>& a, const Vectorized<float>& b) { return _mm256_min_ps(b, a); }
inline Vectorized<double> vmax(const Vectorized<double>& a, const Vectorized<double>& b) { return _mm256_max_pd(b, a); }
inline Vectorized<double> vmin(const Vectorized<double>& a, const Vectorized<double>& b) { return _mm256_min_pd(b, a); }
template <int P>
inline Vectorized<float> sel(const Vectorized<float>& v, const Vectorized<float>& w, const Vectorized<float>& a,
                             const Vectorized<float>& b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(v, w, P));
}
template <int P>
inline Vectorized<double> sel(const Vectorized<double>& v, const Vectorized<double>& w, const Vectorized<double>& a,
                              const Vectorized<double>& b) {
  return _mm256_blendv_pd(b, a, _mm256_cmp_pd(v, w, P));
}
template <int P>
inline bool any_cmp(const Vectorized<float>& v, const Vectorized<float>& w) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v, w, P)) != 0;
}
template <int P>
inline bool any_cmp(const Vectorized<double>& v, const Vectorized<double>& w) {
  return _mm256_movemask_pd(_mm256_cmp_pd(v, w, P)) != 0;
}
#else
#ifndef _CMP_LT_OQ
#define _CMP_LT_OQ 0x11
#define _CMP_GE_OQ 0x1d
#define _CMP_NEQ_UQ 0x04
#endif
template <typename F>
inline Vectorized<F> vmax(const Vectorized<F>& a, const Vectorized<F>& b) {
  return at::vec::maximum(a, b);
}
template <typename F>
inline Vectorized<F> vmin(const Vectorized<F>& a, const Vectorized<F>& b) {
  return at::vec::minimum(a, b);
}
template <int P, typename F>
inline Vectorized<F> cmp_mask(const Vectorized<F>& v, const Vectorized<F>& w) {
  if constexpr (P == _CMP_LT_OQ)
    return v < w;
  else if constexpr (P == _CMP_GE_OQ)
    return v >= w;
  else
    return v != w;
}
template <int P, typename F>
inline Vectorized<F> sel(const Vectorized<F>& v, const Vectorized<F>& w, const Vectorized<F>& a,
                         const Vectorized<F>& b) {
  return Vectorized<F>::blendv(b, a, cmp_mask<P>(v, w));
}
template <int P, typename F>
inline bool any_cmp(const Vectorized<F>& v, const Vectorized<F>& w) {
  return movemask(cmp_mask<P>(v, w)) != 0;
}
#endif

// e^x. float on AVX2 / AVX512: Cody-Waite reduction x = n ln2 + r, |r| <=
// ln2 / 2, and Cephes' expf polynomial (about 1 ulp), inlined (the Sleef call
// through at::vec costs more than the whole computation). Otherwise at::vec.
inline Vectorized<float> vexp(const Vectorized<float>& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  using R = __m512;
  auto set1 = [](float v) { return _mm512_set1_ps(v); };
  auto fmadd = [](R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); };
  auto fnmadd = [](R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); };
  R xv = x;
  R n = _mm512_roundscale_ps(_mm512_mul_ps(xv, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  using R = __m256;
  auto set1 = [](float v) { return _mm256_set1_ps(v); };
  auto fmadd = [](R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); };
  auto fnmadd = [](R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); };
  // 2^n is built from its exponent bits: keep n in [-126, 127] (so e^x is
  // capped at e^88.03 below the overflow threshold 88.72; inf above it)
  R xv = _mm256_max_ps(_mm256_min_ps(x, set1(88.02969193f)), set1(-87.3365447504f));
  xv = _mm256_blendv_ps(xv, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // keep NaN
  R n = _mm256_round_ps(_mm256_mul_ps(xv, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  R r = fnmadd(n, set1(0.693359375f), xv);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  R p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
#if defined(CPU_CAPABILITY_AVX512)
  p = fmadd(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, set1(1.f)));
  return _mm512_scalef_ps(p, n);
#else
  p = fmadd(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, set1(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  R res = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  // below the clamp: 0 (what the unclamped formula would underflow to)
  res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, set1(-87.3365447504f), _CMP_LT_OQ));
  return _mm256_blendv_ps(res, set1(INFINITY), _mm256_cmp_ps(x, set1(88.7228391f), _CMP_GT_OQ));
#endif
#else
  return x.exp();
#endif
}
inline Vectorized<double> vexp(const Vectorized<double>& x) { return x.exp(); }

// log(x), x > 0 normal. float on AVX2 / AVX512: x = m 2^e, m in
// [sqrt(1/2), sqrt(2)), and Cephes' logf polynomial for log(m) (about 1 ulp).
inline Vectorized<float> vlog(const Vectorized<float>& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  using R = __m512;
  auto set1 = [](float v) { return _mm512_set1_ps(v); };
  auto fmadd = [](R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); };
  auto mul = [](R a, R b) { return _mm512_mul_ps(a, b); };
  auto add = [](R a, R b) { return _mm512_add_ps(a, b); };
  auto sub = [](R a, R b) { return _mm512_sub_ps(a, b); };
  R m = _mm512_getmant_ps(x, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_src);  // [0.5, 1)
  R e = add(_mm512_getexp_ps(x), set1(1.f));
  __mmask16 small = _mm512_cmp_ps_mask(m, set1(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm512_mask_sub_ps(e, small, e, set1(1.f));
  R f = _mm512_mask_add_ps(sub(m, set1(1.f)), small, sub(m, set1(1.f)), m);  // 2m - 1 or m - 1
#else
  using R = __m256;
  auto set1 = [](float v) { return _mm256_set1_ps(v); };
  auto fmadd = [](R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); };
  auto mul = [](R a, R b) { return _mm256_mul_ps(a, b); };
  auto add = [](R a, R b) { return _mm256_add_ps(a, b); };
  auto sub = [](R a, R b) { return _mm256_sub_ps(a, b); };
  __m256i bits = _mm256_castps_si256(x);
  R e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  R m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f000000)));
  R small = _mm256_cmp_ps(m, set1(0.707106781186547524f), _CMP_LT_OQ);
  e = sub(e, _mm256_and_ps(small, set1(1.f)));
  R f = add(sub(m, set1(1.f)), _mm256_and_ps(small, m));
#endif
  R z = mul(f, f);
  R p = set1(7.0376836292e-2f);
  p = fmadd(p, f, set1(-1.1514610310e-1f));
  p = fmadd(p, f, set1(1.1676998740e-1f));
  p = fmadd(p, f, set1(-1.2420140846e-1f));
  p = fmadd(p, f, set1(1.4249322787e-1f));
  p = fmadd(p, f, set1(-1.6668057665e-1f));
  p = fmadd(p, f, set1(2.0000714765e-1f));
  p = fmadd(p, f, set1(-2.4999993993e-1f));
  p = fmadd(p, f, set1(3.3333331174e-1f));
  p = mul(mul(p, f), z);
  p = fmadd(e, set1(-2.12194440e-4f), p);
  p = fmadd(z, set1(-0.5f), p);
  return fmadd(e, set1(0.693359375f), add(f, p));
#else
  return x.log();
#endif
}
inline Vectorized<double> vlog(const Vectorized<double>& x) { return x.log(); }

// 1 / x to about an ulp: AVX512 float: 14-bit estimate and one Newton step
// (error ~2^-28, cheaper than vdivps); otherwise a division.
inline Vectorized<float> vrcp(const Vectorized<float>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f)));
#else
  return Vectorized<float>(1.f) / x;
#endif
}
inline Vectorized<double> vrcp(const Vectorized<double>& x) { return Vectorized<double>(1.0) / x; }

// ---------------------------------------------------------------------------
// The vector math policy of activations.h.
template <typename F>
struct VecMath {
  using Scalar = F;
  using T = Vectorized<F>;
  static T c(double v) { return T(static_cast<F>(v)); }
  static T fma(const T& a, const T& b, const T& c) { return at::vec::fmadd(a, b, c); }
  static T exp(const T& x) { return vexp(x); }
  static T log(const T& x) { return vlog(x); }
  static T sqrt(const T& x) { return x.sqrt(); }
  static T rcp(const T& x) { return vrcp(x); }
  // at::vec's expm1 / log1p call Sleef versions that are very slow in
  // libtorch builds; Kahan's compensated forms are accurate to a few ulp:
  //   expm1(x) = (u - 1) x / log(u), u = e^x;  log1p(x) = log(u) x / (u - 1), u = 1 + x
  static T expm1(const T& x) {
    const T one(F(1)), zero(F(0));
    T u = exp(x);
    T um1 = u - one;
    T r = um1 * x / log(u);
    r = sel<_CMP_NEQ_UQ>(u, one, r, x);          // u == 1: x
    r = sel<_CMP_NEQ_UQ>(u, zero, r, T(F(-1)));  // u == 0: -1
    return sel<_CMP_LT_OQ>(u, T(F(2)), r, um1);  // u >= 2: u - 1 is exact enough
  }
  static T log1p(const T& x) {
    const T one(F(1));
    T u = x + one;
    T r = log(u) * x / (u - one);
    return sel<_CMP_NEQ_UQ>(u, one, r, x);  // u == 1: x
  }
  static T max(const T& a, const T& b) { return vmax(a, b); }
  static T min(const T& a, const T& b) { return vmin(a, b); }
  static T if_nonneg(const T& v, const T& a, const T& b) { return sel<_CMP_GE_OQ>(v, T(F(0)), a, b); }
  static T if_signbit(const T& v, const T& a, const T& b) { return select_signbit(v, a, b); }
  static T if_less(const T& v, const T& w, const T& a, const T& b) { return sel<_CMP_LT_OQ>(v, w, a, b); }
  static T if_set(const T& flag, const T& a, const T& b) { return sel<_CMP_NEQ_UQ>(flag, T(F(0)), a, b); }
  static bool any(const T& flag) { return any_cmp<_CMP_NEQ_UQ>(flag, T(F(0))); }
};

// ---------------------------------------------------------------------------
// Loads and stores of W = Vectorized<F>::size() elements of the storage type,
// converted to / from the compute type F. Partial variants touch n < W
// elements only; the other lanes load as zero.
template <typename S>
struct IO {
  using F = S;
  using V = Vectorized<F>;
  static constexpr int W = V::size();
  static V load(const S* p) { return V::loadu(p); }
  static V load(const S* p, int64_t n) { return V::loadu(p, n); }
  static void store(S* p, const V& v) { v.store(p); }
  static void store(S* p, const V& v, int64_t n) { v.store(p, n); }
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
  static V load(const H* p, int64_t n) {
    H buf[W];
    for (int i = 0; i < W; ++i) buf[i] = H(0.f);
    std::memcpy(buf, p, n * sizeof(H));
    return load(buf);
  }
  static void store(H* p, const V& v) { at::vec::convert_from_float<H>(v, v).store(p, W); }
  static void store(H* p, const V& v, int64_t n) { at::vec::convert_from_float<H>(v, v).store(p, n); }
};
template <>
struct IO<at::Half> : IOReduced<at::Half> {};
template <>
struct IO<at::BFloat16> : IOReduced<at::BFloat16> {};

// ---------------------------------------------------------------------------
// Walking memory by segments (see the top of the file).

// Length of the super-row: k whole rows of P = C S, at least kMinRow elements.
constexpr int64_t kMinRow = 256;
inline int64_t super_row(const Geometry& g) {
  const int64_t P = g.C * g.S;
  return P * std::max<int64_t>(1, (kMinRow + P - 1) / P);
}

// Calls fn(e, n, key) for consecutive segments covering [e0, e1); key is the
// channel (planar) or the offset in the super-row (rows).
template <class Fn>
inline void walk(const Geometry& g, int64_t R, int64_t e0, int64_t e1, const Fn& fn) {
  if (!g.rows) {
    int64_t p = e0 / g.S;
    int64_t o = e0 - p * g.S;
    while (e0 < e1) {
      int64_t n = std::min(e1 - e0, g.S - o);
      fn(e0, n, p % g.C);
      e0 += n;
      ++p;
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

// A per-channel vector spread over the super-row (position r holds channel
// (r / S) % C), padded with one vector of zeros so that a partial vector at
// the end of a segment can be loaded whole.
template <typename F>
std::vector<F> expand(const F* src, const Geometry& g, int64_t R) {
  std::vector<F> out(R + Vectorized<F>::size(), F(0));
  F* o = out.data();
  for (int64_t k = 0; k < R / (g.C * g.S); ++k)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t s = 0; s < g.S; ++s) *o++ = src[c];
  return out;
}

// Per-channel coefficient source for one segment: broadcast scalars (planar)
// or arrays read at the segment offset (rows).
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
  void set(int k, const F* per_channel, const std::vector<F>& expanded, int64_t key) {
    if constexpr (ROWS)
      arr[k] = expanded.data() + key;
    else
      bc[k] = V(per_channel[key]);
  }
};

// Runs body(co) with the coefficients of the segment at `key` set up from
// the per-channel arrays src[k] (planar) or their expansions exp[k] (rows).
template <typename F, int K, class Body>
inline void with_coef(bool rows, int64_t key, const F* const* src, const std::vector<F>* exp, const Body& body) {
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

// Runs step(j, cnt, full) over a segment of n elements: full vectors, then
// one partial vector.
template <int W, class Step>
inline void for_vectors(int64_t n, const Step& step) {
  int64_t j = 0;
  for (; j + W <= n; j += W) step(j, W, std::true_type{});
  if (j < n) step(j, static_cast<int>(n - j), std::false_type{});
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

// cnt (<= 32) mask bits starting at element e.
inline uint32_t read_bits(const int32_t* mask, int64_t e, int cnt) {
  const int64_t w = e >> 5;
  const int sh = static_cast<int>(e & 31);
  uint64_t v = static_cast<uint32_t>(mask[w]);
  if (sh + cnt > 32) v |= static_cast<uint64_t>(static_cast<uint32_t>(mask[w + 1])) << 32;
  return static_cast<uint32_t>(v >> sh) & static_cast<uint32_t>((uint64_t(1) << cnt) - 1);
}

inline uint32_t low_bits(int cnt) { return static_cast<uint32_t>((uint64_t(1) << cnt) - 1); }

// Software prefetch kPrefetch elements ahead in the reductions: their loops
// carry enough work per vector (double accumulators) that the hardware
// prefetchers alone leave DRAM bandwidth unused once the data leaves the cache.
constexpr int64_t kPrefetch = 2048;
template <typename S>
inline void prefetch(const S* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 0);
#endif
}

// Grain of the element-wise kernels, in elements.
constexpr int64_t kGrain = 16384;

// ---------------------------------------------------------------------------
// forward_: x <- f((x - mh - ml) * sc + sh [+ res]); SiLU: mask bits.
template <typename S, Act A, bool RES>
void forward_t(const ForwardArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  using Ac = Activation<A, VecMath<F>>;
  constexpr int W = io::W;
  constexpr bool MASK = A == Act::Silu;
  const Geometry& g = a.g;
  S* x = static_cast<S*>(a.x);
  const S* res = static_cast<const S*>(a.residual);
  const F* src[4] = {static_cast<const F*>(a.mean_hi), static_cast<const F*>(a.mean_lo),
                     static_cast<const F*>(a.scale), static_cast<const F*>(a.shift)};
  const int64_t R = g.rows ? super_row(g) : 0;
  std::vector<F> exp[4];
  if (g.rows)
    for (int k = 0; k < 4; ++k) exp[k] = expand(src[k], g, R);
  const V p(static_cast<F>(a.param));
  const int64_t nwords = (g.numel + 31) / 32;
  // Tasks start on mask-word boundaries so that no two write the same word.
  at::parallel_for(0, nwords, kGrain / 32, [&](int64_t w0, int64_t w1) {
    BitWriter bw(MASK ? a.mask + w0 : nullptr);
    const int64_t e0 = w0 * 32, e1 = std::min(w1 * 32, g.numel);
    walk(g, R, e0, e1, [&](int64_t e, int64_t n, int64_t key) {
      with_coef<F, 4>(g.rows, key, src, exp, [&](const auto& co) {
        S* xp = x + e;
        const S* rp = RES ? res + e : nullptr;
        for_vectors<W>(n, [&](int64_t j, int cnt, auto full) {
          constexpr bool FULL = decltype(full)::value;
          V xv = FULL ? io::load(xp + j) : io::load(xp + j, cnt);
          V z = at::vec::fmadd((xv - co.get(0, j)) - co.get(1, j), co.get(2, j), co.get(3, j));
          if constexpr (RES) z = z + (FULL ? io::load(rp + j) : io::load(rp + j, cnt));
          V y = Ac::forward(z, p);
          if constexpr (FULL)
            io::store(xp + j, y);
          else
            io::store(xp + j, y, cnt);
          if constexpr (MASK) {
            // Silu::branch(z) = [z < z*], one compare
            uint32_t bits = lt_bits(z, V(static_cast<F>(kSiluZStar)));
            bw.put(FULL ? bits : bits & low_bits(cnt), cnt);
          }
        });
      });
    });
    if (MASK) bw.flush();
  });
}

// ---------------------------------------------------------------------------
// backward_input: dx = agz gz + bzc (z - sh [- res]) + c0, dres = gz.
template <typename S, Act A, bool RES>
void backward_input_t(const BackwardInputArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  using Ac = Activation<A, VecMath<F>>;
  constexpr int W = io::W;
  constexpr bool MASK = A == Act::Silu;
  const Geometry& g = a.g;
  const S* y = static_cast<const S*>(a.y);
  const S* dy = static_cast<const S*>(a.dy);
  const S* res = static_cast<const S*>(a.residual);
  S* dx = static_cast<S*>(a.dx);
  S* dres = static_cast<S*>(a.dres);
  const F* src[4] = {static_cast<const F*>(a.shift), static_cast<const F*>(a.a_gz), static_cast<const F*>(a.b_zc),
                     static_cast<const F*>(a.c0)};
  const int64_t R = g.rows ? super_row(g) : 0;
  std::vector<F> exp[4];
  if (g.rows)
    for (int k = 0; k < 4; ++k) exp[k] = expand(src[k], g, R);
  const V p(static_cast<F>(a.param));
  at::parallel_for(0, g.numel, kGrain, [&](int64_t e0, int64_t e1) {
    walk(g, R, e0, e1, [&](int64_t e, int64_t n, int64_t key) {
      with_coef<F, 4>(g.rows, key, src, exp, [&](const auto& co) {
        for_vectors<W>(n, [&](int64_t j, int cnt, auto full) {
          constexpr bool FULL = decltype(full)::value;
          const int64_t i = e + j;
          V yv = FULL ? io::load(y + i) : io::load(y + i, cnt);
          V gv = FULL ? io::load(dy + i) : io::load(dy + i, cnt);
          V left(F(0));
          if constexpr (MASK) left = from_bits<F>(read_bits(a.mask, i, cnt));
          V d;
          V z = Ac::inverse_deriv(yv, left, p, d);
          V gz = gv * d;
          V zc = z - co.get(0, j);
          if constexpr (RES) zc = zc - (FULL ? io::load(res + i) : io::load(res + i, cnt));
          V out = at::vec::fmadd(co.get(1, j), gz, at::vec::fmadd(co.get(2, j), zc, co.get(3, j)));
          if constexpr (FULL) {
            io::store(dx + i, out);
            if (dres) io::store(dres + i, gz);
          } else {
            io::store(dx + i, out, cnt);
            if (dres) io::store(dres + i, gz, cnt);
          }
        });
      });
    });
  });
}

// ---------------------------------------------------------------------------
// Reductions: per channel, sum u and sum u v for per-element (u, v) in double.
// A unit of work is
//  planar: a part of a plane (at most kPart elements), sums in registers;
//  rows: a block of about kBlock elements (whole super-rows), sums in arrays
//        of length R, folded to C at the end of the unit;
// each unit writes its own partial sums; they are combined afterwards in
// unit order, so the result does not depend on the thread count.

constexpr int64_t kPart = 1 << 16;
constexpr int64_t kBlock = 1 << 15;

// A compute-type vector in double: two double vectors for float, one for double.
template <typename F>
struct DPair {
  static constexpr int N = sizeof(F) == sizeof(float) ? 2 : 1;
  Vectorized<double> v[N];
};
inline DPair<float> todp(const Vectorized<float>& x) {
  DPair<float> r;
  to_double(x, r.v[0], r.v[1]);
  return r;
}
inline DPair<double> todp(const Vectorized<double>& x) {
  DPair<double> r;
  r.v[0] = x;
  return r;
}

template <typename F>
inline double lane_sum(const DPair<F>& a) {
  constexpr int H = Vectorized<double>::size();
  double t[DPair<F>::N * H];
  for (int k = 0; k < DPair<F>::N; ++k) a.v[k].store(t + k * H);
  double s = 0;
  for (int i = 0; i < DPair<F>::N * H; ++i) s += t[i];
  return s;
}

// elem(i, j, cnt, full, co, u, v): for the vector of elements at flat index
// i, segment offset j (cnt valid lanes; invalid lanes must give u = 0 and a
// finite v), the compute-type vectors u, v; the sums are sum u and sum u v,
// taken in double. PAIRS (planar only): four consecutive
// vectors of a plane are first combined pairwise in the compute type (two
// more roundings, then double), which quarters the conversions. Rows are
// walked strictly in memory order (interleaving rows costs more DRAM
// bandwidth than it saves); their sums are kept in the compute type over a
// few super-rows, then added to double. src: the K per-channel coefficient
// arrays.
template <typename F, int K, bool PAIRS, class Elem>
void reduce2(const Geometry& g, const F* const* src, const Elem& elem, double* out1, double* out2) {
  using D = Vectorized<double>;
  using V = Vectorized<F>;
  constexpr int W = Vectorized<F>::size();
  constexpr int H = D::size();
  constexpr int NP = DPair<F>::N;
  const int64_t C = g.C;
  if (!g.rows) {
    const int64_t S = g.S;
    const int64_t parts = (S + kPart - 1) / kPart;
    const int64_t part = (S + parts - 1) / parts;
    const int64_t planes = g.numel / S;
    const int64_t units = planes * parts;
    std::vector<double> buf(2 * units);
    std::vector<F> noexp[K];
    const int64_t grain = std::max<int64_t>(1, kBlock / std::min(S, part));
    at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t pl = u / parts, pt = u - pl * parts;
        const int64_t b = pl * S + pt * part;
        const int64_t n = std::min(part, S - pt * part);
        Coef<F, K, false> co;
        for (int k = 0; k < K; ++k) co.set(k, src[k], noexp[k], pl % C);
        DPair<F> s1, s2;
        for (int k = 0; k < NP; ++k) s1.v[k] = s2.v[k] = D(0.0);
        auto acc_exact = [&](const V& uu, const V& vv) {
          DPair<F> du = todp(uu), dv = todp(vv);
          for (int k = 0; k < NP; ++k) {
            s1.v[k] = s1.v[k] + du.v[k];
            s2.v[k] = at::vec::fmadd(du.v[k], dv.v[k], s2.v[k]);
          }
        };
        int64_t j = 0;
        if constexpr (PAIRS) {
          // four vectors summed pairwise in F first, then in double
          for (; j + 4 * W <= n; j += 4 * W) {
            V u0, v0, u1, v1, u2, v2, u3, v3;
            elem(b + j, j, W, std::true_type{}, co, u0, v0);
            elem(b + j + W, j + W, W, std::true_type{}, co, u1, v1);
            elem(b + j + 2 * W, j + 2 * W, W, std::true_type{}, co, u2, v2);
            elem(b + j + 3 * W, j + 3 * W, W, std::true_type{}, co, u3, v3);
            DPair<F> du = todp((u0 + u1) + (u2 + u3));
            DPair<F> dw = todp(at::vec::fmadd(u1, v1, u0 * v0) + at::vec::fmadd(u3, v3, u2 * v2));
            for (int k = 0; k < NP; ++k) {
              s1.v[k] = s1.v[k] + du.v[k];
              s2.v[k] = s2.v[k] + dw.v[k];
            }
          }
        }
        for_vectors<W>(n - j, [&](int64_t jj, int cnt, auto full) {
          V uu, vv;
          elem(b + j + jj, j + jj, cnt, full, co, uu, vv);
          acc_exact(uu, vv);
        });
        buf[2 * u] = lane_sum(s1);
        buf[2 * u + 1] = lane_sum(s2);
      }
    });
    const int64_t N = planes / C;
    for (int64_t c = 0; c < C; ++c) {
      double a1 = 0, a2 = 0;
      for (int64_t nn = 0; nn < N; ++nn)
        for (int64_t pt = 0; pt < parts; ++pt) {
          const int64_t u = (nn * C + c) * parts + pt;
          a1 += buf[2 * u];
          a2 += buf[2 * u + 1];
        }
      out1[c] = a1;
      out2[c] = a2;
    }
  } else {
    const int64_t R = super_row(g);
    std::vector<F> exp[K];
    for (int k = 0; k < K; ++k) exp[k] = expand(src[k], g, R);
    const int64_t nsr = (g.numel + R - 1) / R;
    // super-rows per unit: about kBlock elements, and at least 4 super-rows
    // when these are long, so that clearing and folding the accumulators
    // stays small next to the data
    const int64_t br = std::max<int64_t>(R >= kBlock / 4 ? 4 : 1, kBlock / R);
    const int64_t units = (nsr + br - 1) / br;
    std::vector<double> buf(2 * C * units);
    // Sums over kRowGroup super-rows are kept in the compute type (one load and
    // one store per vector and sum), then added to double: a double
    // accumulator per element would cost four loads and four stores per float
    // vector, which bound the loop on the store port. Same rounding class as
    // the planar pairs (a handful of compute-type additions, then double).
    constexpr int64_t kRowGroup = sizeof(F) == sizeof(float) ? 4 : int64_t(1) << 40;
    // padded accumulator length, a whole number of cache lines
    const int64_t RP = (R + W + 15) / 16 * 16;
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      // 64-byte aligned accumulators: unaligned vector stores split lines
      std::vector<double> dmem(2 * RP + 8);
      std::vector<F> fmem(2 * RP + 64 / sizeof(F));
      auto align = [](auto* p) {
        using P = std::remove_pointer_t<decltype(p)>;
        const uintptr_t mis = reinterpret_cast<uintptr_t>(p) % 64;
        return mis == 0 ? p : p + (64 - mis) / sizeof(P);
      };
      double* const dacc = align(dmem.data());
      F* const facc = align(fmem.data());
      auto flush = [&]() {  // double += compute type, then clear the latter
        for (int64_t j = 0; j < 2 * RP; j += W) {
          DPair<F> d = todp(V::loadu(facc + j));
          for (int k = 0; k < NP; ++k) (D::loadu(dacc + j + k * H) + d.v[k]).store(dacc + j + k * H);
          V(F(0)).store(facc + j);
        }
      };
      Coef<F, K, true> co;  // every super-row starts at offset 0 of the pattern
      for (int k = 0; k < K; ++k) co.set(k, src[k], exp[k], 0);
      for (int64_t u = u0; u < u1; ++u) {
        std::fill(dacc, dacc + 2 * RP, 0.0);
        std::fill(facc, facc + 2 * RP, F(0));
        const int64_t r0 = u * br, r1 = std::min(nsr, (u + 1) * br);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t e = r * R;
          const int64_t n = std::min(R, g.numel - e);
          for_vectors<W>(n, [&](int64_t j, int cnt, auto full) {
            V uu, vv;
            elem(e + j, j, cnt, full, co, uu, vv);
            F* p1 = facc + j;
            F* p2 = facc + RP + j;
            (V::loadu(p1) + uu).store(p1);
            at::vec::fmadd(uu, vv, V::loadu(p2)).store(p2);
          });
          if ((r - r0) % kRowGroup == kRowGroup - 1 || r + 1 == r1) flush();
        }
        // fold the super-row to channels (a fixed order: rows, then positions)
        double* o = buf.data() + 2 * C * u;
        std::fill(o, o + 2 * C, 0.0);
        for (int64_t k = 0; k < R / (C * g.S); ++k)
          for (int64_t c = 0; c < C; ++c) {
            const double* p1 = dacc + (k * C + c) * g.S;
            const double* p2 = p1 + RP;
            D v1(0.0), v2(0.0);
            int64_t sidx = 0;
            for (; sidx + H <= g.S; sidx += H) {
              v1 = v1 + D::loadu(p1 + sidx);
              v2 = v2 + D::loadu(p2 + sidx);
            }
            double t1 = lane_sum<double>(DPair<double>{{v1}});
            double t2 = lane_sum<double>(DPair<double>{{v2}});
            for (; sidx < g.S; ++sidx) {
              t1 += p1[sidx];
              t2 += p2[sidx];
            }
            o[c] += t1;
            o[C + c] += t2;
          }
      }
    });
    for (int64_t c = 0; c < C; ++c) {
      double a1 = 0, a2 = 0;
      for (int64_t u = 0; u < units; ++u) {
        a1 += buf[2 * C * u + c];
        a2 += buf[2 * C * u + C + c];
      }
      out1[c] = a1;
      out2[c] = a2;
    }
  }
}

// ---------------------------------------------------------------------------
// batch_stats: sums of d = x - K_c and d^2, K_c = the channel's first element
// (a sample value, so |sum d| / n is of the order of the standard deviation
// and the variance does not cancel); d in the compute type (exact when
// |x - K| <= |K|, the hostile case |mean| >> std), pairs of d and d^2 in the
// compute type, sums in double.
template <typename S>
void batch_stats_t(const StatsArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  const Geometry& g = a.g;
  const int64_t C = g.C;
  const S* x = static_cast<const S*>(a.x);
  std::vector<F> K(C);
  for (int64_t c = 0; c < C; ++c) K[c] = static_cast<F>(x[c * g.S]);
  const F* src[1] = {K.data()};
  std::vector<double> s1(C), s2(C);
  reduce2<F, 1, true>(
      g, src,
      [&](int64_t i, int64_t j, int cnt, auto full, const auto& co, V& u, V& v) {
        constexpr bool FULL = decltype(full)::value;
        V k = co.get(0, j);
        // invalid lanes of a partial vector read as K: d = 0 there
        if constexpr (FULL) prefetch(x + i + kPrefetch);
        V xv = FULL ? io::load(x + i) : V::set(k, io::load(x + i, cnt), cnt);
        // exact when |x - K| <= |K| (Sterbenz), i.e. wherever |mean| >> std
        u = xv - k;
        v = u;
      },
      s1.data(), s2.data());
  const double n = static_cast<double>(g.numel / C);
  for (int64_t c = 0; c < C; ++c) {
    const double m = s1[c] / n;
    a.mean[c] = static_cast<double>(K[c]) + m;
    a.var[c] = std::max(s2[c] / n - m * m, 0.0);
  }
}

// ---------------------------------------------------------------------------
// backward_reduce: sum gz and sum gz (z - sh [- res]).
template <typename S, Act A, bool RES>
void backward_reduce_t(const BackwardReduceArgs& a) {
  using io = IO<S>;
  using F = typename io::F;
  using V = Vectorized<F>;
  using Ac = Activation<A, VecMath<F>>;
  constexpr bool MASK = A == Act::Silu;
  const S* y = static_cast<const S*>(a.y);
  const S* dy = static_cast<const S*>(a.dy);
  const S* res = static_cast<const S*>(a.residual);
  const F* src[1] = {static_cast<const F*>(a.shift)};
  const V p(static_cast<F>(a.param));
  reduce2<F, 1, true>(
      a.g, src,
      [&](int64_t i, int64_t j, int cnt, auto full, const auto& co, V& u, V& v) {
        constexpr bool FULL = decltype(full)::value;
        if constexpr (FULL) {
          prefetch(y + i + kPrefetch);
          prefetch(dy + i + kPrefetch);
          if constexpr (RES) prefetch(res + i + kPrefetch);
        }
        V yv = FULL ? io::load(y + i) : io::load(y + i, cnt);
        V gv = FULL ? io::load(dy + i) : io::load(dy + i, cnt);
        V left(F(0));
        if constexpr (MASK) left = from_bits<F>(read_bits(a.mask, i, cnt));
        V d;
        V z = Ac::inverse_deriv(yv, left, p, d);
        V gz = gv * d;
        V zc = z - co.get(0, j);
        if constexpr (RES) zc = zc - (FULL ? io::load(res + i) : io::load(res + i, cnt));
        if constexpr (!FULL) {
          gz = V::set(V(F(0)), gz, cnt);
          zc = V::set(V(F(0)), zc, cnt);
        }
        u = gz;
        v = zc;
      },
      a.sum_gz, a.sum_gz_zc);
}

// ---------------------------------------------------------------------------
// Dispatch on dtype, activation and residual, once per call.

template <template <typename, Act, bool> class Op, typename S, typename Args>
void by_act_res(const Args& a, bool res) {
  switch (static_cast<Act>(a.act)) {
    case Act::Identity:
      return res ? Op<S, Act::Identity, true>::run(a) : Op<S, Act::Identity, false>::run(a);
    case Act::LeakyRelu:
      return res ? Op<S, Act::LeakyRelu, true>::run(a) : Op<S, Act::LeakyRelu, false>::run(a);
    case Act::Elu:
      return res ? Op<S, Act::Elu, true>::run(a) : Op<S, Act::Elu, false>::run(a);
    case Act::Silu:
      return res ? Op<S, Act::Silu, true>::run(a) : Op<S, Act::Silu, false>::run(a);
  }
}

template <template <typename, Act, bool> class Op, typename Args>
void by_dtype(const Args& a, bool res) {
  switch (a.dtype) {
    case DType::Float:
      return by_act_res<Op, float>(a, res);
    case DType::Double:
      return by_act_res<Op, double>(a, res);
    case DType::Half:
      return by_act_res<Op, at::Half>(a, res);
    case DType::BFloat16:
      return by_act_res<Op, at::BFloat16>(a, res);
  }
}

template <typename S, Act A, bool RES>
struct ForwardOp {
  static void run(const ForwardArgs& a) { forward_t<S, A, RES>(a); }
};
template <typename S, Act A, bool RES>
struct BackwardReduceOp {
  static void run(const BackwardReduceArgs& a) { backward_reduce_t<S, A, RES>(a); }
};
template <typename S, Act A, bool RES>
struct BackwardInputOp {
  static void run(const BackwardInputArgs& a) { backward_input_t<S, A, RES>(a); }
};

void batch_stats_k(const StatsArgs& a) {
  switch (a.dtype) {
    case DType::Float:
      return batch_stats_t<float>(a);
    case DType::Double:
      return batch_stats_t<double>(a);
    case DType::Half:
      return batch_stats_t<at::Half>(a);
    case DType::BFloat16:
      return batch_stats_t<at::BFloat16>(a);
  }
}
void forward_k(const ForwardArgs& a) { by_dtype<ForwardOp>(a, a.residual != nullptr); }
void backward_reduce_k(const BackwardReduceArgs& a) { by_dtype<BackwardReduceOp>(a, a.residual != nullptr); }
void backward_input_k(const BackwardInputArgs& a) { by_dtype<BackwardInputOp>(a, a.residual != nullptr); }

}  // namespace

#define IABN_STR2(x) #x
#define IABN_STR(x) IABN_STR2(x)
const KernelTable& kernel_table() {
  static const KernelTable table = {IABN_STR(CPU_CAPABILITY), &batch_stats_k, &forward_k, &backward_reduce_k,
                                    &backward_input_k};
  return table;
}
#undef IABN_STR
#undef IABN_STR2

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace inplace_abn
