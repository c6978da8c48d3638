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

template <typename S>
struct ScalarMath {
  using T = S;
  static IABN_HD T c(double v) { return static_cast<T>(v); }
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
};

// One struct per activation, specialised below:
//   forward(z, p)            -> y = f(z)
//   inverse(y, left, p)      -> z = f^-1(y); `left` is the SiLU branch bit as 0/1
//   deriv(y, z, p)           -> f'(z), using y where that is cheaper
// `p` is the activation parameter (slope, alpha; unused otherwise).
template <Act A, class M>
struct Activation;

template <class M>
struct Activation<Act::Identity, M> {
  using T = typename M::T;
  static IABN_HD T forward(T z, T) { return z; }
  static IABN_HD T inverse(T y, T, T) { return y; }
  static IABN_HD T deriv(T, T, T) { return M::c(1.0); }
};

template <class M>
struct Activation<Act::LeakyRelu, M> {
  using T = typename M::T;
  static IABN_HD T forward(T z, T s) { return M::if_nonneg(z, z, z * s); }
  static IABN_HD T inverse(T y, T, T s) { return M::if_nonneg(y, y, y / s); }
  static IABN_HD T deriv(T y, T, T s) { return M::if_nonneg(y, M::c(1.0), s); }
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
  static IABN_HD double kTiny() { return sizeof(typename M::T) == sizeof(float) ? 1e-7 : 1e-16; }
};

// SiLU f(z) = z * sigmoid(z). Not monotone: the forward records the branch
// bit left = [z < z*] and the inverse solves on that branch with Halley's
// method from a guess that is already close:
//  - near the minimum, the quadratic model y - y* = curv/2 (z - z*)^2;
//  - right branch, y > 0: z >= y (sigmoid <= 1);
//  - far left tail (y > -0.2): z e^z ~ y gives z ~ t - log(-t), t = log(-y),
//    and the iteration runs on h(z) = log(-f(z)) = t, which is nearly linear
//    there, instead of on f itself, whose values underflow.
// Every iterate is clamped to its branch. Near z* the inverse is
// ill-conditioned (error ~ sqrt(2 delta / curv)) but f'(z) ~ 0 damps the
// gradient there (DESIGN.md section 3).
template <class M>
struct Activation<Act::Silu, M> {
  using T = typename M::T;
  static constexpr int kIters = sizeof(T) <= sizeof(float) ? 2 : 3;

  static IABN_HD T sigmoid(T z) { return M::c(1.0) / (M::c(1.0) + M::exp(M::c(0.0) - z)); }
  static IABN_HD T forward(T z, T) { return z * sigmoid(z); }
  // 1 where z is on the left branch (z < z*), else 0.
  static IABN_HD T branch(T z) { return M::if_less(z, M::c(kSiluZStar), M::c(1.0), M::c(0.0)); }

  static IABN_HD T inverse(T y_in, T left, T, int iters = kIters) {
    const T zs = M::c(kSiluZStar);
    T y = M::max(y_in, M::c(kSiluYStar));
    T d = M::sqrt(M::max(M::c(2.0 / kSiluCurv) * (y - M::c(kSiluYStar)), M::c(0.0)));
    // log(-y) for the left tail; y >= 0 on the left branch only through
    // underflow, which the tiny floor maps to the far end.
    T t = M::log(M::max(M::c(0.0) - y, M::c(tiny())));
    T zf = t - M::log(M::max(M::c(0.0) - t, M::c(1.0)));
    T near = M::if_less(y, M::c(-0.2), M::c(1.0), M::c(0.0));
    T zl = M::if_set(near, zs - d, M::min(zs - d, zf));
    T zr = M::if_nonneg(y, M::max(zs + d, y), zs + d);
    T z = M::if_set(left, zl, zr);
    // Left tail solves in log space.
    T uselog = M::if_set(left, M::c(1.0) - near, M::c(0.0));
    for (int i = 0; i < iters; ++i) {
      T s = sigmoid(z);
      T one_s = M::c(1.0) - s;
      // f and its derivatives
      T g = z * s - y;
      T gp = s * (M::c(1.0) + z * one_s);
      T gpp = s * one_s * (M::c(2.0) + z * (M::c(1.0) - M::c(2.0) * s));
      // h = log(-z) + log(s) - t and its derivatives (z < 0 on that path)
      T zneg = M::min(z, M::c(-tiny()));
      T h = M::log(M::c(0.0) - zneg) + M::log(M::max(s, M::c(tiny()))) - t;
      T hp = M::c(1.0) / zneg + one_s;
      T hpp = M::c(0.0) - M::c(1.0) / (zneg * zneg) - s * one_s;
      g = M::if_set(uselog, h, g);
      gp = M::if_set(uselog, hp, gp);
      gpp = M::if_set(uselog, hpp, gpp);
      T den = gp * gp - M::c(0.5) * g * gpp;
      // A vanishing denominator only happens at z* itself, where the guess is exact.
      den = M::if_less(M::max(den, M::c(0.0) - den), M::c(tiny()), M::c(tiny()), den);
      z = z - g * gp / den;
      z = M::if_set(left, M::min(z, zs), M::max(z, zs));
    }
    return z;
  }
  // f'(z) = s (1 + z (1 - s))
  static IABN_HD T deriv(T, T z, T) {
    T s = sigmoid(z);
    return s * (M::c(1.0) + z * (M::c(1.0) - s));
  }
  static IABN_HD double tiny() { return sizeof(T) <= sizeof(float) ? 1e-30 : 1e-300; }
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
