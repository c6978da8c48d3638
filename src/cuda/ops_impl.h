// Host side of the CUDA backend: argument checks, launch configurations and
// the four operators (schemas in src/ops.cpp, math in DESIGN.md).
//
// Written against a small backend interface so that the same text runs the
// real kernels (kernels.cu) and the CPU emulator of the kernels (src/cuda/emu).
// The includer defines, in namespace inplace_abn::gpu::backend:
//   Stream stream();                       current stream
//   int sm_count();                        multiprocessors of the current device
//   constexpr int64_t kMaxGridY;           largest gridDim.y
//   void check_device(t, x, name);         t is on x's device (and x on the GPU)
//   struct Guard { explicit Guard(const at::Tensor&); };
//   void launch(kernel, dim3 grid, dim3 block, Stream, args...);  launch + error check
// and includes kernels.cuh first.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include "common.h"

namespace inplace_abn {
namespace gpu {

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
};

// Element-wise kernels: grid-stride over nvec vectors, about two waves of
// resident blocks at most.
inline EwConfig ew_config(int64_t nvec, int sms) {
  const int64_t cap = int64_t(sms) * (2048 / kEwThreads) * 2;
  return {std::max<int64_t>(1, std::min(ceil_div(nvec, kEwThreads), cap)), kEwThreads};
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

// Memory layout as the kernels see it.
struct Geometry {
  int64_t N, C, S, numel;
  bool rows;  // memory is (N * S) rows of C channels: channels-last, or S == 1
  int64_t inner() const { return rows ? 1 : S; }
};

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

// A tensor read alongside x (dy, residual) must list its elements in x's memory
// order; one in another layout (an expanded gradient, say) is copied into it.
inline at::Tensor match_layout(const at::Tensor& t, Layout lay) {
  if (lay == Layout::Contiguous) return t.is_contiguous() ? t : t.contiguous();
  const auto mf = t.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
  return t.is_contiguous(mf) ? t : t.contiguous(mf);
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
  TORCH_CHECK(t->scalar_type() == x.scalar_type(), "inplace_abn: ", name, " must have the input's dtype ",
              x.scalar_type(), ", got ", t->scalar_type());
}

inline void check_mask(const at::Tensor& mask, const at::Tensor& y, Act act) {
  if (act != Act::Silu) return;
  backend::check_device(mask, y, "mask");
  TORCH_CHECK(mask.scalar_type() == at::kInt, "inplace_abn: mask must be int32, got ", mask.scalar_type());
  TORCH_CHECK(mask.is_contiguous(), "inplace_abn: mask must be contiguous");
  TORCH_CHECK(mask.numel() >= mask_words(y.numel()), "inplace_abn: mask has ", mask.numel(), " words, ",
              mask_words(y.numel()), " needed");
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
                  C, mean, var, weight, bias, mg, mgx, static_cast<acc_t>(eps), signed_weight,
                  coef.mutable_data_ptr<acc_t>());
}

// ---------------------------------------------------------------------------
// batch_stats

inline std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x) {
  check_input(x, "x");
  backend::check_device(x, x, "x");
  backend::Guard guard(x);
  const int64_t C = x.size(1);
  const auto opts = x.options().dtype(acc_type_of(x.scalar_type()));
  if (x.numel() == 0) return {at::zeros({C}, opts), at::zeros({C}, opts)};
  const Layout lay = checked_layout(x, "x");
  const Geometry g = geometry_of(x, lay);
  at::Tensor mean = at::empty({C}, opts), var = at::empty({C}, opts);
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "inplace_abn_batch_stats_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    int64_t nchunks;
    at::Tensor part;
    if (!g.rows) {
      const bool vec = g.S % KV == 0 && aligned16(xp);
      const int64_t K = vec ? KV : 1;
      const ContigConfig cfg = contig_config(g.N, C, g.S / K, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({3 * nchunks * C}, opts);
      const dim3 grid(static_cast<unsigned>(cfg.chunks), static_cast<unsigned>(cfg.grid_y));
      if (vec)
        backend::launch(&stats_contig_kernel<scalar_t, acc_t, KV>, grid, dim3(cfg.threads), backend::stream(), xp,
                        g.N, C, g.S, cfg.chunk_len, nchunks, part.mutable_data_ptr<acc_t>());
      else
        backend::launch(&stats_contig_kernel<scalar_t, acc_t, 1>, grid, dim3(cfg.threads), backend::stream(), xp,
                        g.N, C, g.S, cfg.chunk_len, nchunks, part.mutable_data_ptr<acc_t>());
    } else {
      const bool vec = C % KV == 0 && aligned16(xp);
      const int64_t K = vec ? KV : 1;
      const int64_t M = g.N * g.S;
      const RowsConfig cfg = rows_config(M, C, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({3 * nchunks * C}, opts);
      const dim3 grid(static_cast<unsigned>(cfg.tiles), static_cast<unsigned>(cfg.chunks));
      const dim3 block(cfg.bx, cfg.by);
      if (vec)
        backend::launch(&stats_cl_kernel<scalar_t, acc_t, KV>, grid, block, backend::stream(), xp, M, C,
                        cfg.rows_per_chunk, nchunks, part.mutable_data_ptr<acc_t>());
      else
        backend::launch(&stats_cl_kernel<scalar_t, acc_t, 1>, grid, block, backend::stream(), xp, M, C,
                        cfg.rows_per_chunk, nchunks, part.mutable_data_ptr<acc_t>());
    }
    backend::launch(&finalize_stats_kernel<acc_t>, dim3(static_cast<unsigned>(fin_blocks(C))), dim3(kFinThreads),
                    backend::stream(), part.const_data_ptr<acc_t>(), nchunks, C, mean.mutable_data_ptr<acc_t>(),
                    var.mutable_data_ptr<acc_t>());
  });
  return {mean, var};
}

