"""Functional In-Place ABN: ``inplace_abn`` and ``inplace_abn_sync``.

Both overwrite ``x`` with ``f(BN(x) [+ residual])`` and keep only the output
for backward (docs/DESIGN.md sections 1-2). Same arguments as the original
inplace_abn package, plus keyword-only extensions (``residual``,
``weight_mode``).
"""
from typing import Any, Optional

import warnings

import torch
import torch.autograd.forward_ad as _fwad
import torch.distributed as dist
import torch.nn.functional as F

from . import _activation, _backend, _distributed, _pure

WEIGHT_MODES = ("abs", "signed")


def _layout_compatible(x: torch.Tensor) -> torch.Tensor:
    """x itself when the kernels can work on its storage, else None."""
    return x if _pure.can_walk(x) else None


def _like_layout(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """t with y's memory layout (the kernels read t and y in lockstep)."""
    if y.is_contiguous():
        return t.contiguous()
    fmt = torch.channels_last if y.dim() == 4 else torch.channels_last_3d
    return t.contiguous(memory_format=fmt)


def _count_message(count, shape, synced):
    return (f"Expected more than 1 value per channel when training, got {count} "
            f"(input size {list(shape)}{' summed over the process group' if synced else ''})")


def check_count(count: int, shape) -> None:
    """Training needs more than one value per channel; count 0 (an empty batch) is allowed
    and leaves the running statistics as they are, as torch.nn.BatchNorm does."""
    if count == 1:
        raise ValueError(_count_message(count, shape, False))


def update_running_stats(mean, var, count, running_mean, running_var, momentum, shape, synced):
    """Check that training has more than one value per channel (``count``, over
    the group when ``synced``), then move the running statistics towards the
    batch mean and unbiased variance, as torch.nn.BatchNorm does (in float64:
    the formula of the native batch_stats, which does this for the local layer).

    ``count`` is an int, checked on the host, or (synchronised layers) the global
    count as a 0-dim float64 tensor, which stays on the device: the check is a
    device assert that every rank evaluates alike, the unbiased factor and the
    empty-batch case are computed with torch.where.

    An empty batch (count 0) leaves them as they are, as torch.nn.BatchNorm
    does (it returns an empty output and zero parameter gradients)."""
    if isinstance(count, torch.Tensor):
        # counts are integers >= 0, so "n <= 1 and n != 0" is n == 1
        _distributed.assert_on_device(count != 1, _count_message(1, shape, synced))
        keep, factor = count == 0, torch.where(count > 1, count / (count - 1), 0.0)
    else:
        if count == 0:
            return
        check_count(count, shape)
        keep, factor = None, count / (count - 1)
    with torch.no_grad():
        if running_mean is not None:
            _pure.move_running(running_mean, mean, 1.0, momentum, keep)
        if running_var is not None:
            _pure.move_running(running_var, var, factor, momentum, keep)


# ---- shared by every in-place layer (BatchNorm here, GroupNorm in groupnorm.py) ----


def _activation_code(activation, activation_param):
    """(invertible, the code the kernels apply). Non-invertible activations
    (relu, leaky_relu slope 0): the kernels normalise only, see `_write`."""
    invertible = _activation.is_invertible(activation, activation_param)
    return invertible, (_activation.CODES[activation] if invertible else _activation.IDENTITY)


def _prepare(x, residual):
    """(the tensor the kernels write: x itself or a contiguous copy of a strided
    x, the residual in that tensor's layout)."""
    work = _layout_compatible(x)
    work = x.contiguous() if work is None else work
    if residual is not None:
        residual = _like_layout(residual, work)
    return work, residual


def _write(x, work, residual, invertible, forward_, forward_relu=None, out=None):
    """Run ``forward_(target, residual, source) -> result`` (the mask, or a tuple that holds
    it) so that x ends up holding y, or, with ``out`` (preserve_input: a new tensor in
    work's layout), so that out does and work is only read (the operators' ``source``);
    returns (the tensor to save for backward, the result).

    Non-invertible activations (ReLU) lose the negative values the backward
    needs, so z is kept, in the accumulation dtype (half inputs lose nothing;
    no memory saving), and saved. With ``forward_relu(target, residual, z_out,
    source) -> result`` (an operator that writes z into z_out and max(z, 0) into
    the target in one pass) that costs one extra write; without it the
    normalisation runs on a copy and the activation is applied afterwards."""
    target, source = (work, None) if out is None else (out, work)
    if invertible:
        result = forward_(target, residual, source)
        saved_y = target
    elif forward_relu is not None:
        saved_y = torch.empty_like(work, dtype=_activation.acc_dtype(x.dtype))  # (keeps work's layout)
        result = forward_relu(target, residual, saved_y, source)
    else:
        saved_y = work.to(_activation.acc_dtype(x.dtype), copy=True)
        result = forward_(saved_y, None if residual is None else residual.to(saved_y.dtype), None)
        target.copy_(saved_y.clamp(min=0))
    if out is None and work is not x:  # strided input: computed on a contiguous copy
        x.copy_(work)
    return saved_y, result


def _output_tensor(x, work, preserve):
    """`_write`'s ``out``: None (y into x, through work), or for preserve_input a new
    tensor in work's layout, or work itself where it is already a copy (of a strided x)."""
    if not preserve:
        return None
    return torch.empty_like(work) if work is x else work


def _result(ctx, x, out):
    """A layer Function's output after `_write`: x, written in place (marked dirty), or
    preserve_input's ``out`` (x as it was)."""
    if out is None:
        ctx.mark_dirty(x)
        return x
    return out


def _refuse_double_backward(op, twin):
    # Grad mode is on inside backward only under create_graph=True. The
    # backward is written with the native kernels and is not itself
    # differentiable; once_differentiable alone would let a loss linear in y
    # (dy needs no grad) through with a constant input gradient, and the
    # second derivative would be silently dropped.
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} does not support double backward (create_graph=True, e.g. a gradient "
            "penalty): its backward is not differentiable, so second derivatives would be wrong. "
            f"Use the non-in-place {twin} where second derivatives are needed"
        )


