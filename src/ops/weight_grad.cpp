// inplace_abn::weight_grad: dweight = S_gx dg~/dweight (docs/DESIGN.md section
// 2) in the weight's dtype, one call instead of sign, multiply and cast.
#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {

at::Tensor weight_grad(const at::Tensor& sum_gz_xhat, const at::Tensor& weight, bool signed_weight) {
  TORCH_CHECK(weight.dim() == 1 && sum_gz_xhat.dim() == 1 && sum_gz_xhat.size(0) == weight.size(0),
              "inplace_abn: weight_grad needs a (C,) weight and (C,) sums, got ", weight.sizes(), " and ",
              sum_gz_xhat.sizes());
  TORCH_CHECK(sum_gz_xhat.device() == weight.device(), "inplace_abn: sum_gz_xhat is on ", sum_gz_xhat.device(),
              " but weight is on ", weight.device());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()) && at::isFloatingType(sum_gz_xhat.scalar_type()),
              "inplace_abn: weight_grad needs floating point tensors, got ", sum_gz_xhat.scalar_type(), " and ",
              weight.scalar_type());
  c10::OptionalDeviceGuard guard(weight.device());
  at::Tensor out = new_empty({weight.size(0)}, weight.options());
  if (signed_weight) return out.copy_(sum_gz_xhat);  // dg~/dweight = 1
  if (!weight.is_cpu()) {  // one launch, no host sync
    device_channel_stub(weight).weight_grad(sum_gz_xhat, weight.detach(), out);
    return out;
  }
  // CPU: one loop (the weight's sign taken in the sums' dtype, as on a GPU; a narrower weight converts exactly)
  const DoubleReader sp(sum_gz_xhat);
  const auto st = sum_gz_xhat.scalar_type();
  const bool exact = c10::promoteTypes(weight.scalar_type(), st) == st;
  const DoubleReader wp(exact ? weight.detach() : weight.detach().to(st));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "weight_grad", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t c = 0; c < out.numel(); ++c) op[c] = static_cast<scalar_t>(abs_weight_grad(sp[c], wp[c]));
  });
  return out;
}

}  // namespace inplace_abn
