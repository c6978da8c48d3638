// Helpers of the device-agnostic front ends (src/ops/<op>.cpp): argument checks, the memory layout, and the
// per-channel coefficient tables (float64 formulas rounded into the accumulation dtype).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <array>
#include <cmath>
#include <optional>
#include <vector>

#include "ops/kernel.h"

namespace inplace_abn {

using OptTensor = std::optional<at::Tensor>;

// Accumulation / statistics dtype: float32 for float, half and bfloat16 inputs,
// float64 for double (docs/DESIGN.md section 1).
inline at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline Act to_act(int64_t a) {
  TORCH_CHECK(a >= 0 && a <= 3, "inplace_abn: unknown activation code ", a);
  return static_cast<Act>(a);
}

// Number of 32-bit words of the packed SiLU branch mask for `numel` elements.
inline int64_t mask_words(int64_t numel) { return (numel + 31) / 32; }

// The data tensor of every operator: at least 2 dims, a float dtype the kernels compile for.
inline void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 2, "inplace_abn: ", name, " must have at least 2 dimensions (N, C, ...), got ", x.dim());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16, "inplace_abn: ", name,
              " must be float32, float64, float16 or bfloat16, got ", t);
}

// A per-channel vector of length C, of a float dtype, on x's device.
inline void check_channel_vector(const OptTensor& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(1), "inplace_abn: ", name, " must have shape (", x.size(1),
              ",), got ", t->sizes());
  TORCH_CHECK(t->device() == x.device(), "inplace_abn: ", name, " is on ", t->device(), " but the input is on ",
              x.device());
  TORCH_CHECK(at::isFloatingType(t->scalar_type()), "inplace_abn: ", name, " must be a floating point tensor, got ",
              t->scalar_type());
}

// A tensor of x's shape, of a float dtype, on x's device.
inline void check_like(const OptTensor& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->sizes() == x.sizes(), "inplace_abn: ", name, " must have the input's shape ", x.sizes(), ", got ",
              t->sizes());
  TORCH_CHECK(t->device() == x.device(), "inplace_abn: ", name, " is on ", t->device(), " but the input is on ",
              x.device());
  TORCH_CHECK(at::isFloatingType(t->scalar_type()), "inplace_abn: ", name, " must be a floating point tensor, got ",
              t->scalar_type());
}

// Checks of backward_reduce and backward_input; returns the activation.
inline Act check_backward_args(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                               const OptTensor& weight, const OptTensor& bias, const OptTensor& residual,
                               int64_t activation, double param) {
  check_input(y, "y");
  const Act act = to_act(activation);
  // the backward inverts the activation: leaky_relu and elu need a parameter > 0
  if (act == Act::LeakyRelu)
    TORCH_CHECK(param > 0, "inplace_abn: leaky_relu needs a slope > 0 to be inverted in backward, got ", param);
  if (act == Act::Elu) TORCH_CHECK(param > 0, "inplace_abn: elu needs alpha > 0 to be inverted in backward, got ", param);
  check_like(dy, y, "dy");
  check_channel_vector(weight, y, "weight");
  check_channel_vector(bias, y, "bias");
  check_like(residual, y, "residual");
  if (act == Act::Silu) {  // the packed branch mask written by forward_ (docs/DESIGN.md section 3)
    TORCH_CHECK(mask.device() == y.device(), "inplace_abn: mask is on ", mask.device(), " but the input is on ",
                y.device());
    TORCH_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 1 && mask.is_contiguous(),
                "inplace_abn: mask must be a contiguous 1-D int32 tensor, got ", mask.scalar_type(), " ", mask.sizes());
    TORCH_CHECK(mask.numel() >= mask_words(y.numel()), "inplace_abn: mask has ", mask.numel(), " words, need ",
                mask_words(y.numel()), " for ", y.numel(), " elements");
  }
  return act;
}

