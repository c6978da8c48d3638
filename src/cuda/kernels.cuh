// CUDA kernels of In-Place ABN (docs/DESIGN.md sections 1-3, 6); the launches are in src/cuda/<op>_kernel.cu.
//
// Index conventions
//   numel  elements of x, addressed by their MEMORY position e (contiguous or channels-last: memory is dense);
//   inner  S for contiguous (N, C, S) tensors, 1 for channels-last (N, S, C): the channel of e is (e / inner) % C;
//   K      elements per thread and step: 16 / sizeof(scalar_t) when the pointers are 16-byte aligned (one vector
//          load), else 1.
// All element-wise math is activations.h's Activation<A, ScalarMath<acc_t>>, A a template parameter.
#pragma once

#include <cstdint>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "activations.h"
#include "ops/kernel.h"  // the coefficient table's rows

namespace inplace_abn {
namespace gpu {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kEwThreads = 256;   // element-wise kernels (1D blocks)
constexpr int kEwMinBlocks = 3;   // resident blocks per SM the element-wise kernels are compiled for
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

// Per-channel coefficients (R rows of the coef table) for the element-wise kernels, without a load per element
// in the common cases:
//  kFixed: the thread's channels never change (channels-last, grid element stride a multiple of C: ew_config in
//          src/cuda/launch.cuh): loaded into registers once, before the loop;
//  else:   a vector inside one channel (planar, s + K <= inner) uses R scalars, reloaded only when the channel
//          changes (one cache per unrolled slot u); a vector across channels loads per element.
// apply<u>(cur, f) calls f(get), get(r, j) the coefficient r of element j of the vector starting at cursor `cur`.
template <typename acc_t, int R, int K, int U, bool kFixed>
struct CoefSource {
  const acc_t* __restrict__ coef;
  int64_t C, inner;
  acc_t fixed[kFixed ? R : 1][kFixed ? K : 1];
  acc_t uni[U][R];
  int64_t cached[U];

  __device__ __forceinline__ CoefSource(const acc_t* __restrict__ coef_, int64_t C_, int64_t inner_, ChanCursor cur)
      : coef(coef_), C(C_), inner(inner_) {
#pragma unroll
    for (int u = 0; u < U; ++u) cached[u] = -1;
    if constexpr (kFixed) {
#pragma unroll
      for (int j = 0; j < K; ++j) {
#pragma unroll
        for (int r = 0; r < R; ++r) fixed[r][j] = coef[r * C + cur.c];
        cur.next(inner, C);
      }
    }
  }

  template <int u, class F>
  __device__ __forceinline__ void apply(const ChanCursor& cur, F&& f) {
    if constexpr (kFixed) {
      f([&](int r, int j) { return fixed[r][j]; });
    } else {
      if (cur.s + K <= inner) {
        if (cur.c != cached[u]) {
          cached[u] = cur.c;
#pragma unroll
          for (int r = 0; r < R; ++r) uni[u][r] = coef[r * C + cur.c];
        }
        f([&](int r, int) { return uni[u][r]; });
      } else {
        int64_t ch[K];
        ChanCursor cc = cur;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          ch[j] = cc.c;
          cc.next(inner, C);
        }
        f([&](int r, int j) { return coef[r * C + ch[j]]; });
      }
    }
  }
};

// Vectors per thread and step of the element-wise kernels (all loads first, for more bytes in flight): 2 for
// float and double; 1 for the 16-bit types, whose 8-element vectors already take the registers (more would spill).
template <typename scalar_t>
constexpr int unroll() {
  return sizeof(scalar_t) == 2 ? 1 : 2;
}

// ---------------------------------------------------------------------------
// Packed SiLU branch mask: bit (e % 32) of word e / 32.

// Lane l holds K consecutive elements from e = warp_first + l*K (warp_first a multiple of 32*K): the warp covers
// K whole words; `bits`: the lane's K bits (bit j: element j). Every lane of the warp must call this (full-mask
// warp intrinsics).
template <int K>
__device__ __forceinline__ void write_mask_words(uint32_t* __restrict__ mask, uint32_t bits, int lane, int64_t e,
                                                 int64_t numel) {
  if constexpr (K == 1) {
    const uint32_t w = __ballot_sync(kFullMask, bits != 0u);
    if (lane == 0 && e < numel) mask[e >> 5] = w;
  } else {
    // Groups of G = 32 / K lanes fill one word, lane l giving bits K*(l % G) .. K*(l % G) + K - 1; an OR
    // butterfly assembles it (xor offsets < G stay inside aligned groups).
    constexpr int G = 32 / K;
    uint32_t w = bits << (K * (lane % G));
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) w |= __shfl_xor_sync(kFullMask, w, off);
    if (lane % G == 0 && e < numel) mask[e >> 5] = w;
  }
}

// ---------------------------------------------------------------------------
// forward_: y = f((x - mean) g~ r + beta [+ residual]) into x, x read from src (x, or the out-of-place form's
// source); with zout (ReLU, A = identity): z into zout, max(z, 0) into x.
// Each thread reads then writes its own positions only; x, src and res carry no __restrict__ so that a residual
// aliasing x stays correct. Thread t handles vectors v = t + (i U + u) vstride (u < U), vector v being elements
// [v K, v K + K); a warp's 32 vectors are consecutive from a multiple of 32 K, so they fill K whole mask words.

