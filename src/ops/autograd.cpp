// inplace_abn::inplace_abn_: a local (unsynchronised) In-Place ABN layer with its autograd in C++, the steps of
// _InPlaceABNFunction in inplace_abn/functions.py (still the path for torch.compile, the synchronised layer and the
// pure backend). Eager native calls come here, saving the Python autograd.Function and its Python-level op calls:
// ~25 us of host time per training step (docs/DESIGN.md section 7.3). The argument checks stay in Python (they
// raise before anything is written). inplace_agn_: the same for the GroupNorm layer (section 10); inplace_abn and
// inplace_agn: the two layers out of place (preserve_input).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace inplace_abn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The operators, called through the dispatcher (not the C++ front ends
// directly) so that dispatch modes, profilers and op counts see them.
template <auto& Fn>
auto handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<std::remove_reference_t<decltype(Fn)>>();
}
struct Ops {
  decltype(handle<batch_stats>("")) stats = handle<batch_stats>("inplace_abn::batch_stats");
  decltype(handle<forward_>("")) fwd = handle<forward_>("inplace_abn::forward_");
  decltype(handle<bn_forward_>("")) bn_fwd = handle<bn_forward_>("inplace_abn::bn_forward_");
  decltype(handle<forward>("")) fwd_functional = handle<forward>("inplace_abn::forward");
  decltype(handle<bn_forward>("")) bn_fwd_functional = handle<bn_forward>("inplace_abn::bn_forward");
  decltype(handle<backward_reduce>("")) reduce = handle<backward_reduce>("inplace_abn::backward_reduce");
  decltype(handle<backward_input>("")) input = handle<backward_input>("inplace_abn::backward_input");
  decltype(handle<backward_input_from_z_>("")) input_z =
      handle<backward_input_from_z_>("inplace_abn::backward_input_from_z_");
  decltype(handle<weight_grad>("")) wgrad = handle<weight_grad>("inplace_abn::weight_grad");
  decltype(handle<gn_backward>("")) gn = handle<gn_backward>("inplace_abn::gn_backward");
  decltype(handle<bn_backward>("")) bn = handle<bn_backward>("inplace_abn::bn_backward");
};
const Ops& ops() {
  static const Ops o;
  return o;
}

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The layers differentiate their operator calls themselves, so these skip the operators' Autograd kernel (NoGrad
// below) and its argument checks (~3k of ~460k instructions per step), still through the dispatcher so that
// dispatch modes, fake tensors and the profiler see them.
using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;

// Index of the autograd edge of each tensor argument (undefined optionals have none).
struct Edges {
  int64_t x = 0, weight = -1, bias = -1, residual = -1;
  Edges(const OptTensor& w, const OptTensor& b, const OptTensor& rm, const OptTensor& rv, const OptTensor& r) {
    int64_t n = 1;
    auto next = [&](const OptTensor& t) { return t.has_value() && t->defined() ? n++ : int64_t(-1); };
    weight = next(w);
    bias = next(b);
    next(rm);
    next(rv);
    residual = next(r);
  }
};

// What both layers keep for backward: the output (or ReLU's z), the variance, the parameters, the residual and the
// mask; integer and float settings. x is marked dirty (written in place) unless undefined (the out-of-place layer).
void save(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& y, const at::Tensor& var,
          const OptTensor& weight, const OptTensor& bias, const OptTensor& residual, const at::Tensor& mask,
          std::vector<int64_t> ints, double eps, double param) {
  ctx->save_for_backward({y, var, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                          residual.value_or(at::Tensor()), mask});
  ctx->saved_data["i"] = std::move(ints);
  ctx->saved_data["f"] = std::vector<double>{eps, param};
  if (x.defined()) ctx->mark_dirty({x});
}

struct Saved {
  at::Tensor y, var, weight, bias, residual, mask;
  std::vector<int64_t> i;
  double eps, p;
  // The backward is written with the operators and is not itself differentiable:
  // refuse create_graph=True rather than drop second derivatives.
  Saved(AutogradContext* ctx, const char* op, const char* twin) {
    TORCH_CHECK(!at::GradMode::is_enabled(), op,
                " does not support double backward (create_graph=True, e.g. a gradient penalty): its backward is "
                "not differentiable, so second derivatives would be wrong. Use the non-in-place ",
                twin, " where second derivatives are needed");
    const auto s = ctx->get_saved_variables();
    y = s[0], var = s[1], weight = s[2], bias = s[3], residual = s[4], mask = s[5];
    i = ctx->saved_data["i"].toIntVector();
    const auto f = ctx->saved_data["f"].toDoubleVector();
    eps = f[0], p = f[1];
  }
};

