// Element-wise activation math of In-Place ABN: forward f(z), inverse f^-1(y)
// and derivative f'(z) recovered from the output (DESIGN.md section 3).
//
// This is the single source of truth for these formulas. It is written once,
// generic over a "math" policy M that supplies the arithmetic on a value type
// M::T: ScalarMath<float|double> below (used by the CUDA kernels and by the
// CPU tail loops) and a Vectorized policy in the CPU kernels. Anything beyond
// + - * / goes through M so the same text compiles for scalars and SIMD
// vectors.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define IABN_HD __host__ __device__ __forceinline__
#else
#define IABN_HD inline
#endif

namespace inplace_abn {

enum class Act : int64_t { Identity = 0, LeakyRelu = 1, Elu = 2, Silu = 3 };

// SiLU minimum: f'(z*) = 0, f(z*) = z* + 1, f''(z*) = kSiluCurv.
constexpr double kSiluZStar = -1.2784645427610738;
constexpr double kSiluYStar = -0.2784645427610738;
constexpr double kSiluCurv = 0.2178117057198001;

// Scalar math policy (host and device).
IABN_HD float iabn_exp(float x) { return expf(x); }
IABN_HD double iabn_exp(double x) { return exp(x); }
IABN_HD float iabn_expm1(float x) { return expm1f(x); }
IABN_HD double iabn_expm1(double x) { return expm1(x); }
IABN_HD float iabn_log(float x) { return logf(x); }
IABN_HD double iabn_log(double x) { return log(x); }
IABN_HD float iabn_log1p(float x) { return log1pf(x); }
IABN_HD double iabn_log1p(double x) { return log1p(x); }
IABN_HD float iabn_sqrt(float x) { return sqrtf(x); }
IABN_HD double iabn_sqrt(double x) { return sqrt(x); }

// A math policy M provides: the value type T, the underlying real type Scalar
// (float or double: it selects constants and iteration counts), c(v) for a
// constant, the functions below, fma(a, b, c) = a * b + c, the selects
// if_nonneg / if_less / if_set, and any(flag): whether any lane of a 0/1 flag
// is set (for a scalar: the flag itself), used to skip rarely needed work.
template <typename S>
struct ScalarMath {
  using T = S;
  using Scalar = S;
  static IABN_HD T c(double v) { return static_cast<T>(v); }
  static IABN_HD T fma(T a, T b, T c) { return a * b + c; }
  static IABN_HD T exp(T x) { return iabn_exp(x); }
  static IABN_HD T expm1(T x) { return iabn_expm1(x); }
  static IABN_HD T log(T x) { return iabn_log(x); }
  static IABN_HD T log1p(T x) { return iabn_log1p(x); }
  static IABN_HD T sqrt(T x) { return iabn_sqrt(x); }
  static IABN_HD T max(T a, T b) { return a > b ? a : b; }
  static IABN_HD T min(T a, T b) { return a < b ? a : b; }
  // v >= 0 ? a : b
  static IABN_HD T if_nonneg(T v, T a, T b) { return v >= T(0) ? a : b; }
  // v < w ? a : b
  static IABN_HD T if_less(T v, T w, T a, T b) { return v < w ? a : b; }
  // flag != 0 ? a : b  (flag holds 0 or 1)
  static IABN_HD T if_set(T flag, T a, T b) { return flag != T(0) ? a : b; }
  static IABN_HD bool any(T flag) { return flag != T(0); }
};

// True when the policy computes in single precision (selects tolerances).
template <class M>
struct IsSingle {
  static constexpr bool value = sizeof(typename M::Scalar) <= sizeof(float);
};

// One struct per activation, specialised below:
//   forward(z, p)            -> y = f(z)
//   inverse(y, left, p)      -> z = f^-1(y); `left` is the SiLU branch bit as 0/1
//   deriv(y, z, p)           -> f'(z), using y where that is cheaper
//   inverse_deriv(y, left, p, d) -> z = f^-1(y), and d = f'(z) (one call for
//                               the backward kernels, sharing the work)
// `p` is the activation parameter (slope, alpha; unused otherwise).
template <Act A, class M>
struct Activation;

template <class M>
struct Activation<Act::Identity, M> {
  using T = typename M::T;
  static IABN_HD T forward(T z, T) { return z; }
  static IABN_HD T inverse(T y, T, T) { return y; }
  static IABN_HD T deriv(T, T, T) { return M::c(1.0); }
  static IABN_HD T inverse_deriv(T y, T, T, T& d) {
    d = M::c(1.0);
    return y;
  }
};

template <class M>
struct Activation<Act::LeakyRelu, M> {
  using T = typename M::T;
  static IABN_HD T forward(T z, T s) { return M::if_nonneg(z, z, z * s); }
  static IABN_HD T inverse(T y, T, T s) { return M::if_nonneg(y, y, y / s); }
  static IABN_HD T deriv(T y, T, T s) { return M::if_nonneg(y, M::c(1.0), s); }
  static IABN_HD T inverse_deriv(T y, T left, T s, T& d) {
    d = deriv(y, y, s);
    return inverse(y, left, s);
  }
};

template <class M>
struct Activation<Act::Elu, M> {
  using T = typename M::T;
  static IABN_HD T forward(T z, T a) {
    return M::if_nonneg(z, z, a * M::expm1(M::min(z, M::c(0.0))));
  }
  // y/a is clamped above -1 so log1p stays finite when exp(z) underflowed.
  static IABN_HD T inverse(T y, T, T a) {
    T u = M::max(y / a, M::c(-1.0) + M::c(kTiny()));
    return M::if_nonneg(y, y, M::log1p(M::min(u, M::c(0.0))));
  }
  static IABN_HD T deriv(T y, T, T a) { return M::if_nonneg(y, M::c(1.0), y + a); }
  static IABN_HD T inverse_deriv(T y, T left, T a, T& d) {
    d = deriv(y, y, a);
    return inverse(y, left, a);
  }
  static IABN_HD double kTiny() { return IsSingle<M>::value ? 1e-7 : 1e-16; }
};

// SiLU f(z) = z * sigmoid(z). Not monotone: the forward records the branch
// bit left = [z < z*] and the inverse solves on that branch.
//
// Inverse: an initial guess good to ~1e-4 absolute, then Halley steps on
// g(z) = f(z) - y (1 in single precision, 2 in double): the error after one
// step is ~ (guess error)^3, so this reaches the accuracy that the
// conditioning of the problem allows (measured: within 1.5x of
// eps |y| / |f'(z)| + ulp(z) over the whole float and double range).
// The guess, with d = sqrt(y - y*):
//  - right branch, y <= 8: z = z* + d P_R(d) (degree 8); y > 8: z = y
//    (z - y = y e^-z < 3e-3 there);
//  - left branch, y <= -0.1: z = z* + d P_L(d) (degree 8); the fits are of
//    (z - z*) / d, so the guess is exact at z* itself, where Halley's step
//    degenerates;
//  - left tail, y > -0.1: with v = -log(-y), l = log v, -z = v + P_T(l)
//    (z + log(-z) - log1p(e^z) = -v exactly); two logs, computed only when
//    some lane needs them (M::any).
// Halley's step is scale-invariant, so it is taken on g / sigmoid(z), whose
// terms stay O(1) where f underflows (z -> -inf):
//   G = z - y (1 + e^-z), G' = 1 + z (1 - s), G'' = (1 - s)(2 + z (1 - 2s)).
// Iterates are clamped to their branch and, on the left, above zmin so that
// e^-z stays finite. f'(z) for the backward reuses s = sigmoid of the last
// iterate, moved to the final z by a second-order Taylor step.
// Near z* the inverse is ill-conditioned (error ~ sqrt(2 delta / curv)) but
// f'(z) ~ 0 damps the gradient there (DESIGN.md section 3).
template <class M>
struct Activation<Act::Silu, M> {
  using T = typename M::T;
  static constexpr int kIters = IsSingle<M>::value ? 1 : 2;

