// Element-wise activation math of In-Place ABN: forward f(z), inverse f^-1(y) and derivative f'(z) recovered
// from the output (docs/DESIGN.md section 3). The single source of truth for these formulas, generic over a math
// policy M supplying the arithmetic on M::T: ScalarMath<float|double> below (CUDA kernels) and VecMath<float|double>
// over at::vec::Vectorized (CPU kernels, src/cpu/kernel_utils.h). Anything beyond + - * / goes through M, so the
// same text compiles for scalars and SIMD vectors.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define IABN_HD __host__ __device__ __forceinline__
#else
#define IABN_HD inline
#endif

// GCC calls the SiLU inverse out of line where a file's kernels call it from many places (a call per vector, the
// vectors through memory). AVX2: forced inline everywhere (backward_reduce SiLU 11.1 -> 8.6 ms; still needed with
// setup.py's larger AVX2 inlining budget: float32 SiLU layers 1.04-1.23x as long without). AVX512: the table
// inverse only, in the files that define IABN_INLINE_SILU_INVERSE before any include (the one-pass backward
// kernels: bfloat16 16x512x7x7 layer 0.87x as long); forced in the two-pass kernels too, it cost up to 9%.
#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
#define IABN_SILU_INVERSE_INLINE __attribute__((always_inline))
#define IABN_SILU_TABLE_INLINE __attribute__((always_inline))
#elif defined(CPU_CAPABILITY_AVX512) && defined(IABN_INLINE_SILU_INVERSE) && defined(__GNUC__)
#define IABN_SILU_INVERSE_INLINE
#define IABN_SILU_TABLE_INLINE __attribute__((always_inline))
#else
#define IABN_SILU_INVERSE_INLINE
#define IABN_SILU_TABLE_INLINE
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
IABN_HD bool iabn_signbit(float x) { return copysignf(1.0f, x) < 0.0f; }
IABN_HD bool iabn_signbit(double x) { return copysign(1.0, x) < 0.0; }