template <typename scalar_t, typename acc_t, Act A, int K, bool kFixed>
__global__ void __launch_bounds__(kEwThreads, kEwMinBlocks)
    forward_kernel(scalar_t* x, const scalar_t* src, const scalar_t* res, uint32_t* __restrict__ mask,
                   const acc_t* __restrict__ coef, acc_t param, int64_t numel, int64_t inner, int64_t C,
                   acc_t* __restrict__ zout) {
  using Fn = Activation<A, ScalarMath<acc_t>>;
  constexpr int U = unroll<scalar_t>();
  const int lane = threadIdx.x & 31;
  const int64_t nvec = (numel + K - 1) / K;
  const int64_t vstride = (int64_t)gridDim.x * blockDim.x;
  const int64_t estride = vstride * K;
  const int64_t rs = estride % inner, dcq = (estride / inner) % C;
  int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  ChanCursor cur;
  cur.init(v * K, inner, C);
  CoefSource<acc_t, kFwdRows, K, U, kFixed> co(coef, C, inner, cur);
  // Loop condition uniform over the warp (vb: its first vector): every lane reaches the mask's warp intrinsics.
  for (int64_t vb = v - lane; vb < nvec; vb += U * vstride, v += U * vstride) {
    scalar_t xv[U][K], rv[U][K];
    ChanCursor cu[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cu[u] = cur;
      if constexpr (!kFixed) cur.jump(rs, dcq, inner, C);
      const int64_t e = (v + u * vstride) * K;
      if (e < numel) {
        load_k<K>(src + e, xv[u], e + K <= numel, numel - e);
        if (res != nullptr) load_k<K>(res + e, rv[u], e + K <= numel, numel - e);
      }
    }
    auto step = [&](auto uc) {
      constexpr int u = decltype(uc)::value;
      const int64_t e = (v + u * vstride) * K;
      uint32_t bits = 0;
      if (e < numel) {
        const bool full = e + K <= numel;
        const int64_t remain = numel - e;
        co.template apply<u>(cu[u], [&](auto get) {
#pragma unroll
          for (int j = 0; j < K; ++j) {
            acc_t z = ((static_cast<acc_t>(xv[u][j]) - get(kFwdMeanHi, j)) - get(kFwdMeanLo, j)) * get(kFwdScale, j) +
                      get(kFwdShift, j);
            if (res != nullptr) z += static_cast<acc_t>(rv[u][j]);
            if (zout != nullptr) {  // ReLU (with the identity): z kept for backward, max(z, 0) into x
              if (j < remain) zout[e + j] = z;
              xv[u][j] = static_cast<scalar_t>(z < acc_t(0) ? acc_t(0) : z);  // NaN stays NaN
            } else {
              xv[u][j] = static_cast<scalar_t>(Fn::forward(z, param));
            }
            if constexpr (A == Act::Silu) {
              if (j < remain && Fn::branch(z) != acc_t(0)) bits |= 1u << j;
            }
          }
        });
        store_k<K>(x + e, xv[u], full, remain);
      }
      if constexpr (A == Act::Silu) write_mask_words<K>(mask, bits, lane, e, numel);
      (void)bits;
    };
    static_assert(U == 1 || U == 2, "step calls below");
    step(std::integral_constant<int, 0>{});
    if constexpr (U == 2) step(std::integral_constant<int, 1>{});
  }
}

// ---------------------------------------------------------------------------
// backward_input: dx = g~ r (gz - mean_gz - xhat mean_gz_xhat) = a gz + b zc + c0
// [, dres = gz]. Same traversal as forward_kernel.