// ---------------------------------------------------------------------------
// forward_

inline at::Tensor forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, double eps, int64_t activation,
                           double activation_param, bool signed_weight) {
  check_input(x, "x");
  backend::check_device(x, x, "x");
  check_vector(mean, x, "mean");
  check_vector(var, x, "var");
  check_vector(weight, x, "weight");
  check_vector(bias, x, "bias");
  check_same_shape(residual, x, "residual");
  const Act act = to_act(activation);
  backend::Guard guard(x);
  const int64_t numel = x.numel();
  at::Tensor mask = at::empty({act == Act::Silu ? mask_words(numel) : 0}, x.options().dtype(at::kInt));
  if (numel == 0) return mask;
  const Layout lay = checked_layout(x, "x");
  const Geometry g = geometry_of(x, lay);
  const at::Tensor res = residual.has_value() ? match_layout(*residual, lay) : at::Tensor();
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "inplace_abn_forward_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const auto accopts = x.options().dtype(acc_type_of(x.scalar_type()));
    at::Tensor coef = at::empty({kFwdRows * g.C}, accopts);
    const ChanParam none{nullptr, 0, kParamNone};
    launch_coef<acc_t>(kCoefForward, g.C, make_param(mean, "mean"), make_param(var, "var"), make_param(weight, "weight"),
                       make_param(bias, "bias"), none, none, eps, signed_weight, coef);
    scalar_t* xp = x.mutable_data_ptr<scalar_t>();
    const scalar_t* rp = res.defined() ? res.const_data_ptr<scalar_t>() : nullptr;
    uint32_t* mp = act == Act::Silu ? reinterpret_cast<uint32_t*>(mask.mutable_data_ptr<int32_t>()) : nullptr;
    const acc_t* cp = coef.const_data_ptr<acc_t>();
    const bool vec = aligned16(xp) && aligned16(rp);
    const EwConfig cfg = ew_config(ceil_div(numel, vec ? KV : 1), sms);
    const dim3 grid(static_cast<unsigned>(cfg.blocks)), block(cfg.threads);
    const acc_t param = static_cast<acc_t>(activation_param);
    dispatch_act(act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      if (vec)
        backend::launch(&forward_kernel<scalar_t, acc_t, A, KV>, grid, block, backend::stream(), xp, rp, mp, cp, param,
                        numel, g.inner(), g.C);
      else
        backend::launch(&forward_kernel<scalar_t, acc_t, A, 1>, grid, block, backend::stream(), xp, rp, mp, cp, param,
                        numel, g.inner(), g.C);
    });
  });
  return mask;
}

// ---------------------------------------------------------------------------
// backward_reduce

