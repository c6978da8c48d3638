// CUDA kernels of In-Place ABN (DESIGN.md sections 1-3, 6).
//
// Device code only: no ATen, so that the same text also compiles on the host
// under the CPU emulator in src/cuda/emu (which maps the CUDA built-ins used
// here: threadIdx & co., __syncthreads, __shfl_*_sync, __ballot_sync).
//
// Index conventions
//   numel       elements of x, addressed by their MEMORY position e (the tensor
//               is contiguous or channels-last, so memory is dense);
//   inner       S for contiguous (N, C, S) tensors, 1 for channels-last
//               (N, S, C) ones: the channel of position e is (e / inner) % C;
//   K           elements per thread and step: 16 / sizeof(scalar_t) when the
//               pointers are 16-byte aligned (one vector load), else 1.
// All element-wise math comes from activations.h through
// Activation<A, ScalarMath<acc_t>>; A is a template parameter.
#pragma once

#if !defined(__CUDACC__) && !defined(IABN_EMULATE)
#error "kernels.cuh needs nvcc (or the CPU emulator, src/cuda/emu)"
#endif

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "activations.h"

namespace inplace_abn {
namespace gpu {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kEwThreads = 256;   // element-wise kernels (1D blocks)
constexpr int kRedThreads = 512;  // reduction kernels (1D contiguous, 2D channels-last)
constexpr int kFinThreads = 256;  // finalize kernels: one warp per channel

// ---------------------------------------------------------------------------
// Loads and stores of K consecutive elements.

template <typename T, int K>
struct alignas(sizeof(T) * K) Pack {
  T v[K];
};

// `full`: all K elements exist (the pointer is then K-element aligned, which
// the host checked for the base pointers); else only the first `remain`.
template <int K, typename T>
__device__ __forceinline__ void load_k(const T* p, T (&v)[K], bool full, int64_t remain) {
  if (full) {
    const Pack<T, K> pk = *reinterpret_cast<const Pack<T, K>*>(p);
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = pk.v[j];
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = j < remain ? p[j] : T(0.0f);
  }
}

template <int K, typename T>
__device__ __forceinline__ void store_k(T* p, const T (&v)[K], bool full, int64_t remain) {
  if (full) {
    Pack<T, K> pk;
#pragma unroll
    for (int j = 0; j < K; ++j) pk.v[j] = v[j];
    *reinterpret_cast<Pack<T, K>*>(p) = pk;
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (j < remain) p[j] = v[j];
  }
}

template <typename acc_t, typename T>
__device__ __forceinline__ acc_t to_acc(T v) {
  return static_cast<acc_t>(v);
}

// xhat = (z - residual - beta) / g~, with 1/g~ precomputed per channel.
template <typename acc_t>
__device__ __forceinline__ acc_t xhat_of(acc_t z, acc_t r, acc_t beta, acc_t invg) {
  return (z - r - beta) * invg;
}

// ---------------------------------------------------------------------------
// Channel of a memory position, tracked incrementally (no division per step).

struct ChanCursor {
  int64_t s;  // position inside the run of `inner` elements of one channel
  int64_t c;  // channel
  __device__ __forceinline__ void init(int64_t e, int64_t inner, int64_t C) {
    const int64_t q = e / inner;
    s = e - q * inner;
    c = q % C;
  }
  // e -> e + 1
  __device__ __forceinline__ void next(int64_t inner, int64_t C) {
    if (++s == inner) {
      s = 0;
      if (++c == C) c = 0;
    }
  }
  // e -> e + D, with rs = D % inner and dcq = (D / inner) % C.
  __device__ __forceinline__ void jump(int64_t rs, int64_t dcq, int64_t inner, int64_t C) {
    s += rs;
    int64_t carry = 0;
    if (s >= inner) {
      s -= inner;
      carry = 1;
    }
    c += dcq + carry;  // < 2C
    if (c >= C) c -= C;
  }
};

// ---------------------------------------------------------------------------
// Per-channel parameters in whatever float dtype they come in (AMP: bf16 x with
// float32 statistics), read once per channel by coef_kernel.

enum ParamKind : int { kParamNone = 0, kParamF32 = 1, kParamF64 = 2, kParamF16 = 3, kParamBF16 = 4 };

struct ChanParam {
  const void* ptr;
  int64_t stride;
  int kind;
};

template <typename acc_t>
__device__ __forceinline__ acc_t load_param(const ChanParam& p, int64_t c, acc_t dflt) {
  const int64_t i = c * p.stride;
  switch (p.kind) {
    case kParamF32:
      return static_cast<acc_t>(static_cast<const float*>(p.ptr)[i]);
    case kParamF64:
      return static_cast<acc_t>(static_cast<const double*>(p.ptr)[i]);
    case kParamF16:
      return static_cast<acc_t>(static_cast<float>(static_cast<const c10::Half*>(p.ptr)[i]));
    case kParamBF16:
      return static_cast<acc_t>(static_cast<float>(static_cast<const c10::BFloat16*>(p.ptr)[i]));
    default:
      return dflt;
  }
}

// Rows of the per-channel coefficient table written by coef_kernel (row r of
// channel c at coef[r * C + c]).
enum CoefMode : int { kCoefForward = 0, kCoefReduce = 1, kCoefInput = 2 };
// forward:         mean, scale = g~ r, beta
constexpr int kFwdMean = 0, kFwdScale = 1, kFwdBeta = 2, kFwdRows = 3;
// backward_reduce: 1/g~, beta
constexpr int kRedInvG = 0, kRedBeta = 1, kRedRows = 2;
// backward_input:  scale = g~ r, beta, 1/g~, mean_gz, mean_gz_xhat
constexpr int kInScale = 0, kInBeta = 1, kInInvG = 2, kInMg = 3, kInMgx = 4, kInRows = 5;

// g~ of a channel: effective_weight(gamma) with a weight, 1 without one (as the
// original mapillary kernels: a non-affine layer normalises to xhat).
template <typename acc_t>
__device__ __forceinline__ acc_t channel_gain(const ChanParam& w, int64_t c, acc_t eps, bool signed_mode) {
  return w.kind == kParamNone ? acc_t(1) : effective_weight<acc_t>(load_param<acc_t>(w, c, acc_t(1)), eps, signed_mode);
}

template <typename acc_t>
__global__ void __launch_bounds__(kEwThreads)
    coef_kernel(int mode, int64_t C, ChanParam mean, ChanParam var, ChanParam weight, ChanParam bias, ChanParam mg,
                ChanParam mgx, acc_t eps, bool signed_mode, acc_t* __restrict__ coef) {
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < C; c += (int64_t)gridDim.x * blockDim.x) {
    const acc_t g = channel_gain<acc_t>(weight, c, eps, signed_mode);
    const acc_t beta = load_param<acc_t>(bias, c, acc_t(0));
    if (mode == kCoefForward) {
      const acc_t r = acc_t(1) / ScalarMath<acc_t>::sqrt(load_param<acc_t>(var, c, acc_t(0)) + eps);
      coef[kFwdMean * C + c] = load_param<acc_t>(mean, c, acc_t(0));
      coef[kFwdScale * C + c] = g * r;
      coef[kFwdBeta * C + c] = beta;
    } else if (mode == kCoefReduce) {
      coef[kRedInvG * C + c] = acc_t(1) / g;
      coef[kRedBeta * C + c] = beta;
    } else {
      const acc_t r = acc_t(1) / ScalarMath<acc_t>::sqrt(load_param<acc_t>(var, c, acc_t(0)) + eps);
      coef[kInScale * C + c] = g * r;
      coef[kInBeta * C + c] = beta;
      coef[kInInvG * C + c] = acc_t(1) / g;
      coef[kInMg * C + c] = load_param<acc_t>(mg, c, acc_t(0));
      coef[kInMgx * C + c] = load_param<acc_t>(mgx, c, acc_t(0));
    }
  }
}

// ---------------------------------------------------------------------------
// Packed SiLU branch mask: bit (e % 32) of word e / 32.

// The warp's lanes hold K consecutive elements each, lane l at warp_first + l*K
// with warp_first a multiple of 32*K, so the warp covers K whole words; `bits`
// holds the lane's K bits (bit j for element j). Every lane of the warp must
// call this (full-mask warp intrinsics). `e` is the lane's first element.
template <int K>
__device__ __forceinline__ void write_mask_words(uint32_t* __restrict__ mask, uint32_t bits, int lane, int64_t e,
                                                 int64_t numel) {
  if constexpr (K == 1) {
    const uint32_t w = __ballot_sync(kFullMask, bits != 0u);
    if (lane == 0 && e < numel) mask[e >> 5] = w;
  } else {
    // Groups of G = 32 / K lanes fill one word: lane l contributes bits
    // K*(l % G) .. K*(l % G) + K - 1; an OR butterfly inside the group
    // (xor offsets < G stay inside aligned groups) assembles it.
    constexpr int G = 32 / K;
    uint32_t w = bits << (K * (lane % G));
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) w |= __shfl_xor_sync(kFullMask, w, off);
    if (lane % G == 0 && e < numel) mask[e >> 5] = w;
  }
}

