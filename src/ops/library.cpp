// The inplace_abn operator library: its schemas, declared once for every device, and the CPU registration of the
// front ends (the CUDA build adds src/cuda/register.cpp). Fake kernels live in Python (inplace_abn/_backend.py);
// autograd in src/ops/autograd.cpp (the layers, and the operators' refusing kernels) and inplace_abn/functions.py.
// docs/DESIGN.md section 7.
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
  // Per-channel batch statistics over all dims but 1: (mean, biased var), float32 for float/half/bfloat16 inputs,
  // float64 for double. Given running statistics, also moves them as torch.nn.BatchNorm does, with the count
  // n = numel / C of x: r <- (1 - momentum) r + momentum s, s the mean and the unbiased var n / (n - 1) var;
  // n = 0 leaves them, n = 1 is refused. groups > 0 (GroupNorm, no running statistics): (N, groups) statistics
  // per (sample, group of C / groups consecutive channels), x contiguous or channels-last.
  m.def(
      "batch_stats(Tensor x, Tensor(a!)? running_mean=None, Tensor(b!)? running_var=None, float momentum=0.0, "
      "int groups=0) -> (Tensor mean, Tensor var)");
  // y = f(g~ (x - mean) / sqrt(var + eps) + beta [+ residual]) written into x. Returns the packed SiLU branch mask
  // (int32, ceil(numel/32) words in memory order of x), empty for other activations. With z_out (activation 0,
  // identity, only): z_out receives the pre-activation z (accumulation dtype, x's shape and layout) and x receives
  // max(z, 0): the non-invertible ReLU, whose backward needs z (docs/DESIGN.md section 3). With source (x's shape,
  // dtype and layout, sharing no memory with x): the input is read from source and x only receives y, the
  // out-of-place form (inplace_agn below).
  m.def(
      "forward_(Tensor(a!) x, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, "
      "float eps, int activation, float activation_param, bool signed_weight, Tensor(b!)? z_out=None, int groups=0, "
      "Tensor? source=None) -> Tensor mask");
  // The local layer's training forward in one call, as native_batch_norm: batch_stats (moving the running
  // statistics, if given) and forward_ with the batch's statistics, which it returns with forward_'s mask (mean and
  // biased var in the accumulation dtype). The arguments are batch_stats' and forward_'s; source, when given, is the
  // input (the out-of-place form) and x only receives y.
  m.def(
      "bn_forward_(Tensor(a!) x, Tensor? weight, Tensor? bias, Tensor(b!)? running_mean, Tensor(c!)? running_var, "
      "Tensor? residual, float momentum, float eps, int activation, float activation_param, bool signed_weight, "
      "Tensor(d!)? z_out=None, Tensor? source=None) -> (Tensor mask, Tensor mean, Tensor var)");
  // The functional twins of forward_ and bn_forward_, for compiled graphs: x is only read, y is a new tensor in x's
  // layout (contiguous where the kernels cannot walk x's), z receives ReLU's pre-activation (keep_z, activation 0;
  // accumulation dtype, y's layout) or is empty. bn_forward takes no running statistics (a graph updates them
  // itself). flexible_layout: inductor hands x over in the layout it chose (channels-last after its CPU
  // convolutions) instead of copying it to the strides seen while tracing (src/ops/functional_forward.cpp).
  m.def(
      "forward(Tensor x, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, float eps, "
      "int activation, float activation_param, bool signed_weight, bool keep_z=False, int groups=0) "
      "-> (Tensor y, Tensor z, Tensor mask)",
      {at::Tag::flexible_layout});
  m.def(
      "bn_forward(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, int activation, "
      "float activation_param, bool signed_weight, bool keep_z=False) "
      "-> (Tensor y, Tensor z, Tensor mask, Tensor mean, Tensor var)",
      {at::Tag::flexible_layout});
  // Per-channel S_g = sum gz and S_gx = sum gz * xhat, from y alone. relu (with
  // activation 0): y holds the z of a ReLU layer (forward_'s z_out) and gz = dy
  // where z > 0, else 0, as threshold_backward(dy, z, 0) first (CPU: in the same pass).
  m.def(
      "backward_reduce(Tensor y, Tensor dy, Tensor mask, Tensor? weight, Tensor? bias, Tensor? residual, "
      "float eps, int activation, float activation_param, bool signed_weight, Tensor(b!)? z_out=None, int groups=0, "
      "bool relu=False) -> (Tensor sum_gz, Tensor sum_gz_xhat)");
  // dx = g~ r (gz - k mean_gz - xhat * k mean_gz_xhat), k = sums_scale (so the raw sums S_g, S_gx may be passed
  // with k = 1 / n; k = 0 drops both terms whatever their values: eval mode); with residual_grad also returns gz
  // (the residual's gradient), else an empty tensor. relu: as backward_reduce.
  m.def(
      "backward_input(Tensor y, Tensor dy, Tensor mask, Tensor var, Tensor? weight, Tensor? bias, "
      "Tensor? residual, Tensor mean_gz, Tensor mean_gz_xhat, float eps, int activation, "
      "float activation_param, bool signed_weight, bool residual_grad, float sums_scale=1.0, int groups=0, "
      "bool relu=False) -> (Tensor dx, Tensor dresidual)");
  // dweight = sum_gz_xhat dg~/dweight in weight's dtype: sign(weight) (0 at 0)
  // in abs mode, 1 in signed mode (docs/DESIGN.md section 2).
  m.def("weight_grad(Tensor sum_gz_xhat, Tensor weight, bool signed_weight) -> Tensor");
  // The whole backward of the local BatchNorm layer (the backward of inplace_abn(_)), one call as
  // native_batch_norm_backward: backward_reduce's sums where dweight, dbias or (training) dx / dresidual need them,
  // backward_input with the sums scaled by 1/n (training) or dropped (eval: the statistics are constants), and
  // weight_grad. output_mask: (dx, dweight, dbias, dresidual); an output left out is an empty tensor. dx is in y's
  // dtype (relu: z's). With dx_out (y's shape and strides, dx's dtype; it may be dy itself, each of whose elements is
  // read before dx is written over it): dx is written there and the dx output is empty. The C++ layer passes dy
  // on the CPU when nothing else holds it, so that dx takes lines already cached instead of fresh memory.
  // flexible_layout: in a compiled graph y comes in the layout the functional forward gave it, dy in the graph's
  // (converted to y's here where it differs), with no copy to the traced strides.
  m.def(
      "bn_backward(Tensor y, Tensor dy, Tensor mask, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, "
      "float eps, int activation, float activation_param, bool signed_weight, bool training, bool[4] output_mask, "
      "bool relu=False, Tensor(e!)? dx_out=None) -> (Tensor dx, Tensor dweight, Tensor dbias, Tensor dresidual)",
      {at::Tag::flexible_layout});
  // The whole local layer with its autograd in C++ (src/ops/autograd.cpp): batch statistics and running-statistics
  // update (training), forward_ into x; the backward is one bn_backward call. relu: the non-invertible ReLU
  // (activation 0), whose z is kept for backward. Given num_batches_tracked, adds 1 to it once the layer has run
  // (the module's count).
  m.def(
      "inplace_abn_(Tensor(a!) x, Tensor? weight, Tensor? bias, Tensor(b!)? running_mean, Tensor(c!)? running_var, "
      "Tensor? residual, bool training, float momentum, float eps, int activation, float activation_param, "
      "bool signed_weight, bool relu=False, Tensor(d!)? num_batches_tracked=None) -> Tensor(a!)");
  // The same layer out of place (preserve_input): y in a new tensor in x's layout,
  // x left as it is, y alone kept for backward, for an input read again after it.
  m.def(
      "inplace_abn(Tensor x, Tensor? weight, Tensor? bias, Tensor(b!)? running_mean, Tensor(c!)? running_var, "
      "Tensor? residual, bool training, float momentum, float eps, int activation, float activation_param, "
      "bool signed_weight, bool relu=False, Tensor(d!)? num_batches_tracked=None) -> Tensor");
  // The GroupNorm layer (x contiguous or channels-last) with its autograd in C++ (the BatchNorm
  // operators in their GroupNorm mode; docs/DESIGN.md section 10).
  m.def(
      "inplace_agn_(Tensor(a!) x, Tensor? weight, Tensor? bias, Tensor? residual, int groups, float eps, "
      "int activation, float activation_param, bool signed_weight) -> Tensor(a!)");
  // The same layer out of place (preserve_input), as inplace_abn: for an input read
  // again after it (a diffusers ResnetBlock2D's norm1, whose block input the shortcut reads).
  m.def(
      "inplace_agn(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, int groups, float eps, "
      "int activation, float activation_param, bool signed_weight) -> Tensor");
  // SiLU on the CPU (docs/DESIGN.md section 7.2): backward_reduce kept in z_out what the
  // second pass needs of z = f^-1(y) besides y, in the compute type; the dx of backward_input
  // from y and it (no inversion), written over it, or into dx_out (y's dtype and layout): a
  // bfloat16 / float16 y keeps z in float32 and needs dx_out. Returns dresidual.
  m.def(
      "backward_input_from_z_(Tensor(a!) z, Tensor y, Tensor dy, Tensor var, Tensor? weight, Tensor? bias, "
      "Tensor? residual, Tensor mean_gz, Tensor mean_gz_xhat, float eps, int activation, float activation_param, "
      "bool signed_weight, bool residual_grad, float sums_scale=1.0, int groups=0, Tensor(b!)? dx_out=None) "
      "-> Tensor dresidual");
  // The GroupNorm backward (groups > 0; docs/DESIGN.md section 10): dx, dresidual
  // (empty without residual_grad) and the per-channel sums over the batch S_g =
  // sum gz, S_gx = sum gz xhat; one pass over memory for a contiguous y on the CPU. flexible_layout: as
  // bn_backward.
  m.def(
      "gn_backward(Tensor y, Tensor dy, Tensor mask, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, "
      "int groups, float eps, int activation, float activation_param, bool signed_weight, bool residual_grad) "
      "-> (Tensor dx, Tensor dresidual, Tensor sum_gz, Tensor sum_gz_xhat)",
      {at::Tag::flexible_layout});
}

TORCH_LIBRARY_IMPL(inplace_abn, CPU, m) {
  IABN_IMPL_ALL(m);
  IABN_IMPL_CPU_ONLY(m);
}
