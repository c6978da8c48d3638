// Shared declarations of the native backend: operator argument checks and
// helpers used by both the CPU and the CUDA implementations.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include "activations.h"

namespace inplace_abn {

// Accumulation / statistics dtype: float32 for float, half and bfloat16 inputs,
// float64 for double (DESIGN.md section 4).
inline at::ScalarType acc_type_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

inline Act to_act(int64_t a) {
  TORCH_CHECK(a >= 0 && a <= 3, "inplace_abn: unknown activation code ", a);
  return static_cast<Act>(a);
}

// Number of 32-bit words of the packed SiLU branch mask for `numel` elements.
inline int64_t mask_words(int64_t numel) { return (numel + 31) / 32; }

// Checks shared by every operator: a floating input with at least 2 dims,
// per-channel tensors of length C on the same device.
inline void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 2, "inplace_abn: ", name, " must have at least 2 dimensions (N, C, ...), got ",
              x.dim());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "inplace_abn: ", name,
              " must be a floating point tensor, got ", x.scalar_type());
}

inline void check_channel_vector(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(1), "inplace_abn: ", name, " must have shape (",
              x.size(1), ",), got ", t->sizes());
  TORCH_CHECK(t->device() == x.device(), "inplace_abn: ", name, " is on ", t->device(), " but the input is on ",
              x.device());
}

inline void check_like(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->sizes() == x.sizes(), "inplace_abn: ", name, " must have the input's shape ", x.sizes(),
              ", got ", t->sizes());
  TORCH_CHECK(t->device() == x.device(), "inplace_abn: ", name, " is on ", t->device(), " but the input is on ",
              x.device());
}

// The backward inverts the activation: leaky_relu and elu need a parameter > 0.
inline void check_backward_param(Act act, double param) {
  if (act == Act::LeakyRelu)
    TORCH_CHECK(param > 0, "inplace_abn: leaky_relu needs a slope > 0 to be inverted in backward, got ", param);
  if (act == Act::Elu)
    TORCH_CHECK(param > 0, "inplace_abn: elu needs alpha > 0 to be inverted in backward, got ", param);
}

// The packed SiLU branch mask written by forward_ for y (DESIGN.md section 3).
inline void check_mask(const at::Tensor& mask, const at::Tensor& y, Act act) {
  if (act != Act::Silu) return;
  TORCH_CHECK(mask.device() == y.device(), "inplace_abn: mask is on ", mask.device(), " but the input is on ",
              y.device());
  TORCH_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 1 && mask.is_contiguous(),
              "inplace_abn: mask must be a contiguous 1-D int32 tensor, got ", mask.scalar_type(), " ",
              mask.sizes());
  TORCH_CHECK(mask.numel() >= mask_words(y.numel()), "inplace_abn: mask has ", mask.numel(), " words, need ",
              mask_words(y.numel()), " for ", y.numel(), " elements");
}

// Checks shared by backward_reduce and backward_input on every device (the
// caller checks y's device); returns the activation.
inline Act check_backward_args(const at::Tensor& y, const at::Tensor& dy, const at::Tensor& mask,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual, int64_t activation,
                               double activation_param) {
  check_input(y, "y");
  const Act act = to_act(activation);
  check_backward_param(act, activation_param);
  check_like(dy, y, "dy");
  check_channel_vector(weight, y, "weight");
  check_channel_vector(bias, y, "bias");
  check_like(residual, y, "residual");
  check_mask(mask, y, act);
  return act;
}

// Memory layout the kernels understand without copies: contiguous (N, C, S)
// or channels-last (N, S, C). Anything else must be made contiguous by the caller.
enum class Layout { Contiguous, ChannelsLast, Other };

inline Layout layout_of(const at::Tensor& x) {
  if (x.is_contiguous()) return Layout::Contiguous;
  if (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) return Layout::ChannelsLast;
  if (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return Layout::ChannelsLast;
  return Layout::Other;
}

}  // namespace inplace_abn