// ---------------------------------------------------------------------------
// forward_: y = f((x - mean) * g~ r + beta [+ residual]) written into x.

template <typename scalar_t, typename acc_t, Act A, int K>
__global__ void __launch_bounds__(kEwThreads)
    forward_kernel(scalar_t* x, const scalar_t* __restrict__ res, uint32_t* __restrict__ mask,
                   const acc_t* __restrict__ coef, acc_t param, int64_t numel, int64_t inner, int64_t C) {
  using Fn = Activation<A, ScalarMath<acc_t>>;
  const acc_t* __restrict__ c_mean = coef + kFwdMean * C;
  const acc_t* __restrict__ c_scale = coef + kFwdScale * C;
  const acc_t* __restrict__ c_beta = coef + kFwdBeta * C;

  const int lane = threadIdx.x & 31;
  const int64_t nvec = (numel + K - 1) / K;
  const int64_t vstride = (int64_t)gridDim.x * blockDim.x;
  const int64_t estride = vstride * K;
  const int64_t rs = estride % inner, dcq = (estride / inner) % C;
  int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  ChanCursor cur;
  cur.init(v * K, inner, C);
  // The loop condition is uniform over the warp (vb: the warp's first vector),
  // so that every lane reaches the mask's warp intrinsics.
  for (int64_t vb = v - lane; vb < nvec; vb += vstride, v += vstride) {
    const int64_t e = v * K;
    uint32_t bits = 0;
    if (v < nvec) {
      const bool full = e + K <= numel;
      const int64_t remain = numel - e;
      scalar_t xv[K], rv[K];
      load_k<K>(x + e, xv, full, remain);
      if (res != nullptr) load_k<K>(res + e, rv, full, remain);
      ChanCursor cc = cur;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const int64_t c = cc.c;
        acc_t z = (to_acc<acc_t>(xv[j]) - c_mean[c]) * c_scale[c] + c_beta[c];
        if (res != nullptr) z += to_acc<acc_t>(rv[j]);
        xv[j] = static_cast<scalar_t>(Fn::forward(z, param));
        if constexpr (A == Act::Silu) {
          if (j < remain && Fn::branch(z) != acc_t(0)) bits |= 1u << j;
        }
        cc.next(inner, C);
      }
      store_k<K>(x + e, xv, full, remain);
    }
    if constexpr (A == Act::Silu) write_mask_words<K>(mask, bits, lane, e, numel);
    cur.jump(rs, dcq, inner, C);
  }
}