def _output_grad(dy, y, threshold):
    """dy in y's layout; with ``threshold`` (a ReLU layer: y holds z, and the operators do not
    apply the derivative themselves) times the ReLU derivative (ReLU's own backward kernel:
    one pass over dy and z, no mask tensor)."""
    dy = _like_layout(dy, y)
    return torch.ops.aten.threshold_backward(dy.to(y.dtype), y, 0) if threshold else dy


def _param_grads(sum_gz, sum_gzx, weight, bias, signed, need_w, need_b, weight_grad=None):
    """dweight = S_gx dg~/dweight, dbias = S_g (per channel; docs/DESIGN.md section 2).

    ``weight_grad``: the operator that computes dweight in one call (abs mode), else torch ops."""
    dweight = dbias = None
    if weight is not None and need_w:
        if signed:
            dweight = sum_gzx.to(weight.dtype)
        elif weight_grad is not None:
            dweight = weight_grad(sum_gzx, weight, False)
        else:
            dweight = (sum_gzx * torch.sign(weight.to(sum_gzx.dtype))).to(weight.dtype)
    if bias is not None and need_b:
        dbias = sum_gz.to(bias.dtype)
    return dweight, dbias


def _check_common(op, x, residual, eps, activation, activation_param, weight_mode, writes_x=True, check_channels=True,
                  **per_channel):
    """The checks every in-place layer makes, before anything is written:
    input, activation, weight mode, eps, the (C,) tensors ``per_channel`` (unless
    ``check_channels`` is False: `_check_channels` later), the residual and
    (``writes_x``) whether x may be overwritten."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: expected a floating point input, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{op}: expected an input of shape (N, C, ...), got shape {list(x.shape)}")
    _activation.check(activation, activation_param)
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(f"{op}: weight_mode must be 'abs' or 'signed', got {weight_mode!r}")
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")
    if check_channels:
        _check_channels(op, x, per_channel)
    on_cpu = x.is_cpu
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"{op}: residual must have the input's shape {list(x.shape)}, got {list(residual.shape)}"
            )
        if not (on_cpu and residual.is_cpu) and residual.device != x.device:
            raise ValueError(f"{op}: residual is on {residual.device} but the input is on {x.device}")
    requires_grad = x.requires_grad or (residual is not None and residual.requires_grad)
    for t in per_channel.values():
        requires_grad = requires_grad or (t is not None and t.requires_grad)
    if writes_x:
        _check_writable(x, residual, requires_grad)


def _check_channels(op, x, per_channel):
    """The (C,) tensors of ``per_channel`` ({name: tensor or None}): shape, dtype, device."""
    C, on_cpu = x.shape[1], x.is_cpu
    shape = (C,)
    for name, t in per_channel.items():  # (a hot loop: ~1 us per tensor)
        if t is None:
            continue
        if t.shape != shape:
            raise ValueError(
                f"{op}: the input has {C} channels but {name} has shape {list(t.shape)} "
                f"(expected [{C}])"
            )
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
        # (.device builds a torch.device per call; is_cpu settles the common case)
        if not (on_cpu and t.is_cpu) and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the input is on {x.device}")


def _run(function, args, differentiable):
    """``function.apply(*args)``, or, when no autograd node is needed (no_grad,
    inference_mode, frozen model, i.e. no tensor of ``differentiable``
    requires grad), its forward run directly: same result, and torch.compile
    cannot trace ctx.mark_dirty outside a node."""
    if not _records_backward(differentiable):
        with torch.no_grad():
            return function.forward(_NoGradCtx(), *args)
    return function.apply(*args)


class _InPlaceABNFunction(torch.autograd.Function):
    """y = f(BN(x) [+ residual]) written into x; backward from y (docs/DESIGN.md section 2).

    ``group`` is None for the local layer, else the process group whose
    batch statistics are combined (docs/DESIGN.md section 4).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, residual, training, momentum, eps,
                activation, activation_param, signed, group, preserve=False):
        backend = _backend.current()  # the backward uses the same, in whatever thread it runs
        ops = _backend.ops_for(x, backend)
        invertible, act = _activation_code(activation, activation_param)
        C = x.shape[1]
        count = x.numel() // C if C else 0  # (synchronised: the group's, below)
        if training and group is None:
            check_count(count, x.shape)
        elif not training:
            # var is saved for backward: a copy, so that a later update of the running
            # statistics cannot change it; no backward, no copy
            mean = running_mean
            var = running_var if isinstance(ctx, _NoGradCtx) else running_var.clone()

        compiling = torch.compiler.is_compiling()
        if compiling and group is None and ops is _backend.NATIVE:
            # A compiled graph: the functional operators, y in a new tensor in the layout the
            # graph gives x, no copy of x to the traced strides (docs/DESIGN.md section 5.1).
            # momentum may be a symbolic float (momentum=None reads num_batches_tracked),
            # which an operator's float argument cannot take: the graph updates the running
            # statistics (the compiler fuses its few element-wise ops).
            keep_z = not invertible
            if training:
                y, z, mask, mean, var = ops.bn_forward(x, weight, bias, residual, eps, act, activation_param, signed,
                                                       keep_z)
                update_running_stats(mean, var, count, running_mean, running_var, momentum, x.shape, False)
            else:
                y, z, mask = ops.forward(x, mean, var, weight, bias, residual, eps, act, activation_param, signed,
                                         keep_z)
            ctx.save_for_backward(y if invertible else z, var, weight, bias, residual, mask)
            ctx.config = (training, eps, act, activation_param, signed, group, count, invertible, x.dtype, backend)
            return y

        work, residual = _prepare(x, residual)
        if training and group is None and ops is _backend.NATIVE:
            # the local layer: statistics (with the running-statistics update) and y in one
            # operator call, bn_forward_, as the C++ autograd of eager calls runs it
            def normalise(t, r, z, src):
                return ops.bn_forward_(t, weight, bias, running_mean, running_var, r, momentum, eps, act,
                                       activation_param, signed, z, src)
        else:
            if training and group is None and not compiling:  # (the update runs inside batch_stats)
                mean, var = ops.batch_stats(work, running_mean, running_var, momentum)
            elif training:
                mean, var = ops.batch_stats(work)
                if group is not None:  # the global count, a device tensor (docs/DESIGN.md section 4)
                    mean, var, count = _distributed.reduce_stats(mean, var, count, group, running_mean)
                update_running_stats(mean, var, count, running_mean, running_var, momentum, x.shape,
                                     group is not None)

            def normalise(t, r, z, src):
                return ops.forward_(t, mean, var, weight, bias, r, eps, act, activation_param, signed, z,
                                    source=src), mean, var

        out = _output_tensor(x, work, preserve)
        saved_y, (mask, mean, var) = _write(x, work, residual, invertible,
                                            lambda t, r, src: normalise(t, r, None, src), normalise, out)

        ctx.save_for_backward(saved_y, var, weight, bias, residual, mask)
        ctx.config = (training, eps, act, activation_param, signed, group, count, invertible, x.dtype, backend)
        return _result(ctx, x, out)

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward("inplace_abn", "ABN layer (BatchNorm + activation)")
        return _InPlaceABNFunction._backward(ctx, dy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, dy):
        y, var, weight, bias, residual, mask = ctx.saved_tensors
        training, eps, act, p, signed, group, count, invertible, dtype, backend = ctx.config
        ops = _backend.ops_for(y, backend)
        # ReLU (y holds z): the native CPU operators apply its derivative as they read dy
        # (relu=True, one pass less); elsewhere dy is thresholded once, first
        relu = {"relu": True} if not invertible and ops is _backend.NATIVE and y.is_cpu else {}
        dy = _output_grad(dy, y, threshold=not invertible and not relu)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_r = residual is not None and ctx.needs_input_grad[5]

        need_wb = (weight is not None and need_w) or (bias is not None and need_b)
        if group is None and ops is _backend.NATIVE:
            # the local layer: the whole backward in one operator, as the C++ autograd of
            # eager calls runs it (src/ops/bn_backward.cpp), so both paths give the same bits
            need = [need_x, weight is not None and need_w, bias is not None and need_b, need_r]
            dx, dweight, dbias, dr = ops.bn_backward(y, dy, mask, var, weight, bias, residual, eps, act, p, signed,
                                                     training, need, **relu)
            return (dx.to(dtype) if need_x else None, dweight if need[1] else None, dbias if need[2] else None,
                    None, None, dr.to(dtype) if need_r else None, None, None, None, None, None, None, None, None)
        synced = training and group is not None
        # The sums feed dweight, dbias and, in training, dx; in eval mode with frozen
        # parameters nobody reads them: no reduce pass (docs/DESIGN.md section 6).
        reduce = need_wb or (training and (need_x or need_r)) or synced
        # SiLU on the CPU: the reduce pass keeps its inverse (z, or h = z / y), the
        # input pass starts from it and y (docs/DESIGN.md section 7.2)
        z = _backend.z_buffer(ops, y, act) if reduce and need_x else None
        if reduce:
            extra = () if z is None else (z,)
            sum_gz, sum_gzx = ops.backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed, *extra,
                                                  **relu)
        dx = dr = None
        if need_x or need_r:
            if synced:
                g_gz, g_gzx = _distributed.reduce_grad_sums(sum_gz, sum_gzx, group, count)
                scale = 1.0
            elif training and not torch.compiler.is_compiling():  # the kernel scales the raw sums by 1/n
                g_gz, g_gzx, scale = sum_gz, sum_gzx, (1.0 / count if count else 0.0)
            elif training:  # compiled: a float argument would specialise the graph on the (symbolic) count
                g_gz, g_gzx, scale = sum_gz / count, sum_gzx / count, 1.0
            else:  # eval: the statistics are constants; scale 0 drops these (any (C,) tensor)
                g_gz = g_gzx = var
                scale = 0.0
            if z is None:
                dx, dr = ops.backward_input(y, dy, mask, var, weight, bias, residual, g_gz, g_gzx, eps, act, p,
                                            signed, need_r, scale, **relu)
            else:  # dx over z, or (16-bit y, z in float32) into a tensor of y's dtype
                dx = z if z.dtype == y.dtype else torch.empty_like(y)
                dr = ops.backward_input_from_z_(z, y, dy, var, weight, bias, residual, g_gz, g_gzx, eps, act, p,
                                                signed, need_r, scale, dx_out=None if dx is z else dx)
            dx = dx.to(dtype) if need_x else None
            dr = dr.to(dtype) if need_r else None
        elif synced:
            # Every rank must take part in the collective, needed or not.
            _distributed.reduce_grad_sums(sum_gz, sum_gzx, group)

        dweight = dbias = None
        if need_wb:
            dweight, dbias = _param_grads(sum_gz, sum_gzx, weight, bias, signed, need_w, need_b, ops.weight_grad)
        return dx, dweight, dbias, None, None, dr, None, None, None, None, None, None, None, None