inline std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& y, const at::Tensor& dy,
                                                          const at::Tensor& mask, const std::optional<at::Tensor>& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          const std::optional<at::Tensor>& residual, double eps,
                                                          int64_t activation, double activation_param,
                                                          bool signed_weight) {
  check_input(y, "y");
  backend::check_device(y, y, "y");
  check_same_shape(dy, y, "dy");
  check_vector(weight, y, "weight");
  check_vector(bias, y, "bias");
  check_same_shape(residual, y, "residual");
  const Act act = to_act(activation);
  check_mask(mask, y, act);
  backend::Guard guard(y);
  const int64_t C = y.size(1);
  const auto opts = y.options().dtype(acc_type_of(y.scalar_type()));
  if (y.numel() == 0) return {at::zeros({C}, opts), at::zeros({C}, opts)};
  const Layout lay = checked_layout(y, "y");
  const Geometry g = geometry_of(y, lay);
  const at::Tensor dy_ = match_layout(dy, lay);
  const at::Tensor res = residual.has_value() ? match_layout(*residual, lay) : at::Tensor();
  at::Tensor sum_gz = at::empty({C}, opts), sum_gz_xhat = at::empty({C}, opts);
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "inplace_abn_backward_reduce_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    at::Tensor coef = at::empty({kRedRows * C}, opts);
    const ChanParam none{nullptr, 0, kParamNone};
    launch_coef<acc_t>(kCoefReduce, C, none, none, make_param(weight, "weight"), make_param(bias, "bias"), none, none,
                       eps, signed_weight, coef);
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const scalar_t* dyp = dy_.const_data_ptr<scalar_t>();
    const scalar_t* rp = res.defined() ? res.const_data_ptr<scalar_t>() : nullptr;
    const uint32_t* mp = act == Act::Silu ? reinterpret_cast<const uint32_t*>(mask.const_data_ptr<int32_t>()) : nullptr;
    const acc_t* cp = coef.const_data_ptr<acc_t>();
    const acc_t param = static_cast<acc_t>(activation_param);
    const bool aligned = aligned16(yp) && aligned16(dyp) && aligned16(rp);
    int64_t nchunks;
    at::Tensor part;
    if (!g.rows) {
      const bool vec = aligned && g.S % KV == 0;
      const int64_t K = vec ? KV : 1;
      const ContigConfig cfg = contig_config(g.N, C, g.S / K, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({2 * nchunks * C}, opts);
      acc_t* pp = part.mutable_data_ptr<acc_t>();
      const dim3 grid(static_cast<unsigned>(cfg.chunks), static_cast<unsigned>(cfg.grid_y)), block(cfg.threads);
      dispatch_act(act, [&](auto tag) {
        constexpr Act A = decltype(tag)::value;
        if (vec)
          backend::launch(&bwd_reduce_contig_kernel<scalar_t, acc_t, A, KV>, grid, block, backend::stream(), yp, dyp,
                          rp, mp, cp, param, g.N, C, g.S, cfg.chunk_len, nchunks, pp);
        else
          backend::launch(&bwd_reduce_contig_kernel<scalar_t, acc_t, A, 1>, grid, block, backend::stream(), yp, dyp,
                          rp, mp, cp, param, g.N, C, g.S, cfg.chunk_len, nchunks, pp);
      });
    } else {
      const bool vec = aligned && C % KV == 0;
      const int64_t K = vec ? KV : 1;
      const int64_t M = g.N * g.S;
      const RowsConfig cfg = rows_config(M, C, K, sms, backend::kMaxGridY);
      nchunks = cfg.chunks;
      part = at::empty({2 * nchunks * C}, opts);
      acc_t* pp = part.mutable_data_ptr<acc_t>();
      const dim3 grid(static_cast<unsigned>(cfg.tiles), static_cast<unsigned>(cfg.chunks)), block(cfg.bx, cfg.by);
      dispatch_act(act, [&](auto tag) {
        constexpr Act A = decltype(tag)::value;
        if (vec)
          backend::launch(&bwd_reduce_cl_kernel<scalar_t, acc_t, A, KV>, grid, block, backend::stream(), yp, dyp, rp,
                          mp, cp, param, M, C, cfg.rows_per_chunk, nchunks, pp);
        else
          backend::launch(&bwd_reduce_cl_kernel<scalar_t, acc_t, A, 1>, grid, block, backend::stream(), yp, dyp, rp,
                          mp, cp, param, M, C, cfg.rows_per_chunk, nchunks, pp);
      });
    }
    backend::launch(&finalize_sums_kernel<acc_t>, dim3(static_cast<unsigned>(fin_blocks(C))), dim3(kFinThreads),
                    backend::stream(), part.const_data_ptr<acc_t>(), nchunks, C, sum_gz.mutable_data_ptr<acc_t>(),
                    sum_gz_xhat.mutable_data_ptr<acc_t>());
  });
  return {sum_gz, sum_gz_xhat};
}