// ---------------------------------------------------------------------------
// backward_input: dx = g~ r (gz - mean_gz - xhat mean_gz_xhat) [, dres = gz].

template <typename scalar_t, typename acc_t, Act A, int K>
__global__ void __launch_bounds__(kEwThreads)
    backward_input_kernel(const scalar_t* __restrict__ y, const scalar_t* __restrict__ dy,
                          const scalar_t* __restrict__ res, const uint32_t* __restrict__ mask,
                          const acc_t* __restrict__ coef, acc_t param, int64_t numel, int64_t inner, int64_t C,
                          scalar_t* __restrict__ dx, scalar_t* __restrict__ dres) {
  using Fn = Activation<A, ScalarMath<acc_t>>;
  const acc_t* __restrict__ c_scale = coef + kInScale * C;
  const acc_t* __restrict__ c_beta = coef + kInBeta * C;
  const acc_t* __restrict__ c_invg = coef + kInInvG * C;
  const acc_t* __restrict__ c_mg = coef + kInMg * C;
  const acc_t* __restrict__ c_mgx = coef + kInMgx * C;

  const int64_t nvec = (numel + K - 1) / K;
  const int64_t vstride = (int64_t)gridDim.x * blockDim.x;
  const int64_t estride = vstride * K;
  const int64_t rs = estride % inner, dcq = (estride / inner) % C;
  int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  ChanCursor cur;
  cur.init(v * K, inner, C);
  for (; v < nvec; v += vstride) {
    const int64_t e = v * K;
    const bool full = e + K <= numel;
    const int64_t remain = numel - e;
    scalar_t yv[K], dyv[K], rv[K], dxv[K], gv[K];
    load_k<K>(y + e, yv, full, remain);
    load_k<K>(dy + e, dyv, full, remain);
    if (res != nullptr) load_k<K>(res + e, rv, full, remain);
    // e is a multiple of K, K divides 32: the K bits lie in one word.
    const uint32_t bits = A == Act::Silu ? (mask[e >> 5] >> (e & 31)) : 0u;
    ChanCursor cc = cur;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t c = cc.c;
      const acc_t yj = to_acc<acc_t>(yv[j]);
      const acc_t z = Fn::inverse(yj, acc_t((bits >> j) & 1u), param);
      const acc_t gz = to_acc<acc_t>(dyv[j]) * Fn::deriv(yj, z, param);
      const acc_t rj = res != nullptr ? to_acc<acc_t>(rv[j]) : acc_t(0);
      const acc_t xhat = xhat_of<acc_t>(z, rj, c_beta[c], c_invg[c]);
      dxv[j] = static_cast<scalar_t>(c_scale[c] * (gz - c_mg[c] - xhat * c_mgx[c]));
      gv[j] = static_cast<scalar_t>(gz);
      cc.next(inner, C);
    }
    store_k<K>(dx + e, dxv, full, remain);
    if (dres != nullptr) store_k<K>(dres + e, gv, full, remain);
    cur.jump(rs, dcq, inner, C);
  }
}