def _check_args(x, weight, bias, running_mean, running_var, residual, training, eps, activation,
                activation_param, weight_mode, writes_x=True):
    """`_check_common` for `_apply`, all but the per-channel tensors (`_check_layer_channels`)."""
    if not training and (running_mean is None or running_var is None):
        raise ValueError("inplace_abn: evaluation mode (training=False) needs running_mean and running_var")
    _check_common("inplace_abn", x, residual, eps, activation, activation_param, weight_mode, writes_x,
                  check_channels=False, weight=weight, bias=bias, running_mean=running_mean, running_var=running_var)


def _check_layer_channels(x, weight, bias, running_mean, running_var):
    _check_channels("inplace_abn", x, dict(weight=weight, bias=bias, running_mean=running_mean,
                                           running_var=running_var))


_VIEW_REFUSED = {
    "MULTI_OUTPUT_NODE": "a view returned by a function with several view outputs (split, unbind, chunk)",
    "NO_GRAD_MODE": "a view created under torch.no_grad()",
    "INFERENCE_MODE": "a view created under torch.inference_mode()",
    "IN_CUSTOM_FUNCTION": "a view created inside a custom autograd.Function",
}


_RESIDUAL_SHARES_MEMORY = (
    "inplace_abn overwrites its input, but residual shares memory with x: the write would destroy the residual "
    "the backward needs (wrong gradients). Pass residual=x.clone() (or another tensor)")