// The z buffer of the SiLU backward on the CPU (docs/DESIGN.md section 7.2): y's shape and layout, in the compute
// type (y's dtype for float32 / float64; float32 for a 16-bit y, whose dtype would round z).
inline void check_z(const at::Tensor& z, const at::Tensor& y, Act act, const char* name) {
  TORCH_CHECK(act == Act::Silu, "inplace_abn: ", name, " is for the SiLU backward only");
  TORCH_CHECK(z.is_cpu() && y.is_cpu(), "inplace_abn: ", name, " is implemented on the CPU only, got ", z.device());
  const at::ScalarType want = acc_type_of(y.scalar_type());  // the compute type: y's own, float32 for 16-bit y
  TORCH_CHECK(z.sizes() == y.sizes() && z.strides() == y.strides() && z.scalar_type() == want, "inplace_abn: ",
              name, " must have y's shape and strides and y's compute type (", want, " for a ", y.scalar_type(),
              " y), got ", z.scalar_type(), " ", z.sizes(), " strides ", z.strides());
}

// Whether a backward keeps its inverse of y between its two passes in dx's own buffer (backward_reduce's z_out: z,
// or h = z / y on the table kernels; then backward_input_from_z_ writes dx over it): SiLU on the CPU in float32 /
// float64 (section 7.2).
inline bool silu_keeps_z(const at::Tensor& y, int64_t act) {
  return act == static_cast<int64_t>(Act::Silu) && y.is_cpu() &&
         (y.scalar_type() == at::kFloat || y.scalar_type() == at::kDouble);
}

// The kernels read contiguous or channels-last memory without copies; the caller makes anything else contiguous.
inline bool is_channels_last(const at::Tensor& x) {
  return !x.is_contiguous() && ((x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
                                (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)));
}

inline Geometry geometry_of(const at::Tensor& x, const char* name) {
  const bool cl = is_channels_last(x);
  TORCH_CHECK(cl || x.is_contiguous(), "inplace_abn: ", name, " must be contiguous or channels-last (got sizes ",
              x.sizes(), ", strides ", x.strides(), "); make it contiguous first");
  const int64_t N = x.size(0), C = x.size(1), numel = x.numel();
  return Geometry{N, C, N * C > 0 ? numel / (N * C) : 0, numel, cl};
}

// New tensors, on the CPU without the dispatcher round trips of at::empty and
// at::empty_like (~0.7k instructions each; a small layer's step allocates ten).
inline at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& o) {
  return o.device().is_cpu() ? at::Tensor(at::detail::empty_cpu(sizes, o)) : at::empty(sizes, o);
}
// t's sizes, dtype (or dtype) and memory layout, as at::empty_like(t, Preserve)
inline at::Tensor new_like(const at::Tensor& t, std::optional<at::ScalarType> dtype = std::nullopt) {
  const auto o = t.options().dtype(dtype.value_or(t.scalar_type()));
  if (!t.is_cpu() || !t.is_non_overlapping_and_dense()) return at::empty_like(t, o, at::MemoryFormat::Preserve);
  return at::detail::empty_strided_cpu(t.sizes(), t.strides(), o);
}

// Where a backward's two passes keep the SiLU inverse on the CPU (section 7.2): dx itself for float32 / float64 (the
// input pass writes dx over it); for bfloat16 / float16 a float32 buffer of its own (the compute type: y's dtype
// would round it), a transient of twice dx's size, not saved memory; undefined where nothing is kept.
inline at::Tensor kept_inverse(const at::Tensor& y, int64_t act, const at::Tensor& dx) {
  if (act != static_cast<int64_t>(Act::Silu) || !y.is_cpu()) return at::Tensor();
  return silu_keeps_z(y, act) ? dx : new_like(y, at::kFloat);
}

// `t` with ref's dtype and memory order: t itself when it has them, else a
// copy (a gradient may arrive in another layout, a residual in another dtype).
inline at::Tensor like(const at::Tensor& t, const at::Tensor& ref) {
  const bool same_order =
      is_channels_last(ref)
          ? t.is_contiguous(ref.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d)
          : t.is_contiguous();
  if (t.scalar_type() == ref.scalar_type() && same_order) return t;
  return new_like(ref).copy_(t);
}
inline at::Tensor like(const OptTensor& t, const at::Tensor& ref) { return t.has_value() ? like(*t, ref) : at::Tensor(); }