// ---------------------------------------------------------------------------
// Reductions: values combined by an Op (deterministic trees, fixed order).

template <typename acc_t, typename cnt_t>
struct Welford {
  acc_t mean;
  acc_t m2;
  cnt_t n;
};

// Chan et al.'s parallel combination of (count, mean, M2).
template <typename acc_t, typename cnt_t>
struct WelfordOp {
  using V = Welford<acc_t, cnt_t>;
  static __device__ __forceinline__ V identity() { return V{acc_t(0), acc_t(0), cnt_t(0)}; }
  static __device__ __forceinline__ V combine(const V& a, const V& b) {
    const cnt_t n = a.n + b.n;
    if (n == cnt_t(0)) return identity();
    const acc_t wb = static_cast<acc_t>(b.n) / static_cast<acc_t>(n);
    const acc_t delta = b.mean - a.mean;
    return V{a.mean + delta * wb, a.m2 + b.m2 + delta * delta * static_cast<acc_t>(a.n) * wb, n};
  }
  static __device__ __forceinline__ V shfl_down(const V& v, int off) {
    return V{__shfl_down_sync(kFullMask, v.mean, off), __shfl_down_sync(kFullMask, v.m2, off),
             __shfl_down_sync(kFullMask, v.n, off)};
  }
};