// A math policy M provides: the value type T, the real type Scalar (float or double: selects constants and
// iteration counts), c(v) for a constant, the functions below, fma(a, b, c) = a * b + c, rcp(x) = 1 / x, the
// selects if_nonneg / if_less / if_set / if_signbit, and any(flag): whether any lane of a 0/1 flag is set (for a
// scalar: the flag itself), to skip rarely needed work. kSiluTable: whether it provides silu_table(y, left, h)
// (AVX2/AVX512 float: the fitted SiLU inverse of section 3), which returns the 0/1 flag of the lanes outside the fit.
template <typename S>
struct ScalarMath {
  using T = S;
  using Scalar = S;
  static constexpr bool kSiluTable = false;
  static IABN_HD T c(double v) { return static_cast<T>(v); }
  static IABN_HD T fma(T a, T b, T c) { return a * b + c; }
  static IABN_HD T exp(T x) { return iabn_exp(x); }
  // e^x for x <= 87 only; below the underflow threshold it may return the smallest normal number instead of 0
  // (a vector policy skips saturation)
  static IABN_HD T exp_capped(T x) { return iabn_exp(x); }
  static IABN_HD T expm1(T x) { return iabn_expm1(x); }
  static IABN_HD T log(T x) { return iabn_log(x); }
  static IABN_HD T log1p(T x) { return iabn_log1p(x); }
  static IABN_HD T sqrt(T x) { return iabn_sqrt(x); }
  // 1 / x, to within about an ulp (a vector policy may refine a hardware estimate by a Newton step)
  static IABN_HD T rcp(T x) { return T(1) / x; }
  static IABN_HD T max(T a, T b) { return a > b ? a : b; }
  static IABN_HD T min(T a, T b) { return a < b ? a : b; }
  // v >= 0 ? a : b
  static IABN_HD T if_nonneg(T v, T a, T b) { return v >= T(0) ? a : b; }
  // sign bit of v set (v < 0 or v = -0) ? a : b
  static IABN_HD T if_signbit(T v, T a, T b) { return iabn_signbit(v) ? a : b; }
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

// One struct per activation, specialised below; `p` is the activation parameter (slope, alpha; unused otherwise):
//   forward(z, p) -> y = f(z)
//   inverse_deriv(y, left, p, d) -> z = f^-1(y), and d = f'(z) (one call for the backward kernels, sharing the
//     work); `left` is the SiLU branch flag: 0, or set (1, or all bits set where a vector policy says so: only
//     selects read it)
//   inverse(y, left, p), deriv(y, z, p): the two parts (leaky_relu, ELU)
template <Act A, class M>
struct Activation;

template <class M>
struct Activation<Act::Identity, M> {
  using T = typename M::T;
  static IABN_HD T forward(T z, T) { return z; }
  static IABN_HD T inverse_deriv(T y, T, T, T& d) {
    d = M::c(1.0);
    return y;
  }
};

// The inverses read the branch from the sign bit of y, not from y >= 0: a small negative z whose f(z) underflows
// (float16 output, s z or a (e^z - 1) below the smallest subnormal) stores -0 and keeps its branch. The derivatives
// take the left one at z = 0 (y = +0 or -0), as torch's backward does.
template <class M>
struct Activation<Act::LeakyRelu, M> {
  using T = typename M::T;
  static IABN_HD T forward(T z, T s) { return M::if_nonneg(z, z, z * s); }
  static IABN_HD T inverse(T y, T, T s) { return M::if_signbit(y, y / s, y); }
  static IABN_HD T deriv(T y, T, T s) { return M::if_less(M::c(0.0), y, M::c(1.0), s); }
  static IABN_HD T inverse_deriv(T y, T left, T s, T& d) {
    d = deriv(y, y, s);
    return inverse(y, left, s);
  }
};

template <class M>
struct Activation<Act::Elu, M> {
  using T = typename M::T;
  // expm1(z) is kept one ulp above -1, so only a half-precision store can round y onto or past -a.
  static IABN_HD T forward(T z, T a) {
    return M::if_nonneg(z, z, a * M::max(M::expm1(M::min(z, M::c(0.0))), M::c(kMinExpm1())));
  }
  // A y below the forward's least output a * kMinExpm1 (y <= -a) has no preimage: its z lies below the store's
  // saturation point (e^z < 2^-9 in bfloat16, 2^-12 in float16), which this code cannot see, so such a y is read
  // as e^z = 2^-11 (docs/DESIGN.md section 3). NaN passes through.
  static IABN_HD T unsaturate(T y, T a) {
    return M::if_less(y, a * M::c(kMinExpm1()), a * M::c(0.00048828125 - 1.0), y);
  }
  static IABN_HD T inverse(T y, T, T a) { return M::if_signbit(y, M::log1p(unsaturate(y, a) / a), y); }
  static IABN_HD T deriv(T y, T, T a) { return M::if_less(M::c(0.0), y, M::c(1.0), unsaturate(y, a) + a); }
  static IABN_HD T inverse_deriv(T y, T left, T a, T& d) {
    d = deriv(y, y, a);
    return inverse(y, left, a);
  }
  // -1 + 2^-24 (float), -1 + 2^-53 (double)
  static IABN_HD double kMinExpm1() { return IsSingle<M>::value ? -1.0 + 5.9604644775390625e-08 : -1.0 + 1.1102230246251565e-16; }
};

// SiLU f(z) = z * sigmoid(z). Not monotone: the forward records the branch bit left = [z < z*] and the inverse
// solves on that branch (docs/DESIGN.md section 3).
// Inverse: a guess good to ~1e-4 absolute, then Halley steps on g(z) = f(z) - y (1 in single precision, 2 in
// double): the error after one step is ~ (guess error)^3, so this reaches the accuracy the conditioning allows.
// Measured over z in [-87, 1000] float, [-700, 1000] double, dense in [-40, 30] and near z*: error within 1.03x of
// eps |y| / |f'(z)| + ulp(z); <= 3.2 ulp for |z - z*| > 0.5; relative <= 1.8e-13 in double for |z - z*| > 1e-3.
// The guess, with d = sqrt(y - y*):
//  - right branch, y <= 8: z = z* + d P_R(d) (degree 8); y > 8: z = y (z - y = y e^-z < 3e-3 there);
//  - left branch, y <= -0.1: z = z* + d P_L(d) (degree 8); the fits are of (z - z*) / d, so the guess is exact at
//    z* itself, where Halley's step degenerates;
//  - left tail, y > -0.1: with v = -log(-y) (z + log(-z) - log1p(e^z) = -v exactly), -z = v + P_M(v) for v <= 7
//    (z >~ -9.3), else -z = v + P_T(l), l = log v; computed only when some lane needs them (M::any).
// Halley's step is scale-invariant, so it is taken on g / sigmoid(z), whose terms stay O(1) where f underflows
// (z -> -inf): G = z - y (1 + e^-z), G' = 1 + z (1 - s), G'' = (1 - s)(2 + z (1 - 2s)).
// Within d_skip of y* the guess is kept (see halley_inverse_deriv); before another step and at the end, iterates
// are clamped above zmin so that e^-z stays finite. f'(z) for the backward reuses the last step's f'/s and f''/s:
// f'(z - dz) = f'(z) - f''(z) dz (error ~ dz^2, below the rounding error once the iteration has converged).
// Near z* the inverse is ill-conditioned (error ~ sqrt(2 delta / curv)) but f'(z) ~ 0 damps the gradient there.
// A policy with kSiluTable (AVX2/AVX512 float) instead evaluates a piecewise fit of h = 1 + e^-z = z / y in d
// (src/cpu/silu_table.h) for y <= 8 (right) and y <= -0.1 (left): z = y h, f'(z) = (h + z (h - 1)) / h^2; error
// within 5.1x eps |y| / |f'(z)| + ulp(z), at up to 1.7x the Halley path's throughput. Other lanes take that path.
template <class M>
struct Activation<Act::Silu, M> {
  using T = typename M::T;
  static constexpr int kIters = IsSingle<M>::value ? 1 : 2;