// ---------------------------------------------------------------------------
// backward_input

inline std::tuple<at::Tensor, at::Tensor> backward_input(
    const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, const at::Tensor& mean_gz, const at::Tensor& mean_gz_xhat, double eps,
    int64_t activation, double activation_param, bool signed_weight, bool residual_grad) {
  check_input(y, "y");
  backend::check_device(y, y, "y");
  check_same_shape(dy, y, "dy");
  check_vector(var, y, "var");
  check_vector(weight, y, "weight");
  check_vector(bias, y, "bias");
  check_same_shape(residual, y, "residual");
  check_vector(mean_gz, y, "mean_gz");
  check_vector(mean_gz_xhat, y, "mean_gz_xhat");
  const Act act = to_act(activation);
  check_mask(mask, y, act);
  backend::Guard guard(y);
  // Same dtype and memory format as y (x's storage): preserve_format keeps
  // the strides of a dense tensor, so memory positions match.
  at::Tensor dx = at::empty_like(y);
  at::Tensor dres = residual_grad ? at::empty_like(y) : at::empty({0}, y.options());
  const int64_t numel = y.numel();
  if (numel == 0) return {dx, dres};
  const Layout lay = checked_layout(y, "y");
  const Geometry g = geometry_of(y, lay);
  TORCH_CHECK(dx.strides() == y.strides() && (!residual_grad || dres.strides() == y.strides()),
              "inplace_abn: unexpected gradient layout");
  const at::Tensor dy_ = match_layout(dy, lay);
  const at::Tensor res = residual.has_value() ? match_layout(*residual, lay) : at::Tensor();
  const int sms = backend::sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "inplace_abn_backward_input_cuda", [&] {
    using acc_t = acc_of<scalar_t>;
    constexpr int KV = vec_width<scalar_t>();
    const auto accopts = y.options().dtype(acc_type_of(y.scalar_type()));
    at::Tensor coef = at::empty({kInRows * g.C}, accopts);
    const ChanParam none{nullptr, 0, kParamNone};
    launch_coef<acc_t>(kCoefInput, g.C, none, make_param(var, "var"), make_param(weight, "weight"),
                       make_param(bias, "bias"), make_param(mean_gz, "mean_gz"), make_param(mean_gz_xhat, "mean_gz_xhat"),
                       eps, signed_weight, coef);
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const scalar_t* dyp = dy_.const_data_ptr<scalar_t>();
    const scalar_t* rp = res.defined() ? res.const_data_ptr<scalar_t>() : nullptr;
    const uint32_t* mp = act == Act::Silu ? reinterpret_cast<const uint32_t*>(mask.const_data_ptr<int32_t>()) : nullptr;
    scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
    scalar_t* drp = residual_grad ? dres.mutable_data_ptr<scalar_t>() : nullptr;
    const acc_t* cp = coef.const_data_ptr<acc_t>();
    const acc_t param = static_cast<acc_t>(activation_param);
    const bool vec = aligned16(yp) && aligned16(dyp) && aligned16(rp) && aligned16(dxp) && aligned16(drp);
    const EwConfig cfg = ew_config(ceil_div(numel, vec ? KV : 1), sms);
    const dim3 grid(static_cast<unsigned>(cfg.blocks)), block(cfg.threads);
    dispatch_act(act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      if (vec)
        backend::launch(&backward_input_kernel<scalar_t, acc_t, A, KV>, grid, block, backend::stream(), yp, dyp, rp, mp,
                        cp, param, numel, g.inner(), g.C, dxp, drp);
      else
        backend::launch(&backward_input_kernel<scalar_t, acc_t, A, 1>, grid, block, backend::stream(), yp, dyp, rp, mp,
                        cp, param, numel, g.inner(), g.C, dxp, drp);
    });
  });
  return {dx, dres};
}

}  // namespace gpu
}  // namespace inplace_abn