template <typename acc_t>
struct Pair {
  acc_t a;
  acc_t b;
};

template <typename acc_t>
struct SumOp {
  using V = Pair<acc_t>;
  static __device__ __forceinline__ V identity() { return V{acc_t(0), acc_t(0)}; }
  static __device__ __forceinline__ V combine(const V& x, const V& y) { return V{x.a + y.a, x.b + y.b}; }
  static __device__ __forceinline__ V shfl_down(const V& v, int off) {
    return V{__shfl_down_sync(kFullMask, v.a, off), __shfl_down_sync(kFullMask, v.b, off)};
  }
};

// Lane 0 gets the combination of the warp's 32 values, in a fixed order.
template <class Op>
__device__ __forceinline__ typename Op::V warp_reduce(typename Op::V v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = Op::combine(v, Op::shfl_down(v, off));
  return v;
}

// 1D block (multiple of 32 threads, at most 1024): thread 0 gets the result.
// smem: 32 entries. Safe to call repeatedly (syncs before reusing smem).
template <class Op>
__device__ __forceinline__ typename Op::V block_reduce_1d(typename Op::V v, typename Op::V* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = warp_reduce<Op>(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? smem[lane] : Op::identity();
    v = warp_reduce<Op>(v);
  }
  return v;
}

// 2D block (BX, BY), BY a power of two: reduces over threadIdx.y; every
// thread gets the result of its column. buf: BX * BY entries.
template <class Op>
__device__ __forceinline__ typename Op::V block_reduce_y(typename Op::V v, typename Op::V* buf) {
  const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x;
  __syncthreads();
  buf[ty * bx + tx] = v;
  __syncthreads();
  for (int off = blockDim.y >> 1; off > 0; off >>= 1) {
    if (ty < off) buf[ty * bx + tx] = Op::combine(buf[ty * bx + tx], buf[(ty + off) * bx + tx]);
    __syncthreads();
  }
  return buf[tx];
}

// Partial results: F rows of (nchunks, C) values, part[(f * nchunks + chunk) * C + c].

// ---------------------------------------------------------------------------
// batch_stats, contiguous (N, C, S): grid (chunks, channels); block b of
// channel c reduces vectors [b * chunk_len, (b+1) * chunk_len) of the N * S/K
// vectors of that channel (vector i: sample i / Sv, position i % Sv).
// Welford per thread (one division per K elements), then Chan's combination.