// t in dtype; no operator call when it already is (a same-dtype to() is still a
// dispatcher call, ~0.3 us: four per backward of a small layer)
inline at::Tensor cast(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// The backward of a ReLU layer (relu: y holds z, activation 0): the output gradient for the kernels and whether
// they apply ReLU's derivative to it as they read it (gz = dy where z > 0, else 0, as threshold_backward(dy, z, 0):
// one pass over memory less). The CPU kernels do; other devices get dy thresholded here.
inline std::pair<at::Tensor, bool> relu_dy(const at::Tensor& dy, const at::Tensor& y, Act act, bool relu) {
  TORCH_CHECK(!relu || act == Act::Identity, "inplace_abn: relu=True needs activation 0 (identity), got ",
              static_cast<int>(act));
  if (!relu || y.is_cpu()) return {dy, relu};
  return {at::threshold_backward(like(dy, y), y, 0), false};
}

// A (C,) vector of the CPU read as float64: contiguous float64 / float32 / bfloat16 / float16 tensors in place (a
// conversion costs one ATen call per vector and operator call: four per step of a bfloat16 layer), others through a
// float64 copy. Each of these types converts to double exactly: the same values either way.
class DoubleReader {
 public:
  explicit DoubleReader(const at::Tensor& t) : keep_(t) {  // (kept: t may be a temporary)
    const auto st = t.scalar_type();
    const bool direct = st == at::kDouble || st == at::kFloat || st == at::kBFloat16 || st == at::kHalf;
    if (!direct || !t.is_contiguous()) keep_ = t.to(at::kDouble).contiguous();
    type_ = keep_.scalar_type();
    p_ = keep_.const_data_ptr();
  }
  double operator[](int64_t c) const {
    switch (type_) {
      case at::kFloat:
        return static_cast<const float*>(p_)[c];
      case at::kBFloat16:
        return static_cast<float>(static_cast<const at::BFloat16*>(p_)[c]);
      case at::kHalf:
        return static_cast<float>(static_cast<const at::Half*>(p_)[c]);
      default:
        return static_cast<const double*>(p_)[c];
    }
  }

 private:
  at::Tensor keep_;
  at::ScalarType type_;
  const void* p_;
};

// The (rows, cols) coefficient table T of x's operator, in x's accumulation dtype, from its inputs in and scalars
// spec (channel_math.h gives all three); cols: x.size(1) unless given (GroupNorm: N C). The CPU fills it in one
// loop (no ATen op per formula: forward_ at 16x512x7x7 110 -> 99 us), a GPU in one launch.
template <Table T>
at::Tensor coef_table(const at::Tensor& x, const std::array<ChannelInput, table_inputs_of(T)>& in,
                      const TableSpec& spec, int64_t cols = -1) {
  constexpr size_t K = table_inputs_of(T);
  constexpr int R = table_rows_of(T);
  const auto acc = acc_type_of(x.scalar_type());
  const int64_t C = cols >= 0 ? cols : x.size(1);
  if (!x.is_cpu()) {
    at::Tensor table = at::empty({R, C}, x.options().dtype(acc));
    device_channel_stub(x).table(T, spec, in.data(), table);
    return table;
  }
  std::array<std::optional<DoubleReader>, K> rd;
  bool flat = true;  // BatchNorm: every input read at the column itself
  for (size_t k = 0; k < K; ++k) {
    if (in[k].t.has_value()) rd[k].emplace(*in[k].t);  // (read flat: (N, G) statistics too)
    flat = flat && in[k].div == 1 && in[k].mod == 0;
  }
  at::Tensor table = new_empty({R, C}, x.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "coef_table", [&] {
    scalar_t* out = table.template data_ptr<scalar_t>();
    auto put = [&](int64_t c, const double* vc) {
      double rw[R];
      table_column<T>(spec, vc, rw);
      for (int i = 0; i < R; ++i) out[i * C + c] = static_cast<scalar_t>(rw[i]);
    };
    constexpr int64_t kGrain = 2048;  // columns per task; fewer run on the calling thread
    // BatchNorm's columns without the bookkeeping below, which the compiler kept in the loop (~5k instructions more)
    if (flat && C < kGrain) {
      for (int64_t c = 0; c < C; ++c) {
        double vc[K];
        for (size_t k = 0; k < K; ++k) vc[k] = rd[k] ? (*rd[k])[c] : in[k].fill;
        put(c, vc);
      }
      return;
    }
    // GroupNorm's N C columns: split across threads, the entries read (q, r: k = q div + r) counted on instead of
    // divided per column (the serial loop was 3x the forward_ kernel at 8x512x8x8, 32 groups)
    at::parallel_for(0, C, kGrain, [&](int64_t c0, int64_t c1) {
      std::array<int64_t, K> q, r;
      for (size_t k = 0; k < K; ++k) {
        q[k] = c0 / in[k].div;
        r[k] = c0 - q[k] * in[k].div;
        if (in[k].mod) q[k] %= in[k].mod;
      }
      for (int64_t c = c0; c < c1; ++c) {
        double vc[K];
        for (size_t k = 0; k < K; ++k) {
          vc[k] = rd[k] ? (*rd[k])[q[k]] : in[k].fill;
          if (++r[k] == in[k].div) {
            r[k] = 0;
            if (++q[k] == in[k].mod) q[k] = 0;
          }
        }
        put(c, vc);
      }
    });
  });
  return table;
}

// A view of t's memory with these sizes and strides, `offset` elements on, made without the dispatcher: the
// GroupNorm mode's per-sample arguments, where narrow, select and movedim made a small channels-last layer 2.4x
// the contiguous one. The kernels only read such views.
inline at::Tensor raw_view(const at::Tensor& t, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(),
                                                   t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset() + offset);
  return at::Tensor(std::move(impl));
}

