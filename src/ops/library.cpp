// The inplace_abn operator library: its schemas, declared once for every device, and the CPU registration of the front ends (the CUDA
// build adds src/cuda/register.cpp). Fake kernels and autograd live in Python
// (inplace_abn/_backend.py, inplace_abn/functions.py). docs/DESIGN.md section 7.
#include <Python.h>
#include <torch/library.h>

#include "ops/ops.h"

// Importing inplace_abn._C from Python loads this library and so runs the
// registrations below; the module itself has no Python-level contents.
PyMODINIT_FUNC PyInit__C(void) {  // PyMODINIT_FUNC: exported despite -fvisibility=hidden
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(inplace_abn, m) {
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
      "float eps, int activation, float activation_param, bool signed_weight, Tensor(b!)? z_out=None) "
      "-> (Tensor sum_gz, Tensor sum_gz_xhat)");
  // dx = g~ r (gz - mean_gz - xhat * mean_gz_xhat); with residual_grad also
  // returns gz (the residual's gradient), else an empty tensor.
  m.def(
      "backward_input(Tensor y, Tensor dy, Tensor mask, Tensor var, Tensor? weight, Tensor? bias, "
      "Tensor? residual, Tensor mean_gz, Tensor mean_gz_xhat, float eps, int activation, "
      "float activation_param, bool signed_weight, bool residual_grad) -> (Tensor dx, Tensor dresidual)");
  // SiLU on the CPU, float32/float64 (docs/DESIGN.md section 7.2): backward_reduce
  // stored z = f^-1(y) in z_out; the dx of backward_input from z, written over z
  // (so the second pass skips the inversion and allocates nothing). Returns dresidual.
  m.def(
      "backward_input_from_z_(Tensor(a!) z, Tensor dy, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, "
      "Tensor mean_gz, Tensor mean_gz_xhat, float eps, int activation, float activation_param, bool signed_weight, "
      "bool residual_grad) -> Tensor dresidual");
}

TORCH_LIBRARY_IMPL(inplace_abn, CPU, m) {
  IABN_IMPL_ALL(m);
  IABN_IMPL_CPU_ONLY(m);
}