template <typename scalar_t, typename acc_t, int K>
__global__ void __launch_bounds__(kRedThreads)
    stats_contig_kernel(const scalar_t* __restrict__ x, int64_t N, int64_t C, int64_t S, int64_t chunk_len,
                        int64_t nchunks, acc_t* __restrict__ part) {
  using Op = WelfordOp<acc_t, acc_t>;
  __shared__ typename Op::V smem[32];
  const int64_t Sv = S / K;
  const int64_t total = N * Sv;
  const int64_t stride = blockDim.x;
  const int64_t dn = stride / Sv, ds = stride % Sv;
  const int64_t begin = (int64_t)blockIdx.x * chunk_len;
  const int64_t end = begin + chunk_len < total ? begin + chunk_len : total;
  const int64_t i0 = begin + threadIdx.x;
  const int64_t n0 = i0 / Sv, s0 = i0 - n0 * Sv;
  for (int64_t c = blockIdx.y; c < C; c += gridDim.y) {
    acc_t mean = 0, m2 = 0;
    int cnt = 0;
    int64_t n = n0, s = s0;
    for (int64_t i = i0; i < end; i += stride) {
      scalar_t xv[K];
      load_k<K>(x + ((n * C + c) * Sv + s) * K, xv, true, K);
      if constexpr (K == 1) {
        const acc_t xj = to_acc<acc_t>(xv[0]);
        ++cnt;
        const acc_t d = xj - mean;
        mean += d / static_cast<acc_t>(cnt);
        m2 += d * (xj - mean);
      } else {
        // Merge the K values (local mean and M2) into the running triple.
        acc_t xs[K];
        acc_t lsum = 0;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          xs[j] = to_acc<acc_t>(xv[j]);
          lsum += xs[j];
        }
        const acc_t lmean = lsum * (acc_t(1) / acc_t(K));
        acc_t lm2 = 0;
#pragma unroll
        for (int j = 0; j < K; ++j) lm2 += (xs[j] - lmean) * (xs[j] - lmean);
        cnt += K;
        const acc_t d = lmean - mean;
        mean += d * (acc_t(K) / static_cast<acc_t>(cnt));
        m2 += lm2 + d * (lmean - mean) * acc_t(K);
      }
      s += ds;
      n += dn;
      if (s >= Sv) {
        s -= Sv;
        ++n;
      }
    }
    typename Op::V r = block_reduce_1d<Op>(typename Op::V{mean, m2, static_cast<acc_t>(cnt)}, smem);
    if (threadIdx.x == 0) {
      part[(0 * nchunks + blockIdx.x) * C + c] = r.mean;
      part[(1 * nchunks + blockIdx.x) * C + c] = r.m2;
      part[(2 * nchunks + blockIdx.x) * C + c] = r.n;
    }
  }
}