  static IABN_HD T sigmoid(T z) { return M::rcp(M::c(1.0) + M::exp(M::c(0.0) - z)); }
  static IABN_HD T forward(T z, T) { return z * sigmoid(z); }
  // 1 where z is on the left branch (z < z*), else 0.
  static IABN_HD T branch(T z) { return M::if_less(z, M::c(kSiluZStar), M::c(1.0), M::c(0.0)); }

  // Lowest z the left branch returns (e^-z finite), smallest normal number.
  static IABN_HD double zmin() { return IsSingle<M>::value ? -87.0 : -700.0; }
  static IABN_HD double tiny() { return IsSingle<M>::value ? 1.1754943508222875e-38 : 2.2250738585072014e-308; }

  // r on the right branch, l on the left
  static IABN_HD T pick(T left, double r, double l) { return M::if_set(left, M::c(l), M::c(r)); }

  // Initial guess (see above); y >= y* already.
  static IABN_HD T guess(T y, T left, T& d) {
    d = M::sqrt(y - M::c(kSiluYStar));
    // z* + d P(d) (degree 8 in d), P_R (right branch, d <= sqrt(8 - y*)) or P_L (left, d <= sqrt(-0.1 - y*)),
    // coefficients c1..c8 of P selected per lane. Estrin's scheme: the inverse is one dependency chain per vector,
    // and Horner's 8 dependent fmas were a large link of it (AVX2 SiLU reduce keeping z 7.2 -> 6.2 ms).
    T dd = M::min(d, pick(left, 2.8772320974785948, 0.4224506394374067));
    const T dd2 = dd * dd;
    const T q0 = M::fma(dd, pick(left, -2.0065284169598572, -2.1119491106932879),
                        pick(left, 3.0292001880235917, -3.0300407982908322));
    const T q1 = M::fma(dd, pick(left, -1.9551651604062918, -44.01896125413203),
                        pick(left, 2.3944104373567097, -0.55674147407820462));
    const T q2 = M::fma(dd, pick(left, -0.36262603785051117, -1371.8111195864028),
                        pick(left, 1.1115199507157363, 319.24391719304128));
    const T q3 = M::fma(dd, pick(left, -0.0043686086494414723, -2456.5751156132851),
                        pick(left, 0.062003737048004402, 2846.9829655336471));
    const T p = M::fma(dd2 * dd2, M::fma(dd2, q3, q2), M::fma(dd2, q1, q0));
    T z = M::fma(dd, p, M::c(kSiluZStar));
    // right branch, y > 8: z = y (z - y = y e^-z < 3e-3)
    z = M::if_less(M::c(8.0), y, y, z);
    // left tail, y > -0.1: v = -log(-y) in (2.3, inf)
    T tail = M::if_less(M::c(-0.1), y, left, M::c(0.0));
    if (M::any(tail)) {
      T v = M::c(0.0) - M::log(M::max(M::c(0.0) - y, M::c(tiny())));
      // v <= 7 (z >~ -9.3): -z = v + P_M(v) (degree 8)
      T u = M::min(v, M::c(7.0)) - M::c(4.6512925464970225);
      T pm = M::fma(u, M::c(-6.6388539923139274e-06), M::c(2.3622421356503015e-05));
      pm = M::fma(u, pm, M::c(-1.2901139011804238e-05));
      pm = M::fma(u, pm, M::c(9.4744024228088976e-05));
      pm = M::fma(u, pm, M::c(-0.00079536020730284172));
      pm = M::fma(u, pm, M::c(0.0036689775722755966));
      pm = M::fma(u, pm, M::c(-0.020607534197272181));
      pm = M::fma(u, pm, M::c(0.18296765133101114));
      pm = M::fma(u, pm, M::c(1.874256446353217));
      T zt = M::c(0.0) - (v + pm);
      // v > 7: -z = v + P_T(l), l = log v
      T far = M::if_less(M::c(7.0), v, tail, M::c(0.0));
      if (M::any(far)) {
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
        zt = M::if_set(far, M::c(0.0) - (v + pt), zt);
      }
      // (only the far tail can go below zmin)
      z = M::if_set(tail, M::max(zt, M::c(zmin())), z);
    }
    return z;
  }

