// Host side of the CUDA kernels (src/cuda/<op>_kernel.cu): launch configurations, the current stream and
// checked launches. Only c10 CUDA headers (ATen/cuda/CUDAContext.h pulls in the cuBLAS / cuSPARSE headers):
// c10::cuda::getCurrentCUDAStream() is the stream at::cuda::getCurrentCUDAStream() returns.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <utility>

#include "cuda/kernels.cuh"
#include "ops/kernel.h"

namespace inplace_abn {
namespace gpu {

constexpr int64_t kMaxGridY = 65535;
// Largest block-count multiple accepted for the fixed-channel element-wise grids (ew_config).
constexpr int64_t kMaxFixedBlocks = 8192;

// Memory is (N S) rows of C channels: channels-last, or S == 1.
inline bool rows(const Geometry& g) { return g.channels_last || g.S == 1; }

// ---------------------------------------------------------------------------
// Launch configurations (pure functions of the sizes and the device).

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Largest count reduced by one block: per-block counts travel as acc_t, exact in float up to 2^24.
constexpr int64_t kMaxBlockCount = int64_t(1) << 24;

struct EwConfig {
  int64_t blocks;
  int threads;
  bool fixed;  // channels fixed per thread (CoefSource kFixed)
};

// Element-wise kernels: grid-stride over the numel / K vectors, about two waves of resident blocks at most. For
// rows (channels-last) the block count is rounded up to a multiple of bq, so that the grid's stride in elements,
// blocks * threads * K, is a multiple of C and every thread keeps its channels (and their coefficients, in
// registers) over the whole loop; when bq would be too large (C with a large odd factor) the kernels load per
// element instead.
inline EwConfig ew_config(int64_t numel, int64_t K, const Geometry& g, int sms) {
  const int64_t cap = int64_t(sms) * (2048 / kEwThreads) * 2;
  EwConfig cfg{std::max<int64_t>(1, std::min(ceil_div(ceil_div(numel, K), kEwThreads), cap)), kEwThreads, false};
  if (rows(g)) {
    const int64_t q = g.C / std::gcd(g.C, K);           // threads * K % C == 0 iff q | threads
    const int64_t bq = q / std::gcd(q, int64_t(kEwThreads));  // q | blocks * kEwThreads iff bq | blocks
    if (bq <= kMaxFixedBlocks) {
      cfg.blocks = ceil_div(cfg.blocks, bq) * bq;
      cfg.fixed = true;
    }
  }
  return cfg;
}

struct ContigConfig {
  int threads;
  int64_t chunks;     // gridDim.x
  int64_t chunk_len;  // vectors per block
  int64_t grid_y;     // channels per pass of gridDim.y
};

// Contiguous reductions: grid (chunks of the N * Sv vectors of a channel,
// channels); enough blocks to fill the device about twice.
inline ContigConfig contig_config(int64_t N, int64_t C, int64_t Sv, int64_t K, int sms) {
  ContigConfig cfg;
  const int64_t total = N * Sv;
  cfg.threads = static_cast<int>(std::min<int64_t>(kRedThreads, std::max<int64_t>(32, pow2_ceil(total))));
  cfg.grid_y = std::min(C, kMaxGridY);
  const int64_t blocks_per_sm = std::min<int64_t>(16, 2048 / cfg.threads);
  const int64_t target = int64_t(sms) * blocks_per_sm * 2;
  int64_t chunks = ceil_div(target, cfg.grid_y);
  chunks = std::min(chunks, ceil_div(total, int64_t(cfg.threads) * 4));
  chunks = std::max(chunks, ceil_div(total, kMaxBlockCount / K));
  chunks = std::max<int64_t>(chunks, 1);
  cfg.chunk_len = ceil_div(total, chunks);
  cfg.chunks = ceil_div(total, cfg.chunk_len);
  return cfg;
}

struct RowsConfig {
  int bx, by;             // block (bx, by), bx * by = kRedThreads, by a power of two
  int64_t tiles;          // gridDim.x: channel tiles of bx * K channels
  int64_t chunks;         // gridDim.y: row chunks
  int64_t rows_per_chunk;
};

// Channels-last reductions over M rows of C channels.
inline RowsConfig rows_config(int64_t M, int64_t C, int64_t K, int sms) {
  RowsConfig cfg;
  const int64_t Cv = C / K;
  cfg.bx = static_cast<int>(std::min<int64_t>(32, pow2_ceil(Cv)));
  cfg.by = kRedThreads / cfg.bx;
  cfg.tiles = ceil_div(Cv, cfg.bx);
  const int64_t target = int64_t(sms) * (2048 / kRedThreads) * 2;
  int64_t chunks = ceil_div(target, cfg.tiles);
  chunks = std::min(chunks, ceil_div(M, int64_t(cfg.by) * 4));
  chunks = std::max(chunks, ceil_div(M, kMaxBlockCount));
  chunks = std::max<int64_t>(1, std::min(chunks, kMaxGridY));
  cfg.rows_per_chunk = ceil_div(M, chunks);
  TORCH_CHECK(cfg.rows_per_chunk <= kMaxBlockCount, "inplace_abn: too many rows (", M,
              ") for the channels-last reduction");
  cfg.chunks = ceil_div(M, cfg.rows_per_chunk);
  return cfg;
}

// The grid of a reduction's partial results (nchunks per channel): contiguous (N, C, S) (chunks x channels, 1D
// blocks, len vectors per chunk) or rows (channel tiles x row chunks, 2D blocks, len rows per chunk); K elements
// per load (KV when aligned and the layout allows).
struct ReduceGrid {
  int K;
  dim3 grid, block;
  int64_t nchunks, len;
};

inline ReduceGrid reduce_grid(const Geometry& g, int KV, bool aligned, int sms) {
  auto u = [](int64_t v) { return static_cast<unsigned>(v); };
  if (!rows(g)) {
    const int K = aligned && g.S % KV == 0 ? KV : 1;
    const ContigConfig c = contig_config(g.N, g.C, g.S / K, K, sms);
    return {K, dim3(u(c.chunks), u(c.grid_y)), dim3(c.threads), c.chunks, c.chunk_len};
  }
  const int K = aligned && g.C % KV == 0 ? KV : 1;
  const RowsConfig c = rows_config(g.N * g.S, g.C, K, sms);
  return {K, dim3(u(c.tiles), u(c.chunks)), dim3(c.bx, c.by), c.chunks, c.rows_per_chunk};
}

inline int64_t fin_blocks(int64_t C) { return ceil_div(C, kFinThreads / 32); }

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;

template <typename scalar_t>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(scalar_t));
}

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Multiprocessors of the current device (set by the front end's guard): no synchronisation.
inline int sm_count() {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return sms > 0 ? sms : 1;
}

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, Args&&... args) {
  kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream().stream()>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The pointer of an optional operand (nullptr when undefined).
template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

inline const uint32_t* mask_ptr(const KernelArgs& a) {
  return a.act == Act::Silu ? reinterpret_cast<const uint32_t*>(a.mask.const_data_ptr<int32_t>()) : nullptr;
}

}  // namespace gpu
}  // namespace inplace_abn
