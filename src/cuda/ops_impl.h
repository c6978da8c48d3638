// Host side of the CUDA backend: argument checks, launch configurations and
// helpers of the four operators (schemas in src/ops.cpp, math in DESIGN.md),
// whose bodies are in op_batch_stats.h, op_forward.h, op_backward_reduce.h
// and op_backward_input.h.
//
// Written against a small backend interface so that the same text runs the
// real kernels (backend_cuda.cuh, used by batch_stats.cu, forward.cu,
// backward_reduce.cu, backward_input.cu) and the CPU emulator of the kernels
// (src/cuda/emu). The includer defines, in namespace inplace_abn::gpu::backend:
//   Stream stream();                       current stream
//   int sm_count();                        multiprocessors of the current device
//   kMaxGridY                              largest gridDim.y (65535)
//   kMaxFixedBlocks                        see ew_config
//   void check_device(t, x, name);         t is on x's device (and x on the GPU)
//   struct Guard { explicit Guard(const at::Tensor&); };
//   void launch(kernel, dim3 grid, dim3 block, Stream, args...);  launch + error check
// and includes kernels.cuh first.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>

#include "common.h"

namespace inplace_abn {
namespace gpu {

// Memory layout as the kernels see it.
struct Geometry {
  int64_t N, C, S, numel;
  bool rows;  // memory is (N * S) rows of C channels: channels-last, or S == 1
  int64_t inner() const { return rows ? 1 : S; }
};

// ---------------------------------------------------------------------------
// Launch configurations (pure functions of the sizes and the device).

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Largest count reduced by one block: per-block counts travel as acc_t, exact
// in float up to 2^24.
constexpr int64_t kMaxBlockCount = int64_t(1) << 24;

struct EwConfig {
  int64_t blocks;
  int threads;
  bool fixed;  // channels fixed per thread (CoefSource kFixed)
};

// Element-wise kernels: grid-stride over the numel / K vectors, about two
// waves of resident blocks at most. For rows (channels-last) the block count
// is rounded up to a multiple of bq, so that the grid's stride in elements,
// blocks * threads * K, is a multiple of C and every thread keeps its channels
// (and their coefficients, in registers) over the whole loop; when bq would be
// too large (C with a large odd factor) the kernels load per element instead.
inline EwConfig ew_config(int64_t numel, int64_t K, const Geometry& g, int sms, int64_t max_fixed_blocks) {
  const int64_t cap = int64_t(sms) * (2048 / kEwThreads) * 2;
  EwConfig cfg{std::max<int64_t>(1, std::min(ceil_div(ceil_div(numel, K), kEwThreads), cap)), kEwThreads, false};
  if (g.rows) {
    const int64_t q = g.C / std::gcd(g.C, K);           // threads * K % C == 0 iff q | threads
    const int64_t bq = q / std::gcd(q, int64_t(kEwThreads));  // q | blocks * kEwThreads iff bq | blocks
    if (bq <= max_fixed_blocks) {
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
inline ContigConfig contig_config(int64_t N, int64_t C, int64_t Sv, int64_t K, int sms, int64_t max_grid_y) {
  ContigConfig cfg;
  const int64_t total = N * Sv;
  cfg.threads = static_cast<int>(std::min<int64_t>(kRedThreads, std::max<int64_t>(32, pow2_ceil(total))));
  cfg.grid_y = std::min(C, max_grid_y);
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
inline RowsConfig rows_config(int64_t M, int64_t C, int64_t K, int sms, int64_t max_grid_y) {
  RowsConfig cfg;
  const int64_t Cv = C / K;
  cfg.bx = static_cast<int>(std::min<int64_t>(32, pow2_ceil(Cv)));
  cfg.by = kRedThreads / cfg.bx;
  cfg.tiles = ceil_div(Cv, cfg.bx);
  const int64_t target = int64_t(sms) * (2048 / kRedThreads) * 2;
  int64_t chunks = ceil_div(target, cfg.tiles);
  chunks = std::min(chunks, ceil_div(M, int64_t(cfg.by) * 4));
  chunks = std::max(chunks, ceil_div(M, kMaxBlockCount));
  chunks = std::max<int64_t>(1, std::min(chunks, max_grid_y));
  cfg.rows_per_chunk = ceil_div(M, chunks);
  TORCH_CHECK(cfg.rows_per_chunk <= kMaxBlockCount, "inplace_abn: too many rows (", M,
              ") for the channels-last reduction");
  cfg.chunks = ceil_div(M, cfg.rows_per_chunk);
  return cfg;
}

inline int64_t fin_blocks(int64_t C) { return ceil_div(C, kFinThreads / 32); }

// ---------------------------------------------------------------------------
// Tensor helpers.

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;

template <typename scalar_t>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(scalar_t));
}

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline Geometry geometry_of(const at::Tensor& x, Layout lay) {
  Geometry g;
  g.N = x.size(0);
  g.C = x.size(1);
  g.numel = x.numel();
  g.S = g.numel == 0 ? 0 : g.numel / (g.N * g.C);
  g.rows = lay == Layout::ChannelsLast || g.S == 1;
  return g;
}

inline Layout checked_layout(const at::Tensor& x, const char* name) {
  const Layout lay = layout_of(x);
  TORCH_CHECK(lay != Layout::Other, "inplace_abn (CUDA): ", name,
              " must be contiguous or channels-last (make it contiguous first), got strides ", x.strides());
  return lay;
}

// A tensor read alongside x (dy, residual) must hold x's dtype and list its
// elements in x's memory order; one in another layout (an expanded gradient,
// say) or dtype is copied into x's (as the CPU backend does).
inline at::Tensor like(const at::Tensor& t, const at::Tensor& ref, Layout lay) {
  bool same_order;
  if (lay == Layout::Contiguous)
    same_order = t.is_contiguous();
  else
    same_order = t.is_contiguous(ref.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d);
  if (t.scalar_type() == ref.scalar_type() && same_order) return t;
  return at::empty_like(ref, at::MemoryFormat::Preserve).copy_(t);
}

inline ChanParam make_param(const std::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value() || !t->defined()) return ChanParam{nullptr, 0, kParamNone};
  int kind = kParamNone;
  switch (t->scalar_type()) {
    case at::kFloat:
      kind = kParamF32;
      break;
    case at::kDouble:
      kind = kParamF64;
      break;
    case at::kHalf:
      kind = kParamF16;
      break;
    case at::kBFloat16:
      kind = kParamBF16;
      break;
    default:
      TORCH_CHECK(false, "inplace_abn: ", name, " must be a floating point tensor, got ", t->scalar_type());
  }
  return ChanParam{t->const_data_ptr(), t->stride(0), kind};
}

inline ChanParam make_param(const at::Tensor& t, const char* name) { return make_param(std::optional<at::Tensor>(t), name); }

inline void check_vector(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return;
  check_channel_vector(t, x, name);
  backend::check_device(*t, x, name);
}

inline void check_same_shape(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return;
  check_like(t, x, name);
  backend::check_device(*t, x, name);
  TORCH_CHECK(at::isFloatingType(t->scalar_type()), "inplace_abn: ", name, " must be a floating point tensor, got ",
              t->scalar_type());
}

template <class F>
void dispatch_act(Act a, F&& f) {
  switch (a) {
    case Act::Identity:
      f(std::integral_constant<Act, Act::Identity>{});
      break;
    case Act::LeakyRelu:
      f(std::integral_constant<Act, Act::LeakyRelu>{});
      break;
    case Act::Elu:
      f(std::integral_constant<Act, Act::Elu>{});
      break;
    case Act::Silu:
      f(std::integral_constant<Act, Act::Silu>{});
      break;
  }
}

template <typename acc_t>
void launch_coef(int mode, int64_t C, const ChanParam& mean, const ChanParam& var, const ChanParam& weight,
                 const ChanParam& bias, const ChanParam& mg, const ChanParam& mgx, double eps, bool signed_weight,
                 const at::Tensor& coef) {
  const int64_t blocks = std::min<int64_t>(ceil_div(C, kEwThreads), 1024);
  backend::launch(&coef_kernel<acc_t>, dim3(static_cast<unsigned>(blocks)), dim3(kEwThreads), backend::stream(), mode,
                  C, mean, var, weight, bias, mg, mgx, eps, signed_weight,
                  coef.mutable_data_ptr<acc_t>());
}

}  // namespace gpu
}  // namespace inplace_abn