  // f'(z) = (h + z (h - 1)) / h^2 from z and h = 1 + e^-z
  static IABN_HD T h_deriv(T z, T h) { return M::fma(z, h - M::c(1.0), h) * M::rcp(h * h); }

  // f'(z) = s (1 + z (1 - s)) from z itself (z >= zmin, as the inverse returns)
  static IABN_HD T deriv_of_z(T z) {
    T e = M::exp_capped(M::c(0.0) - z);
    T s = M::rcp(M::c(1.0) + e);
    return s * M::fma(z, e * s, M::c(1.0));
  }

  // The code of z in `kept` for lanes outside the table: -z on the right branch (z > 8, code < -1), z kLeftCode on
  // the left (-87 <= z < -1.2, code in (-1, 0)): negative, unlike h > 1, and exact both ways.
  static constexpr double kLeftCode = 1.0 / 1024;

  // z = f^-1(y) on the branch `left` (0/1) and d = f'(z); with `kept`, also what from_kept needs besides y to
  // give z and d again: h where the table applies (z = y h and d as here, bitwise), z coded (above) elsewhere.
  static IABN_HD IABN_SILU_TABLE_INLINE T inverse_deriv(T y_in, T left, T, T& dfdz, int iters = kIters,
                                                          T* kept = nullptr) {
    if constexpr (M::kSiluTable) {
      T h;
      const T y = M::max(y_in, M::c(kSiluYStar));
      const T outside = M::silu_table(y, left, h);  // a flag per lane
      const T z = y * h;
      dfdz = h_deriv(z, h);
      if (kept) *kept = h;
      if (!M::any(outside)) return z;
      T dh;
      const T zh = halley_inverse_deriv(y, left, dh, iters);
      dfdz = M::if_set(outside, dh, dfdz);
      if (kept) *kept = M::if_set(outside, M::if_set(left, zh * M::c(kLeftCode), M::c(0.0) - zh), h);
      return M::if_set(outside, zh, z);
    }
    const T z = halley_inverse_deriv(y_in, left, dfdz, iters);
    if (kept) *kept = z;
    return z;
  }

  // z and d = f'(z) from y and what inverse_deriv kept.
  static IABN_HD T from_kept(T y_in, T t, T& dfdz) {
    if constexpr (M::kSiluTable) {
      const T z = M::max(y_in, M::c(kSiluYStar)) * t;
      dfdz = h_deriv(z, t);
      const T coded = M::if_less(t, M::c(0.0), M::c(1.0), M::c(0.0));
      if (!M::any(coded)) return z;
      const T zc = M::if_less(t, M::c(-1.0), M::c(0.0) - t, t * M::c(1.0 / kLeftCode));
      dfdz = M::if_set(coded, deriv_of_z(zc), dfdz);
      return M::if_set(coded, zc, z);
    }
    dfdz = deriv_of_z(t);
    return t;
  }

  // The guess and Halley steps (all policies; see above).
  static IABN_HD IABN_SILU_INVERSE_INLINE T halley_inverse_deriv(T y_in, T left, T& dfdz, int iters) {
    const T one = M::c(1.0);
    T y = M::max(y_in, M::c(kSiluYStar));
    T d;
    T z = guess(y, left, d);
    // Within d_skip of y* (|z - z*| < ~3 d_skip) the guess is already within the conditioning error (its error is
    // ~3e-5 d) and rounding in g could make Halley's denominator vanish: no step there. Elsewhere the denominator
    // is ~(z - z*)^2 > 0 and the step stays on its branch.
    const T d_skip = M::c(IsSingle<M>::value ? 1e-2 : 1e-7);
    T s = M::c(0.5), gp = M::c(0.0), gpp = M::c(0.0), dz = M::c(0.0);
    for (int i = 0; i < iters; ++i) {
      T e = M::exp_capped(M::c(0.0) - z);  // z >= zmin: -z <= 87
      T q = one + e;
      s = M::rcp(q);
      T oms = e * s;  // 1 - s, accurate when s -> 1
      T g = z - y * q;
      gp = M::fma(z, oms, one);
      gpp = oms * M::fma(z, M::fma(M::c(-2.0), s, one), M::c(2.0));
      T den = M::fma(M::c(-0.5) * g, gpp, gp * gp);
      dz = M::if_less(d, d_skip, M::c(0.0), g * gp * M::rcp(den));
      if (i + 1 < iters) {
        // e^-z must stay finite for the next step
        T zn = M::max(z - dz, M::c(zmin()));
        dz = z - zn;
        z = zn;
      } else {
        z = M::max(z - dz, M::c(zmin()));  // deriv_of_z(z) needs e^-z finite too
      }
    }
    // f'(z - dz) = f'(z) - f''(z) dz + O(dz^2), f' = s gp, f'' = s gpp
    dfdz = s * (gp - gpp * dz);
    return z;
  }
};

}  // namespace inplace_abn