// num_batches_tracked += 1 (the module's counter, once the layer has run); on the CPU without an operator call
// (from Python, add_ was ~2 us of a small layer's ~20 us forward).
void count_batch(const at::Tensor& counter) {
  if (counter.is_cpu() && counter.scalar_type() == at::kLong && counter.numel() == 1 && !counter.is_inference()) {
    ++*counter.data_ptr<int64_t>();
    counter.unsafeGetTensorImpl()->bump_version();
  } else {
    const at::NoGradGuard no_grad;
    counter.add_(1);
  }
}

// Whether the layer's backward may write dx over dy: a plain (not a view) tensor laid out as y, whose memory nothing
// but this reference holds (the autograd engine moved it to us: no hook, retained grad or other consumer keeps it),
// as AccumulateGrad decides to steal a gradient.
bool dy_is_free(const at::Tensor& dy, const at::Tensor& y) {
  return dy.defined() && dy.use_count() == 1 && !dy.is_view() && dy.storage().use_count() == 1 &&
         dy.scalar_type() == y.scalar_type() && dy.device() == y.device() && dy.sizes() == y.sizes() &&
         dy.strides() == y.strides() && !dy.requires_grad() && !dy._fw_grad(0).defined();
}

// out_of_place (inplace_abn, the op without the underscore): y in a new tensor, x
// read as forward_'s source and left as it is (as InPlaceAGNFunction below).
struct InPlaceABNFunction : torch::autograd::Function<InPlaceABNFunction> {
  // relu: the non-invertible activation (act must be 0): z is kept, y gets max(z, 0)
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, const OptTensor& weight, const OptTensor& bias,
                            const OptTensor& running_mean, const OptTensor& running_var, const OptTensor& residual,
                            bool training, double momentum, double eps, int64_t act, double param,
                            bool signed_weight, bool relu, const OptTensor& num_batches_tracked, bool out_of_place) {
    std::optional<BelowAutograd> below(std::in_place);
    const at::Tensor y = out_of_place ? at::empty_like(x, at::MemoryFormat::Preserve) : x;
    const OptTensor source = out_of_place ? OptTensor(x) : std::nullopt;
    // relu: z in the accumulation dtype, in x's layout (docs/DESIGN.md section 3)
    const at::Tensor saved = relu ? at::empty_like(x, x.options().dtype(acc_type_of(x.scalar_type()))) : y;
    const OptTensor z_out = relu ? OptTensor(saved) : std::nullopt;
    at::Tensor mean, var, mask;
    if (training) {  // (the count check is the caller's; bn_forward_ moves the running statistics)
      std::tie(mask, mean, var) = ops().bn_fwd.call(y, weight, bias, running_mean, running_var, residual, momentum,
                                                    eps, act, param, signed_weight, z_out, source);
    } else {  // a copy: a later update of the running statistics must not change the saved var
      TORCH_CHECK(running_mean.has_value() && running_var.has_value(),
                  "inplace_abn: evaluation mode needs running_mean and running_var");
      mean = *running_mean;
      var = running_var->clone();
      mask = ops().fwd.call(y, mean, var, weight, bias, residual, eps, act, param, signed_weight, z_out, 0, source);
    }
    below.reset();  // (add_ on other devices bumps the counter's version in ADInplaceOrView)
    if (num_batches_tracked.has_value()) count_batch(*num_batches_tracked);
    const Edges e(weight, bias, running_mean, running_var, residual);
    save(ctx, out_of_place ? at::Tensor() : x, saved, var, weight, bias, residual, mask,
         {act, static_cast<int64_t>(x.scalar_type()), e.weight, e.bias, e.residual, training, signed_weight, relu},
         eps, param);
    return y;
  }

  // grads by reference: CppNode passes its own list, so that dy's use count says whether anything else holds it
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const Saved sv(ctx, "inplace_abn", "ABN layer (BatchNorm + activation)");
    const BelowAutograd below;
    const at::Tensor &y = sv.y, &var = sv.var, &weight = sv.weight, &bias = sv.bias;
    const int64_t act = sv.i[0];
    const auto dtype = static_cast<at::ScalarType>(sv.i[1]);
    const double eps = sv.eps, p = sv.p;
    const bool training = sv.i[5], signed_weight = sv.i[6], relu = sv.i[7];
    auto needs = [&](int64_t edge) { return edge >= 0 && ctx->needs_input_grad(edge); };
    const bool need_x = ctx->needs_input_grad(0), need_w = needs(sv.i[2]), need_b = needs(sv.i[3]),
               need_r = needs(sv.i[4]);
    const OptTensor w = opt(weight), b = opt(bias), r = opt(sv.residual);
    const at::Tensor& mask = sv.mask;

    // One operator call (src/ops/bn_backward.cpp): the reduce pass where its sums are
    // needed (in eval mode with frozen parameters they are not), the input pass, and
    // the parameters' gradients. ReLU: the CPU kernels apply its derivative as they read dy.
    // dx into dy where nothing else can see dy (docs/DESIGN.md section 6.2)
    const at::Tensor& dy = grads[0];
    const OptTensor dx_out = need_x && dy_is_free(dy, y) && bn_backward_dx_direct(y, act) ? OptTensor(dy) : std::nullopt;
    auto [dx, dw, db, dr] = ops().bn.call(y, dy, mask, var, w, b, r, eps, act, p, signed_weight, training,
                                          {need_x, need_w, need_b, need_r}, relu, dx_out);
    if (dx_out.has_value()) dx = dy;
    dx = need_x ? cast(dx, dtype) : at::Tensor();
    dr = need_r ? cast(dr, dtype) : at::Tensor();
    if (!need_w) dw = at::Tensor();
    if (!need_b) db = at::Tensor();
    // one entry per forward argument
    return {dx, dw, db, at::Tensor(), at::Tensor(), dr, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The GroupNorm layer (docs/DESIGN.md section 10): the BatchNorm operators in their GroupNorm mode forward (a
// channels-last x runs there sample by sample), and gn_backward, as _InPlaceAGNFunction runs them with the native
// operators (it stays the path of the pure backend and of the channels-last SiLU shapes that
// inplace_abn/_groupnorm_ops.py leaves to the pure kernels). With out_of_place (inplace_agn): y goes to a new
// tensor in x's layout and x is left as it is; forward_ reads x as its source, so this costs no more than the
// in-place form (a copy of x first would add a pass), and y alone is still kept.
struct InPlaceAGNFunction : torch::autograd::Function<InPlaceAGNFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, const OptTensor& weight, const OptTensor& bias,
                            const OptTensor& residual, int64_t groups, double eps, int64_t act, double param,
                            bool signed_weight, bool out_of_place) {
    TORCH_CHECK(x.numel() > 0 && groups > 0 && x.size(1) % groups == 0,
                "inplace_abn: inplace_agn(_) needs a non-empty x and groups dividing C");
    const BelowAutograd below;
    const auto [mean, var] = ops().stats.call(x, std::nullopt, std::nullopt, 0.0, groups);
    const at::Tensor y = out_of_place ? at::empty_like(x, at::MemoryFormat::Preserve) : x;
    const at::Tensor mask = ops().fwd.call(y, mean, var, weight, bias, residual, eps, act, param, signed_weight,
                                           std::nullopt, groups, out_of_place ? OptTensor(x) : std::nullopt);
    const Edges e(weight, bias, std::nullopt, std::nullopt, residual);
    save(ctx, out_of_place ? at::Tensor() : x, y, var, weight, bias, residual, mask,
         {act, groups, e.weight, e.bias, e.residual, signed_weight}, eps, param);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Saved sv(ctx, "inplace_agn", "AGN layer (GroupNorm + activation)");
    const BelowAutograd below;
    const at::Tensor &y = sv.y, &var = sv.var, &weight = sv.weight, &bias = sv.bias, &mask = sv.mask;
    const int64_t act = sv.i[0], G = sv.i[1];
    const bool signed_weight = sv.i[5];
    const double eps = sv.eps, p = sv.p;
    auto needs = [&](int64_t edge) { return edge >= 0 && ctx->needs_input_grad(edge); };
    const bool need_x = ctx->needs_input_grad(0), need_w = needs(sv.i[2]), need_b = needs(sv.i[3]),
               need_r = needs(sv.i[4]);
    const OptTensor w = opt(weight), b = opt(bias), r = opt(sv.residual);

    const at::Tensor dy = like(grads[0], y);
    at::Tensor dx, dr, s_gz, s_gzx, dw, db;
    if (need_x || need_r) {  // one operator; on the CPU one pass over memory (section 10)
      std::tie(dx, dr, s_gz, s_gzx) = ops().gn.call(y, dy, mask, var, w, b, r, G, eps, act, p, signed_weight, need_r);
    } else {  // the parameters' sums only: (N, C), any divisor of C as groups
      std::tie(s_gz, s_gzx) = ops().reduce.call(y, dy, mask, w, b, r, eps, act, p, signed_weight, std::nullopt, 1, false);
      s_gz = need_b ? s_gz.sum(0) : s_gz;
      s_gzx = need_w ? s_gzx.sum(0) : s_gzx;
    }
    if (need_w) dw = signed_weight ? cast(s_gzx, weight.scalar_type()) : ops().wgrad.call(s_gzx, weight, false);
    if (need_b) db = cast(s_gz, bias.scalar_type());
    return {need_x ? dx : at::Tensor(), dw, db, need_r ? dr : at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The layers' operators: inplace_abn_ / inplace_agn_ (kOutOfPlace = false), inplace_abn / inplace_agn (true).
template <bool kOutOfPlace>
at::Tensor agn_layer(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& residual,
                     int64_t groups, double eps, int64_t activation, double activation_param, bool signed_weight) {
  return InPlaceAGNFunction::apply(x, weight, bias, residual, groups, eps, activation, activation_param,
                                   signed_weight, kOutOfPlace);
}

template <bool kOutOfPlace>
at::Tensor abn_layer(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                     const OptTensor& running_mean, const OptTensor& running_var, const OptTensor& residual,
                     bool training, double momentum, double eps, int64_t activation, double activation_param,
                     bool signed_weight, bool relu, const OptTensor& num_batches_tracked) {
  TORCH_CHECK(!relu || activation == 0, "inplace_abn: relu=True needs activation 0 (identity), got ", activation);
  // Before anything is written: functions._apply leaves these to this call (and
  // makes them itself only to word a refusal).
  TORCH_CHECK(x.dim() >= 2, "inplace_abn: expected an input of shape (N, C, ...), got ", x.sizes());
  check_channel_vector(weight, x, "weight");
  check_channel_vector(bias, x, "bias");
  check_channel_vector(running_mean, x, "running_mean");
  check_channel_vector(running_var, x, "running_var");
  return InPlaceABNFunction::apply(x, weight, bias, running_mean, running_var, residual, training, momentum, eps,
                                   activation, activation_param, signed_weight, relu, num_batches_tracked,
                                   kOutOfPlace);
}

// What autograd would have to differentiate: an input requiring grad (with grad
// mode on) or carrying a forward-mode tangent (level 0, as PyTorch's fallback checks).
bool needs_grad(const at::Tensor& t, bool grad_mode) {
  return t.defined() && ((grad_mode && t.requires_grad()) || t._fw_grad(0).defined());
}
bool needs_grad(const OptTensor& t, bool grad_mode) { return t.has_value() && needs_grad(*t, grad_mode); }
template <class T>
bool needs_grad(const T&, bool) {
  return false;
}

// The Autograd kernel of an operator without a derivative (all but the two layers), for direct calls (the layers'
// own calls skip it: BelowAutograd). Gradients through a direct call with grad mode on (or tangents through one
// under forward AD) would be missing, so that raises. It replaces PyTorch's boxed fallback for operators without
// autograd (~1.7 us of a 2x32x7x7 layer's 49 us training step; docs/DESIGN.md section 7.3).
template <class Sig>
struct NoGrad;
template <class R, class... A>
struct NoGrad<R(A...)> {
  template <c10::TypedOperatorHandle<R(A...)> Ops::*H>
  static R call(c10::DispatchKeySet ks, A... a) {
    const auto& op = ops().*H;
    const bool grad_mode = at::GradMode::is_enabled();
    TORCH_CHECK(!(needs_grad(a, grad_mode) || ...), op.schema().name(),
                " has no derivative, and an input requires grad or carries a forward-mode tangent: call it under "
                "torch.no_grad() and outside forward AD, or use the layers (inplace_abn.InPlaceABN, "
                "inplace_abn.functions.inplace_abn), which differentiate it");
    const at::AutoDispatchBelowADInplaceOrView guard;  // (its internal ops skip autograd too)
    return op.redispatch(ks & c10::after_ADInplaceOrView_keyset, a...);
  }
};
#define IABN_NO_GRAD(name, member) m.impl(#name, TORCH_FN(NoGrad<decltype(name)>::call<&Ops::member>))

}  // namespace

TORCH_LIBRARY_IMPL(inplace_abn, CompositeImplicitAutograd, m) {
  m.impl("inplace_abn_", &abn_layer<false>);
  m.impl("inplace_abn", &abn_layer<true>);
  m.impl("inplace_agn_", &agn_layer<false>);
  m.impl("inplace_agn", &agn_layer<true>);
}

TORCH_LIBRARY_IMPL(inplace_abn, Autograd, m) {
  IABN_NO_GRAD(batch_stats, stats);
  IABN_NO_GRAD(forward_, fwd);
  IABN_NO_GRAD(bn_forward_, bn_fwd);
  IABN_NO_GRAD(forward, fwd_functional);
  IABN_NO_GRAD(bn_forward, bn_fwd_functional);
  IABN_NO_GRAD(backward_reduce, reduce);
  IABN_NO_GRAD(backward_input, input);
  IABN_NO_GRAD(backward_input_from_z_, input_z);
  IABN_NO_GRAD(weight_grad, wgrad);
  IABN_NO_GRAD(gn_backward, gn);
  IABN_NO_GRAD(bn_backward, bn);
}

}  // namespace inplace_abn