template <typename scalar_t, typename acc_t, Act A, int K, bool kFixed>
__global__ void __launch_bounds__(kEwThreads, kEwMinBlocks)
    backward_input_kernel(const scalar_t* __restrict__ y, const scalar_t* __restrict__ dy,
                          const scalar_t* __restrict__ res, const uint32_t* __restrict__ mask,
                          const acc_t* __restrict__ coef, acc_t param, int64_t numel, int64_t inner, int64_t C,
                          scalar_t* __restrict__ dx, scalar_t* __restrict__ dres) {
  using Fn = Activation<A, ScalarMath<acc_t>>;
  constexpr int U = unroll<scalar_t>();
  const int64_t nvec = (numel + K - 1) / K;
  const int64_t vstride = (int64_t)gridDim.x * blockDim.x;
  const int64_t estride = vstride * K;
  const int64_t rs = estride % inner, dcq = (estride / inner) % C;
  int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  ChanCursor cur;
  cur.init(v * K, inner, C);
  CoefSource<acc_t, kInRows, K, U, kFixed> co(coef, C, inner, cur);
  for (; v < nvec; v += U * vstride) {
    scalar_t yv[U][K], dyv[U][K], rv[U][K];
    uint32_t bits[U];
    ChanCursor cu[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cu[u] = cur;
      if constexpr (!kFixed) cur.jump(rs, dcq, inner, C);
      const int64_t e = (v + u * vstride) * K;
      bits[u] = 0;
      if (e < numel) {
        load_k<K>(y + e, yv[u], e + K <= numel, numel - e);
        load_k<K>(dy + e, dyv[u], e + K <= numel, numel - e);
        if (res != nullptr) load_k<K>(res + e, rv[u], e + K <= numel, numel - e);
        // e is a multiple of K, K divides 32: the K bits lie in one word.
        if constexpr (A == Act::Silu) bits[u] = mask[e >> 5] >> (e & 31);
      }
    }
    auto step = [&](auto uc) {
      constexpr int u = decltype(uc)::value;
      const int64_t e = (v + u * vstride) * K;
      if (e >= numel) return;
      const bool full = e + K <= numel;
      const int64_t remain = numel - e;
      scalar_t dxv[K], gv[K];
      co.template apply<u>(cu[u], [&](auto get) {
#pragma unroll
        for (int j = 0; j < K; ++j) {
          acc_t d;
          const acc_t z = Fn::inverse_deriv(static_cast<acc_t>(yv[u][j]), acc_t((bits[u] >> j) & 1u), param, d);
          const acc_t gz = static_cast<acc_t>(dyv[u][j]) * d;
          acc_t zc = z - get(kInShift, j);
          if (res != nullptr) zc -= static_cast<acc_t>(rv[u][j]);
          dxv[j] = static_cast<scalar_t>(get(kInA, j) * gz + (get(kInB, j) * zc + get(kInC0, j)));
          gv[j] = static_cast<scalar_t>(gz);
        }
      });
      store_k<K>(dx + e, dxv, full, remain);
      if (dres != nullptr) store_k<K>(dres + e, gv, full, remain);
    };
    static_assert(U == 1 || U == 2, "step calls below");
    step(std::integral_constant<int, 0>{});
    if constexpr (U == 2) step(std::integral_constant<int, 1>{});
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
// batch_stats, contiguous (N, C, S): grid (chunks, channels); block b of channel c reduces vectors
// [b * chunk_len, (b+1) * chunk_len) of the channel's N * S/K (vector i: sample i / Sv, position i % Sv).
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
        const acc_t xj = static_cast<acc_t>(xv[0]);
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
          xs[j] = static_cast<acc_t>(xv[j]);
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

// batch_stats, channels-last (N*S rows of C): grid (channel tiles, row chunks), block (BX, BY): thread (tx, ty)
// owns channels [cv*K, cv*K + K) of the tile and rows r0 + ty, r0 + ty + BY, ... of the chunk; then a tree over ty.
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
        const acc_t xj = static_cast<acc_t>(xv[j]);
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

// Per element: gz = dy f'(z), zc = z - shift [- res]; the kernels sum gz and gz zc, finalize_sums_kernel divides
// the second sum by g~ (xhat = zc / g~). r = 0 without a residual (z - shift - 0 is exactly z - shift).
template <typename acc_t, Act A>
struct GradTerms {
  static __device__ __forceinline__ void add(acc_t y, acc_t dy, acc_t r, uint32_t bit, acc_t shift, acc_t param,
                                             acc_t& sg, acc_t& sgzc) {
    using Fn = Activation<A, ScalarMath<acc_t>>;
    acc_t d;
    const acc_t z = Fn::inverse_deriv(y, acc_t(bit), param, d);
    const acc_t gz = dy * d;
    const acc_t zc = (z - shift) - r;
    sg += gz;
    sgzc += gz * zc;
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
    const acc_t shift = coef[kRedShift * C + c];
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
        const acc_t rj = res != nullptr ? static_cast<acc_t>(rv[j]) : acc_t(0);
        GradTerms<acc_t, A>::add(static_cast<acc_t>(yv[j]), static_cast<acc_t>(dyv[j]), rj, (bits >> j) & 1u, shift, param,
                                 sg, sgx);
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
  acc_t sg[K], sgx[K], shift[K];
#pragma unroll
  for (int j = 0; j < K; ++j) sg[j] = sgx[j] = shift[j] = acc_t(0);
  if (cv < Cv) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      shift[j] = coef[kRedShift * C + cv * K + j];
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
        const acc_t rj = res != nullptr ? static_cast<acc_t>(rv[j]) : acc_t(0);
        GradTerms<acc_t, A>::add(static_cast<acc_t>(yv[j]), static_cast<acc_t>(dyv[j]), rj, (bits >> j) & 1u, shift[j],
                                 param, sg[j], sgx[j]);
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

// out_a = sum of row 0, out_b = (sum of row 1) / divisor[c].
template <typename acc_t>
__global__ void __launch_bounds__(kFinThreads)
    finalize_sums_kernel(const acc_t* __restrict__ part, int64_t nchunks, int64_t C,
                         const acc_t* __restrict__ divisor, acc_t* __restrict__ out_a, acc_t* __restrict__ out_b) {
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
    out_b[c] = v.b / divisor[c];
  }
}

}  // namespace gpu
}  // namespace inplace_abn