def _root(t):
    return t if t._base is None else t._base


def _check_writable(x, residual, requires_grad):
    """Refuse, before anything is written, every input that autograd would
    refuse to see modified in place (it checks only after the write, when x is
    already lost), and inputs whose memory the write would corrupt."""
    if torch.compiler.is_compiling():
        # Tracing has no addresses to compare, and AOTAutograd checks the write to
        # x itself; a residual that views x's base (x[:5] and x[3:]) would come out
        # of functionalization with wrong gradients: refuse it (conservatively).
        if residual is not None and _root(x) is _root(residual):
            raise RuntimeError(_RESIDUAL_SHARES_MEMORY)
        return
    if _layout_compatible(x) is None and torch._debug_has_internal_overlap(x) == 1:
        raise RuntimeError(
            "inplace_abn overwrites its input, but several elements of x share one memory location "
            "(an expand()ed or stride-0 tensor); pass x.contiguous() or x.clone()"
        )
    # (functorch's wrapped tensors have no storage to compare; under a transform the layer
    # computes from a copy of x, `_stock_call`, so that the write spoils no residual)
    if residual is not None and not torch._C._are_functorch_transforms_active() and _shares_memory(x, residual):
        # Copying the residual would cost the memory the layer exists to save,
        # silently; refusing keeps that choice with the caller.
        raise RuntimeError(_RESIDUAL_SHARES_MEMORY)
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            "inplace_abn overwrites its input, but x is an inference tensor (created under "
            "torch.inference_mode()) and this call is outside inference mode; pass x.clone()"
        )
    if not (requires_grad and torch.is_grad_enabled()):
        return
    if x._is_view():
        meta = torch._C._autograd._get_creation_meta(x).name
        if meta in _VIEW_REFUSED:
            raise RuntimeError(
                f"inplace_abn overwrites its input, but x is {_VIEW_REFUSED[meta]}, which autograd does not "
                "allow to be modified in place; pass x.clone()"
            )
        if x.requires_grad and x._base.is_leaf:
            raise RuntimeError(
                "inplace_abn overwrites its input, but x is a view of a leaf tensor that requires grad; "
                "pass x.clone() or use the non-in-place ABN layer"
            )
    if x.requires_grad and x.is_leaf:
        raise RuntimeError(
            "inplace_abn overwrites its input, but x is a leaf tensor that requires grad; "
            "pass x.clone() or use the non-in-place ABN layer"
        )


