// The operator schemas of In-Place ABN, in one place: src/ops.cpp declares
// them for the inplace_abn library, the CUDA emulator (src/cuda/emu) for its
// own test library. DESIGN.md section 7.
#pragma once

#include <torch/library.h>

namespace inplace_abn {

inline void define_schemas(torch::Library& m) {
  // Per-channel batch statistics over all dims but 1: (mean, biased var),
  // float32 for float/half/bfloat16 inputs, float64 for double.
  m.def("batch_stats(Tensor x) -> (Tensor mean, Tensor var)");
  // y = f(g~ (x - mean) / sqrt(var + eps) + beta [+ residual]) written into x.
  // Returns the packed SiLU branch mask (int32, ceil(numel/32) words in memory
  // order of x), empty for other activations.
  m.def(
      "forward_(Tensor(a!) x, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, "
      "float eps, int activation, float activation_param, bool signed_weight) -> Tensor mask");
  // Per-channel S_g = sum gz and S_gx = sum gz * xhat, from y alone.
  m.def(
      "backward_reduce(Tensor y, Tensor dy, Tensor mask, Tensor? weight, Tensor? bias, Tensor? residual, "
      "float eps, int activation, float activation_param, bool signed_weight) -> (Tensor sum_gz, Tensor sum_gz_xhat)");
  // dx = g~ r (gz - mean_gz - xhat * mean_gz_xhat); with residual_grad also
  // returns gz (the residual's gradient), else an empty tensor.
  m.def(
      "backward_input(Tensor y, Tensor dy, Tensor mask, Tensor var, Tensor? weight, Tensor? bias, "
      "Tensor? residual, Tensor mean_gz, Tensor mean_gz_xhat, float eps, int activation, "
      "float activation_param, bool signed_weight, bool residual_grad) -> (Tensor dx, Tensor dresidual)");
}

}  // namespace inplace_abn
