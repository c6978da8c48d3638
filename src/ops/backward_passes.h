// The two passes of the backward front ends, after their checks: backward_reduce and backward_input(_from_z_) each
// run one, bn_backward runs both behind one front end. The caller holds the device guard and the TableGuard, and
// has allocated the outputs.
#pragma once

#include "ops/common.h"

namespace inplace_abn {

// The coefficient-table inputs of the input pass, checked: var, weight, bias, mean_gz_xhat, mean_gz; sums_scale = 0
// (eval: the statistics are constants) drops the sums, whatever they hold.
std::array<ChannelInput, 5> input_args(const at::Tensor& y, const Groups& grp, const at::Tensor& var,
                                       const OptTensor& weight, const OptTensor& bias, const OptTensor& mean_gz,
                                       const OptTensor& mean_gz_xhat, double sums_scale);

// The reduce pass: sum_gz, sum_gz_xhat (and into z when defined, what the input pass needs of f^-1(y) besides y).
// gy: dy as the kernels read it (relu_dy, in y's dtype and layout); res: the residual likewise, or undefined.
void reduce_pass(const Groups& grp, const at::Tensor& y, const at::Tensor& gy, bool kernel_relu,
                 const at::Tensor& mask, const OptTensor& weight, const OptTensor& bias, const at::Tensor& res,
                 double eps, Act act, double param, bool signed_weight, const at::Tensor& z, const at::Tensor& sum_gz,
                 const at::Tensor& sum_gz_xhat);

// The input pass: dx into dx, gz into dres when defined. kept, when defined: what the reduce pass kept in its z, in
// the compute type (y's shape and layout), read before dx is written (kept may be dx itself, float32 / float64).
// g: y's geometry (BatchNorm; GroupNorm takes that of the view).
void input_pass(const Groups& grp, const at::Tensor& y, const at::Tensor& gy, bool kernel_relu,
                const at::Tensor& kept, const at::Tensor& mask, const std::array<ChannelInput, 5>& in, bool has_weight, const at::Tensor& res,
                double eps, Act act, double param, bool signed_weight, double sums_scale, const at::Tensor& dx,
                const at::Tensor& dres, const Geometry& g);

}  // namespace inplace_abn