def _element_addresses(t, base):
    """Address of every element of t minus ``base``, in bytes (1-D int64)."""
    off = torch.full((), t.data_ptr() - base, dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * (stride * t.element_size())
    return off.reshape(-1)


def _shares_memory(a, b):
    """Whether some byte of a is also a byte of b (by address: storages are not compared)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.data_ptr() + sa.nbytes() <= sb.data_ptr() or sb.data_ptr() + sb.nbytes() <= sa.data_ptr():
        return False  # the usual case, decided without looking at strides

    def extent(t):  # [first byte, one past the last byte); strides are >= 0
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.element_size() != b.element_size():
        return True  # the ranges overlap and the element grids differ: assume they touch
    # Interleaved ranges (e.g. x[::2] and x[1::2]): compare the elements themselves.
    base = min(a0, b0)
    return bool(torch.isin(_element_addresses(a, base), _element_addresses(b, base)).any())


def _stock_autodiff(*tensors) -> bool:
    """Whether a layer call must run stock operators (`_stock_call`): under a torch.func
    transform (grad, vmap, jacrev, jvp, ...), whose wrapped tensors the in-place
    operators and their once-differentiable backward cannot serve, or when one of
    ``tensors`` carries a forward-mode AD tangent (torch.autograd.forward_ad), which
    the backward from y alone cannot give. Not while torch.compile traces (it
    traces neither). Cheap when neither applies: two C calls (small layers)."""
    if torch._C._are_functorch_transforms_active():
        return not torch.compiler.is_compiling()
    if _fwad._current_level < 0:  # no dual level entered: no tangents anywhere
        return False
    return not torch.compiler.is_compiling() and any(
        t is not None and _fwad.unpack_dual(t).tangent is not None for t in tensors)


_warned_stock_autodiff = False


def _stock_call(x, preserve_input, standard_ops):
    """The layer with stock operators under torch.func transforms and forward-mode AD
    (`_stock_autodiff`), keeping the layer's contract: y written into x and x returned
    (a new tensor with ``preserve_input``). ``standard_ops(src)`` computes y from src, a
    copy of x unless ``preserve_input``: the stock backward keeps its input, which
    the write into x must not change. Saves no memory (warned once per process)."""
    global _warned_stock_autodiff
    if not _warned_stock_autodiff:
        _warned_stock_autodiff = True
        warnings.warn(
            "inplace_abn: under a torch.func transform or forward-mode AD the in-place layers run stock "
            "normalisation + activation (correct derivatives, no memory saved)", RuntimeWarning, stacklevel=4)
    if preserve_input:
        return standard_ops(x)
    y = standard_ops(x.clone())
    try:
        return x.copy_(y)
    except RuntimeError as e:  # vmap over the parameters, not x (ensembles): y is batched, x is not
        raise RuntimeError(
            "inplace_abn: the output cannot be written into x under this torch.func transform (vmap over "
            "weights or statistics but not x?); pass preserve_input=True for the output in a new tensor") from e


def _standard_ops(x, weight, bias, running_mean, running_var, training, momentum, eps, activation,
                  activation_param, residual, weight_mode):
    """The same math with stock operators (batch_norm + activation), not in place.

    Used under torch.export / torch.jit.trace, so that exported programs and
    ONNX files hold only standard operators and need no custom-op library.
    """
    g = None if weight is None else _activation.effective_weight(weight, eps, weight_mode == "signed")
    z = F.batch_norm(x, running_mean, running_var, g, bias, training, momentum, eps)
    if residual is not None:
        z = z + residual
    return _activation.apply(z, activation, activation_param)


def _apply(x, weight, bias, running_mean, running_var, training, momentum, eps, activation, activation_param,
           residual, weight_mode, group, counter=None, preserve_input=False):
    """The in-place layer (`inplace_abn`, `inplace_abn_sync`). ``counter``: the
    module's num_batches_tracked, to which 1 is added once the layer has run (by the
    native op itself where it runs: one operator call less, docs/DESIGN.md 7.3).
    ``preserve_input``: the output in a new tensor (`inplace_abn`'s argument)."""
    # The per-channel tensors: the native layers check them before writing anything
    # (abn_layer, src/ops/autograd.cpp), and Python then only to word a refusal as
    # every path does (below); ~14k instructions of a 2x32x7x7 step (docs/DESIGN.md 7.3).
    exporting = group is None and (torch.compiler.is_exporting() or torch.jit.is_tracing())
    try:
        _check_args(x, weight, bias, running_mean, running_var, residual, training, eps, activation,
                    activation_param, weight_mode, writes_x=not preserve_input)
        stock = _stock_autodiff(x, residual, weight, bias, running_mean, running_var)
        if stock and group is not None:
            raise RuntimeError(
                "inplace_abn_sync does not support torch.func transforms or forward-mode AD (a tensor carries a "
                "tangent); use the synchronised layer in plain eager or compiled code")
        # the C++ layers: out of place, or in place with a backward to record; eager, native backend
        native = group is None and not exporting and not stock and (
            _native_eager(x) if preserve_input else _native_autograd(x, (x, weight, bias, residual)))
        if not native:
            _check_layer_channels(x, weight, bias, running_mean, running_var)
    except (ValueError, TypeError, RuntimeError):
        if group is not None:  # the other ranks wait in this call's all_reduce: they must fail with us
            _distributed.refuse_together(group, x, weight, running_mean)
        raise
    momentum = 0.0 if momentum is None else float(momentum)
    if exporting or stock:
        def standard(src):
            return _standard_ops(src, weight, bias, running_mean, running_var, bool(training), momentum, float(eps),
                                 activation, float(activation_param), residual, weight_mode)

        if exporting:  # stock operators, the output is a new tensor (x is not overwritten)
            return count_batch(standard(x), counter)
        # (counted first, as torch.nn.BatchNorm: a transform that refuses the count writes nothing)
        count_batch(None, counter)
        return _stock_call(x, preserve_input, standard)
    if not _activation.is_invertible(activation, activation_param):
        _activation.warn_not_invertible(activation, activation_param)
    preserve_input = _out_of_place(preserve_input)
    args = (x, weight, bias, running_mean, running_var, residual, bool(training), momentum, float(eps), activation,
            float(activation_param), weight_mode == "signed", group, preserve_input)
    if native:  # (src/ops/autograd.cpp; out of place, forward_ reads x and writes a new tensor)
        try:
            return _apply_native(*args[:-2], counter, out_of_place=preserve_input)
        except (RuntimeError, ValueError, TypeError):
            _check_layer_channels(x, weight, bias, running_mean, running_var)  # this refusal in Python's words
            raise
    return count_batch(_run(_InPlaceABNFunction, args, (x, weight, bias, residual)), counter)


def _out_of_place(preserve_input) -> bool:
    """Whether a layer writes y to a new tensor: ``preserve_input``, and always under
    torch.compile (no extra pass, y alone kept): with the write into x, AOTAutograd returned a
    wrong input gradient whenever x was a graph input that requires grad (docs/DESIGN.md section 5.1)."""
    return preserve_input or torch.compiler.is_compiling()


def module_affine(module):
    """(weight, bias) of a layer module, read from ``module._parameters``: each
    ``module.weight`` is an nn.Module.__getattr__ call, ~0.5 us of a small layer's
    ~20 us forward (benchmarks/bench_cpu.py --quick). A parametrized weight
    (torch.nn.utils.parametrize) is not there: computed by the attribute."""
    params = module._parameters
    weight = params["weight"] if "weight" in params else module.weight
    bias = params["bias"] if "bias" in params else module.bias
    return weight, bias


def refuse_torchscript(layer):
    """``__prepare_scriptable__`` of every layer module: torch.jit.script cannot
    compile the layers (Python-side dispatch, autograd Functions) and would
    otherwise fail with a TorchScript parse error of our source. PyTorch
    deprecates torch.jit.script; the three ways that do work are named."""
    raise RuntimeError(
        f"{type(layer).__name__} cannot be compiled by torch.jit.script (deprecated by PyTorch): use torch.jit.trace, "
        "torch.export or torch.compile, which run the layer with stock operators or the native ones "
        "(README, 'torch.compile, export, deployment')")


def count_batch(y, counter):
    """y, once ``counter`` (a module's num_batches_tracked, or None) has counted the batch."""
    if counter is not None:
        counter.add_(1)
    return y


def _native_autograd(x, differentiable) -> bool:
    """Whether a local call runs ``torch.ops.inplace_abn.inplace_abn_``, whose autograd is
    in C++ (src/ops/autograd.cpp): eager, a backward to record, the native backend for x's
    device and an x the kernels can write in place. torch.compile traces
    `_InPlaceABNFunction` instead (the same steps), and calls that need no backward run its
    forward directly (`_run`)."""
    return _records_backward(differentiable) and _native_eager(x)


def _native_eager(x) -> bool:
    """Eager (not traced by torch.compile), the native backend for x's device, and an x the
    kernels read and write as it is: the conditions of the C++ layers (`_native_autograd`,
    and the out-of-place layers of preserve_input, which need no recorded backward)."""
    return (not torch.compiler.is_compiling() and _layout_compatible(x) is not None
            and _backend.ops_for(x) is _backend.NATIVE)


def _records_backward(differentiable) -> bool:
    """Whether autograd records a node: grad mode on and some tensor of ``differentiable``
    requiring grad."""
    if torch.is_grad_enabled():
        for t in differentiable:
            if t is not None and t.requires_grad:
                return True
    return False


def _apply_native(x, weight, bias, running_mean, running_var, residual, training, momentum, eps, activation,
                  activation_param, signed, counter=None, out_of_place=False):
    invertible, act = _activation_code(activation, activation_param)
    if training:
        C = x.shape[1]
        check_count(x.numel() // C if C else 0, x.shape)
    if residual is not None:
        residual = _like_layout(residual, x)
    return (_NATIVE_ABN_OUT if out_of_place else _NATIVE_ABN)(
        x, weight, bias, running_mean, running_var, residual, training, momentum, eps, act, activation_param, signed,
        not invertible, counter)


_NATIVE_ABN = torch.ops.inplace_abn.inplace_abn_.default if _backend.HAS_NATIVE else None
_NATIVE_ABN_OUT = torch.ops.inplace_abn.inplace_abn.default if _backend.HAS_NATIVE else None


class _NoGradCtx:
    """Stands in for the autograd context when no backward will run."""

    def save_for_backward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass


def inplace_abn(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    *,
    residual: Optional[torch.Tensor] = None,
    weight_mode: str = "abs",
    preserve_input: bool = False,
) -> torch.Tensor:
    """In-Place Activated Batch Normalization.

    Computes, per channel c (docs/DESIGN.md section 1)::

        z = g~ * (x - mu) / sqrt(var + eps) + beta [+ residual]
        x <- f(z)

    with g~ = |weight| + eps (``weight_mode="abs"``, the original library's
    convention) or sign(weight) (|weight| + eps) (``"signed"``: standard
    BatchNorm weights load unchanged). mu, var are the batch statistics in
    training, the running ones otherwise; in training the running statistics
    are updated with ``momentum`` and the unbiased batch variance.

    Args:
        x: (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W) floating tensor,
            contiguous or channels-last; overwritten with the result.
        weight, bias: (C,) affine parameters or None.
        running_mean, running_var: (C,) running statistics or None.
        training: use (and update) batch statistics.
        momentum: running-statistics momentum (None: no update weight, 0).
        eps: added to the variance, and to |weight|.
        activation: ``identity``, ``leaky_relu``, ``elu``, ``silu``/``swish``
            (``relu`` works but saves no memory).
        activation_param: leaky_relu slope (> 0 to save memory) or elu alpha.
        residual: optional tensor shaped like x added before the activation,
            sharing no memory with x; it receives the gradient dL/dz.
        weight_mode: ``"abs"`` (default) or ``"signed"``.
        preserve_input: leave x as it is and return the output in a new
            tensor of x's shape and memory layout. The backward still keeps
            only the output, so this saves the same memory as the in-place
            form: for an x that is read again after the layer (the shortcut
            of a pre-activation residual block). It costs no extra pass over
            memory: the operators read x as their source (eager, compiled and
            with the pure backend); an x of other strides is copied first.

    Returns:
        x itself, holding the output (a new tensor with ``preserve_input``).
        An empty batch (N = 0 or a spatial size 0) in training gives the
        empty output and leaves the running statistics unchanged, as
        torch.nn.BatchNorm does.

    Raises, before anything is written or updated: for an x that autograd
    would not let an in-place op modify (a leaf or a view of a leaf that
    requires grad, a view from split/unbind or made under no_grad, an
    inference tensor outside inference mode), an x whose elements share
    memory (expand()) and a residual sharing memory with x (none of these
    with ``preserve_input``, which writes nothing to x). The backward raises
    under ``create_graph=True``: it is not differentiable (use `ABN` for
    double backward, e.g. gradient penalties).

    Under torch.func transforms (grad, vmap, jacrev, jvp, ...) and with
    forward-mode AD tangents, it computes y with stock operators, saving no
    memory (warned once), and still writes it into x.
    """
    return _apply(x, weight, bias, running_mean, running_var, training, momentum, eps, activation,
                  activation_param, residual, weight_mode, None, preserve_input=preserve_input)


_warned_no_dist = False


def inplace_abn_sync(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    group: Optional[Any] = None,
    *,
    residual: Optional[torch.Tensor] = None,
    weight_mode: str = "abs",
    preserve_input: bool = False,
) -> torch.Tensor:
    """`inplace_abn` with batch statistics computed over a process group
    (``preserve_input`` as there).

    Every rank of ``group`` (default: the world) must call it, in the same
    order, and run its backward; inputs may differ in batch and spatial size,
    even be empty (such a rank still takes part and gets an empty gradient),
    but not in channels or precision. Without an initialised torch.distributed
    it falls back to `inplace_abn` with a single warning.

    Communication (docs/DESIGN.md section 4), whatever the world size: in
    training, one float64 all_reduce per forward of an 11-value header plus the
    statistics (2C + 1 values, zero-padded to a length every rank agrees on;
    while the group learns its layers' lengths, a call may add one more), and
    one all_reduce of 2C values (float64 for float64 inputs, else float32) per
    backward. Ranks that disagree on C or on the precision raise the same
    ValueError together, at any call; a rank that refuses its own input (channels
    that do not match its layer, dtype, ...) raises its error while the others
    raise at the same call. A global count
    of one value per channel raises the same ValueError on every rank; a
    global count of 0 (every rank empty) returns the empty outputs and leaves
    the running statistics, as torch.nn.BatchNorm does.
    ``training=False`` runs no collective. Running statistics are updated with
    the global count (unbiased variance with n - 1 over all ranks), so they
    stay identical on every rank.

    With DistributedDataParallel, each forward and each backward of the layer
    synchronises, including under ``no_sync()`` (gradient accumulation): that
    context only defers DDP's gradient all_reduce; batch statistics are always
    those of the current micro-batch over all ranks. ``broadcast_buffers``
    is harmless (the running statistics are already equal on every rank).

    Under torch.compile a synchronised training call is one graph break (it
    runs eagerly, the rest of the model stays compiled; torch.nn.SyncBatchNorm
    breaks there too): its collectives run eagerly, see ``_apply_synced``.
    Eval mode compiles with fullgraph=True.

    The forward reads nothing back to the host (no synchronisation with the
    device): the channel, precision and count checks are device asserts
    (``torch._assert_async``), raised as ValueError on the CPU; on CUDA a
    failure is a device-side assert, reported at the next synchronisation, on
    every rank.
    """
    global _warned_no_dist
    if not (dist.is_available() and dist.is_initialized()):
        if training and not _warned_no_dist:  # eval mode synchronises nothing anyway
            _warned_no_dist = True
            import warnings

            warnings.warn(
                "inplace_abn_sync: torch.distributed is not initialized; running the non-synchronized "
                "inplace_abn",
                RuntimeWarning,
                stacklevel=2,
            )
        group = None
    else:
        group = _distributed.resolve_group(group) if training else None
    return (_apply if group is None else _apply_synced)(x, weight, bias, running_mean, running_var, training,
                                                        momentum, eps, activation, activation_param, residual,
                                                        weight_mode, group, preserve_input=preserve_input)


# torch.compile: a synchronised training call runs eagerly, as one unit (one
# graph break per layer; the rest of the model stays compiled). Its collectives
# are in-place all_reduces whose lengths come from the group's host-side
# length history (docs/DESIGN.md section 4); tracing into it would only split
# it into many small graphs. It reads nothing back from the device. Eval mode
# and calls without a process group are traced as usual (no graph break).
_apply_synced = torch.compiler.disable(
    _apply, reason="InPlaceABNSync: statistics all_reduce with lengths from the group's host-side history")


__all__ = ["inplace_abn", "inplace_abn_sync"]