  static IABN_HD T sigmoid(T z) { return M::c(1.0) / (M::c(1.0) + M::exp(M::c(0.0) - z)); }
  static IABN_HD T forward(T z, T) { return z * sigmoid(z); }
  // 1 where z is on the left branch (z < z*), else 0.
  static IABN_HD T branch(T z) { return M::if_less(z, M::c(kSiluZStar), M::c(1.0), M::c(0.0)); }

  // Lowest z the left branch returns (e^-z finite), smallest normal number.
  static IABN_HD double zmin() { return IsSingle<M>::value ? -87.0 : -700.0; }
  static IABN_HD double tiny() { return IsSingle<M>::value ? 1.1754943508222875e-38 : 2.2250738585072014e-308; }

  // Initial guess (see above); y >= y* already.
  static IABN_HD T guess(T y, T left) {
    const T d = M::sqrt(y - M::c(kSiluYStar));
    // right branch: z* + d P_R(d), d <= sqrt(8 - y*)
    T dr = M::min(d, M::c(2.8772320974785948));
    T pr = M::fma(dr, M::c(-0.0043686086494414723), M::c(0.062003737048004402));
    pr = M::fma(dr, pr, M::c(-0.36262603785051117));
    pr = M::fma(dr, pr, M::c(1.1115199507157363));
    pr = M::fma(dr, pr, M::c(-1.9551651604062918));
    pr = M::fma(dr, pr, M::c(2.3944104373567097));
    pr = M::fma(dr, pr, M::c(-2.0065284169598572));
    pr = M::fma(dr, pr, M::c(3.0292001880235917));
    T zr = M::fma(dr, pr, M::c(kSiluZStar));
    zr = M::if_less(M::c(8.0), y, y, zr);
    // left branch: z* + d P_L(d), d <= sqrt(-0.1 - y*)
    T dl = M::min(d, M::c(0.4224506394374067));
    T pl = M::fma(dl, M::c(-2456.5751156132851), M::c(2846.9829655336471));
    pl = M::fma(dl, pl, M::c(-1371.8111195864028));
    pl = M::fma(dl, pl, M::c(319.24391719304128));
    pl = M::fma(dl, pl, M::c(-44.01896125413203));
    pl = M::fma(dl, pl, M::c(-0.55674147407820462));
    pl = M::fma(dl, pl, M::c(-2.1119491106932879));
    pl = M::fma(dl, pl, M::c(-3.0300407982908322));
    T zl = M::fma(dl, pl, M::c(kSiluZStar));
    T z = M::if_set(left, zl, zr);
    // left tail
    T tail = M::if_set(left, M::if_less(M::c(-0.1), y, M::c(1.0), M::c(0.0)), M::c(0.0));
    if (M::any(tail)) {
      T v = M::c(0.0) - M::log(M::max(M::c(0.0) - y, M::c(tiny())));
      // l - l_c, l in [log(-log(0.1)), log(745)], l_c the middle
      T l = M::log(M::max(v, M::c(2.302585092994046))) - M::c(3.7237083318137576);
      l = M::min(l, M::c(2.889675886565802));
      T pt = M::fma(l, M::c(-1.4676309751270514e-05), M::c(5.055591860745925e-05));
      pt = M::fma(l, pt, M::c(8.1898479707041648e-05));
      pt = M::fma(l, pt, M::c(-0.0002393719920013013));
      pt = M::fma(l, pt, M::c(-0.00040097981410288264));
      pt = M::fma(l, pt, M::c(-0.0019697637817100858));
      pt = M::fma(l, pt, M::c(0.0201733419042236));
      pt = M::fma(l, pt, M::c(0.93583540482163208));
      pt = M::fma(l, pt, M::c(3.8116962991303072));
      z = M::if_set(tail, M::c(0.0) - (v + pt), z);
    }
    return M::if_set(left, M::max(z, M::c(zmin())), z);
  }