// batch_stats, channels-last (N*S rows of C): grid (channel tiles, row chunks),
// block (BX, BY): thread (tx, ty) owns channels [cv*K, cv*K + K) of the tile
// and rows r0 + ty, r0 + ty + BY, ... of the chunk; then a tree over ty.
template <typename scalar_t, typename acc_t, int K>
__global__ void __launch_bounds__(kRedThreads)
    stats_cl_kernel(const scalar_t* __restrict__ x, int64_t M, int64_t C, int64_t rows_per_chunk, int64_t nchunks,
                    acc_t* __restrict__ part) {
  using Op = WelfordOp<acc_t, acc_t>;
  __shared__ typename Op::V buf[kRedThreads];
  const int64_t Cv = C / K;
  const int64_t cv = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < M ? r0 + rows_per_chunk : M;
  acc_t mean[K], m2[K];
#pragma unroll
  for (int j = 0; j < K; ++j) mean[j] = m2[j] = acc_t(0);
  int cnt = 0;
  if (cv < Cv) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
      scalar_t xv[K];
      load_k<K>(x + r * C + cv * K, xv, true, K);
      ++cnt;
      const acc_t inv = acc_t(1) / static_cast<acc_t>(cnt);
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const acc_t xj = to_acc<acc_t>(xv[j]);
        const acc_t d = xj - mean[j];
        mean[j] += d * inv;
        m2[j] += d * (xj - mean[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < K; ++j) {
    typename Op::V r = block_reduce_y<Op>(typename Op::V{mean[j], m2[j], static_cast<acc_t>(cnt)}, buf);
    if (threadIdx.y == 0 && cv < Cv) {
      const int64_t c = cv * K + j;
      part[(0 * nchunks + blockIdx.y) * C + c] = r.mean;
      part[(1 * nchunks + blockIdx.y) * C + c] = r.m2;
      part[(2 * nchunks + blockIdx.y) * C + c] = r.n;
    }
  }
}

// ---------------------------------------------------------------------------
// backward_reduce: S_g = sum gz, S_gx = sum gz xhat per channel, from y alone.

template <typename acc_t, Act A>
struct GradTerms {
  // Accumulates gz and gz * xhat of one element into (sg, sgx).
  static __device__ __forceinline__ void add(acc_t y, acc_t dy, acc_t r, uint32_t bit, acc_t beta, acc_t invg,
                                             acc_t param, acc_t& sg, acc_t& sgx) {
    using Fn = Activation<A, ScalarMath<acc_t>>;
    const acc_t z = Fn::inverse(y, acc_t(bit), param);
    const acc_t gz = dy * Fn::deriv(y, z, param);
    const acc_t xhat = xhat_of<acc_t>(z, r, beta, invg);
    sg += gz;
    sgx += gz * xhat;
  }
};

template <typename scalar_t, typename acc_t, Act A, int K>
__global__ void __launch_bounds__(kRedThreads)
    bwd_reduce_contig_kernel(const scalar_t* __restrict__ y, const scalar_t* __restrict__ dy,
                             const scalar_t* __restrict__ res, const uint32_t* __restrict__ mask,
                             const acc_t* __restrict__ coef, acc_t param, int64_t N, int64_t C, int64_t S,
                             int64_t chunk_len, int64_t nchunks, acc_t* __restrict__ part) {
  using Op = SumOp<acc_t>;
  __shared__ typename Op::V smem[32];
  const int64_t Sv = S / K;
  const int64_t total = N * Sv;
  const int64_t stride = blockDim.x;
  const int64_t dn = stride / Sv, ds = stride % Sv;
  const int64_t begin = (int64_t)blockIdx.x * chunk_len;
  const int64_t end = begin + chunk_len < total ? begin + chunk_len : total;
  const int64_t i0 = begin + threadIdx.x;
  const int64_t n0 = i0 / Sv, s0 = i0 - n0 * Sv;
  for (int64_t c = blockIdx.y; c < C; c += gridDim.y) {
    const acc_t invg = coef[kRedInvG * C + c];
    const acc_t beta = coef[kRedBeta * C + c];
    acc_t sg = 0, sgx = 0;
    int64_t n = n0, s = s0;
    for (int64_t i = i0; i < end; i += stride) {
      const int64_t e = ((n * C + c) * Sv + s) * K;
      scalar_t yv[K], dyv[K], rv[K];
      load_k<K>(y + e, yv, true, K);
      load_k<K>(dy + e, dyv, true, K);
      if (res != nullptr) load_k<K>(res + e, rv, true, K);
      const uint32_t bits = A == Act::Silu ? (mask[e >> 5] >> (e & 31)) : 0u;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const acc_t rj = res != nullptr ? to_acc<acc_t>(rv[j]) : acc_t(0);
        GradTerms<acc_t, A>::add(to_acc<acc_t>(yv[j]), to_acc<acc_t>(dyv[j]), rj, (bits >> j) & 1u, beta, invg,
                                 param, sg, sgx);
      }
      s += ds;
      n += dn;
      if (s >= Sv) {
        s -= Sv;
        ++n;
      }
    }
    typename Op::V r = block_reduce_1d<Op>(typename Op::V{sg, sgx}, smem);
    if (threadIdx.x == 0) {
      part[(0 * nchunks + blockIdx.x) * C + c] = r.a;
      part[(1 * nchunks + blockIdx.x) * C + c] = r.b;
    }
  }
}