// Entries [n len, (n + 1) len) of dim 0 of t (len = 1 without keep_dim: t.select(0, n)); undefined or empty stays so.
inline at::Tensor part(const at::Tensor& t, int64_t n, int64_t len, bool keep_dim) {
  if (!t.defined() || !t.numel()) return t;
  auto sizes = t.sizes().vec(), strides = t.strides().vec();
  sizes[0] = len;
  if (!keep_dim) sizes.erase(sizes.begin()), strides.erase(strides.begin());
  return raw_view(t, sizes, strides, n * len * t.stride(0));
}

// GroupNorm mode of the operators (groups > 0; docs/DESIGN.md section 10). A contiguous (N, C, *) input is the
// BatchNorm input (1, N C, S) whose channel k = n C + c takes the statistics of (n, group c / (C / G)), entry
// k / (C / G) of the (N, G) statistics, and the parameters of channel c = k % C. A channels-last input, whose
// (n, c) planes are not adjacent in memory, runs sample by sample (per_sample): the kernels see x[n]
// (channels-last (1, C, *)) with columns n C .. n C + C - 1 of the same N C-column table, and the SiLU mask is
// the samples' masks, each padded to whole 32-bit words; on the CPU the samples are spread over the threads (the
// results do not depend on it). groups = 0: BatchNorm, x as it is.
struct Groups {
  int64_t G = 0, N = 0, C = 0;
  bool per_sample = false;
  explicit Groups(const at::Tensor& x, int64_t groups) : G(groups) {
    TORCH_CHECK(groups >= 0, "inplace_abn: groups must be >= 0, got ", groups);
    if (!G) return;
    N = x.size(0), C = x.size(1);
    TORCH_CHECK(C % G == 0, "inplace_abn: groups=", G, " does not divide the ", C, " channels");
    per_sample = is_channels_last(x);
    TORCH_CHECK(per_sample || x.is_contiguous(),
                "inplace_abn: groups > 0 (GroupNorm) needs a contiguous or channels-last input, got strides ",
                x.strides());
  }
  // What the kernels see (of x or a tensor in x's shape and layout; undefined stays so).
  at::Tensor view(const at::Tensor& t) const {
    return G && !per_sample && t.defined() && t.numel() ? t.view({1, N * C, -1}) : t;
  }
  // Columns of the coefficient table.
  int64_t columns(const at::Tensor& x) const { return G ? N * C : x.size(1); }
  // Words of the SiLU mask of x.
  int64_t mask_size(const at::Tensor& x) const {
    return per_sample && N > 0 ? N * mask_words(x.numel() / N) : mask_words(x.numel());
  }
  // A per-group (N, G) statistic: N G values on x's device, read at k / (C / G).
  ChannelInput stat(const OptTensor& t, double fill, const at::Tensor& x, const char* name) const {
    if (!G || !t.has_value()) {
      check_channel_vector(t, x, name);
      return {t, fill};
    }
    TORCH_CHECK(t->numel() == N * G && t->device() == x.device() && at::isFloatingType(t->scalar_type()),
                "inplace_abn: ", name, " must hold N * groups = ", N * G, " floating point values on ", x.device(),
                ", got ", t->sizes(), " ", t->scalar_type(), " on ", t->device());
    return {t, fill, C / G};
  }
  // A per-channel (C,) parameter, read at k % C.
  ChannelInput param(const OptTensor& t, double fill, const at::Tensor& x, const char* name) const {
    check_channel_vector(t, x, name);
    return {t, fill, 1, G ? C : 0};
  }
  // Runs stub on a, or (per_sample) on each sample's part of a: x, source, dy, residual,
  // z and the mask words of sample n, its table columns, and out1 / out2 as
  // rows n of (N, ...) results (rows_out) or samples n of x-shaped ones.
  void run(const KernelStub& stub, const KernelArgs& a, bool rows_out) const {
    if (!per_sample) return stub(a);
    if (a.mask.defined() && a.mask.numel())
      TORCH_CHECK(a.mask.numel() >= mask_size(a.x), "inplace_abn: mask has ", a.mask.numel(), " words, need ",
                  mask_size(a.x), " (the samples' masks, each padded to whole words)");
    // the table's columns n C .. n C + C - 1 as sample n's (rows, C) table
    const at::Tensor tables = a.coef.view({a.coef.size(0), N, C}).permute({1, 0, 2}).contiguous();
    const int64_t words = mask_words(N > 0 ? a.x.numel() / N : 0);
    auto sample = [&](const at::Tensor& t, int64_t n) { return part(t, n, 1, true); };
    auto out = [&](const at::Tensor& t, int64_t n) { return part(t, n, 1, !rows_out); };
    std::vector<KernelArgs> parts(N, a);
    for (int64_t n = 0; n < N; ++n) {
      KernelArgs& p = parts[n];
      p.x = sample(a.x, n), p.dy = sample(a.dy, n), p.residual = sample(a.residual, n), p.z = sample(a.z, n);
      p.source = sample(a.source, n);
      p.mask = part(a.mask, n, words, true);
      p.coef = part(tables, n, 1, false);
      p.out1 = out(a.out1, n), p.out2 = out(a.out2, n);
      p.g = geometry_of(p.x, "x");
    }
    for_samples(N, a.x.is_cpu(), [&](int64_t n) { stub(parts[n]); });
  }
  // fn(n) for n < N; on the CPU spread over the threads, each call then running on one
  // (at::parallel_for nests inline): small samples gain most, and results are the same.
  template <class Fn>
  static void for_samples(int64_t N, bool cpu, const Fn& fn) {
    if (cpu && N > 1) {
      at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) fn(n);
      });
    } else {
      for (int64_t n = 0; n < N; ++n) fn(n);
    }
  }
};

// Front ends compute their tables under this guard: internal tensors, no
// autograd or version-counter bookkeeping (1.5 us less per operator call).
using TableGuard = c10::InferenceMode;

// The parts of batch_stats and forward_ that bn_forward (their fusion) shares with them:
// batch_stats' checks of x and the running statistics in the BatchNorm mode; returns the count n = numel / C.
int64_t check_batch_stats(const at::Tensor& x, const OptTensor& running_mean, const OptTensor& running_var);
// The running statistics moved towards the batch's mean and var, as torch.nn.BatchNorm (n = 0: left as they are).
void update_running_stats(const at::Tensor& x, const OptTensor& running_mean, const OptTensor& running_var,
                          const at::Tensor& mean, const at::Tensor& var, int64_t n, double momentum);
// forward_'s checks of residual, z_out and source against x (already checked: check_input); returns the
// (uninitialised) SiLU mask, empty for the others.
at::Tensor check_forward(const at::Tensor& x, const OptTensor& residual, Act act, const OptTensor& z_out,
                         const Groups& grp, const OptTensor& source);

}  // namespace inplace_abn