  // z = f^-1(y) on the branch `left` (0/1) and d = f'(z).
  static IABN_HD T inverse_deriv(T y_in, T left, T, T& dfdz, int iters = kIters) {
    const T one = M::c(1.0);
    const T zs = M::c(kSiluZStar);
    T y = M::max(y_in, M::c(kSiluYStar));
    T z = guess(y, left);
    T s = M::c(0.5), oms = M::c(0.5), step = M::c(0.0);
    for (int i = 0; i < iters; ++i) {
      T e = M::exp(M::c(0.0) - z);
      T q = one + e;
      s = one / q;
      oms = e * s;  // 1 - s, accurate when s -> 1
      T g = M::fma(M::c(0.0) - y, q, z);
      T gp = M::fma(z, oms, one);
      T gpp = oms * M::fma(z, M::fma(M::c(-2.0), s, one), M::c(2.0));
      T den = M::fma(M::c(-0.5) * g, gpp, gp * gp);
      // den vanishes only at z* itself, where the guess is exact (g = 0).
      den = M::if_less(M::max(den, M::c(0.0) - den), M::c(tiny()), M::c(tiny()), den);
      T zn = z - g * gp / den;
      zn = M::if_set(left, M::max(M::min(zn, zs), M::c(zmin())), M::max(zn, zs));
      step = zn - z;
      z = zn;
    }
    // sigmoid(z + step) = s + s(1-s) step (1 + (1 - 2s) step / 2) + O(step^3)
    T ds = s * oms * step * M::fma(M::c(0.5) * step, M::fma(M::c(-2.0), s, one), one);
    T s1 = s + ds;
    T oms1 = oms - ds;
    dfdz = s1 * M::fma(z, oms1, one);
    return z;
  }
  static IABN_HD T inverse(T y, T left, T p, int iters = kIters) {
    T d;
    return inverse_deriv(y, left, p, d, iters);
  }
  // f'(z) = s (1 + z (1 - s))
  static IABN_HD T deriv(T, T z, T) {
    T s = sigmoid(z);
    return s * (M::c(1.0) + z * (M::c(1.0) - s));
  }
};

// Per-channel affine coefficients shared by every kernel.
//   g~ = |gamma| + eps            (abs mode)
//   g~ = sign(gamma)(|gamma|+eps) (signed mode, sign(0) = +1)
template <typename T>
IABN_HD T effective_weight(T gamma, T eps, bool signed_mode) {
  T a = (gamma < T(0) ? -gamma : gamma) + eps;
  return (signed_mode && gamma < T(0)) ? -a : a;
}
// d g~ / d gamma: 1 in signed mode; sign(gamma) in abs mode, 0 at gamma = 0
// as torch.abs gives (what the original implementation's autograd computed).
template <typename T>
IABN_HD T effective_weight_grad(T gamma, bool signed_mode) {
  return signed_mode ? T(1) : (gamma < T(0) ? T(-1) : (gamma > T(0) ? T(1) : T(0)));
}

}  // namespace inplace_abn