template <typename scalar_t, typename acc_t, Act A, int K>
__global__ void __launch_bounds__(kRedThreads)
    bwd_reduce_cl_kernel(const scalar_t* __restrict__ y, const scalar_t* __restrict__ dy,
                         const scalar_t* __restrict__ res, const uint32_t* __restrict__ mask,
                         const acc_t* __restrict__ coef, acc_t param, int64_t M, int64_t C, int64_t rows_per_chunk,
                         int64_t nchunks, acc_t* __restrict__ part) {
  using Op = SumOp<acc_t>;
  __shared__ typename Op::V buf[kRedThreads];
  const int64_t Cv = C / K;
  const int64_t cv = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < M ? r0 + rows_per_chunk : M;
  acc_t sg[K], sgx[K], invg[K], beta[K];
#pragma unroll
  for (int j = 0; j < K; ++j) sg[j] = sgx[j] = invg[j] = beta[j] = acc_t(0);
  if (cv < Cv) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      invg[j] = coef[kRedInvG * C + cv * K + j];
      beta[j] = coef[kRedBeta * C + cv * K + j];
    }
    for (int64_t r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
      const int64_t e = r * C + cv * K;
      scalar_t yv[K], dyv[K], rv[K];
      load_k<K>(y + e, yv, true, K);
      load_k<K>(dy + e, dyv, true, K);
      if (res != nullptr) load_k<K>(res + e, rv, true, K);
      const uint32_t bits = A == Act::Silu ? (mask[e >> 5] >> (e & 31)) : 0u;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const acc_t rj = res != nullptr ? to_acc<acc_t>(rv[j]) : acc_t(0);
        GradTerms<acc_t, A>::add(to_acc<acc_t>(yv[j]), to_acc<acc_t>(dyv[j]), rj, (bits >> j) & 1u, beta[j],
                                 invg[j], param, sg[j], sgx[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < K; ++j) {
    typename Op::V r = block_reduce_y<Op>(typename Op::V{sg[j], sgx[j]}, buf);
    if (threadIdx.y == 0 && cv < Cv) {
      const int64_t c = cv * K + j;
      part[(0 * nchunks + blockIdx.y) * C + c] = r.a;
      part[(1 * nchunks + blockIdx.y) * C + c] = r.b;
    }
  }
}

// ---------------------------------------------------------------------------
// Finalize: one warp per channel combines the nchunks partials in a fixed
// order (lane l takes chunks l, l + 32, ... in turn, then a warp tree).

template <typename acc_t>
__global__ void __launch_bounds__(kFinThreads)
    finalize_stats_kernel(const acc_t* __restrict__ part, int64_t nchunks, int64_t C, acc_t* __restrict__ mean,
                          acc_t* __restrict__ var) {
  using Op = WelfordOp<acc_t, int64_t>;
  const int lane = threadIdx.x & 31;
  const int64_t c = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;  // whole warps
  typename Op::V v = Op::identity();
  for (int64_t j = lane; j < nchunks; j += 32) {
    const typename Op::V p{part[(0 * nchunks + j) * C + c], part[(1 * nchunks + j) * C + c],
                           static_cast<int64_t>(part[(2 * nchunks + j) * C + c])};
    v = Op::combine(v, p);
  }
  v = warp_reduce<Op>(v);
  if (lane == 0) {
    const bool any = v.n > 0;
    mean[c] = any ? v.mean : acc_t(0);
    const acc_t vr = any ? v.m2 / static_cast<acc_t>(v.n) : acc_t(0);
    var[c] = vr > acc_t(0) ? vr : acc_t(0);
  }
}

template <typename acc_t>
__global__ void __launch_bounds__(kFinThreads)
    finalize_sums_kernel(const acc_t* __restrict__ part, int64_t nchunks, int64_t C, acc_t* __restrict__ out_a,
                         acc_t* __restrict__ out_b) {
  using Op = SumOp<acc_t>;
  const int lane = threadIdx.x & 31;
  const int64_t c = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;  // whole warps
  typename Op::V v = Op::identity();
  for (int64_t j = lane; j < nchunks; j += 32)
    v = Op::combine(v, typename Op::V{part[(0 * nchunks + j) * C + c], part[(1 * nchunks + j) * C + c]});
  v = warp_reduce<Op>(v);
  if (lane == 0) {
    out_a[c] = v.a;
    out_b[c] = v.b;
  }
}

}  // namespace gpu
}  // namespace inplace_abn
