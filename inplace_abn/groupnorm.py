"""In-place activated GroupNorm: ``inplace_agn``, the modules ``AGN`` and
``InPlaceAGN`` (docs/DESIGN.md section 10).

"AGN" reads "Activated GroupNorm" as "ABN" reads "Activated BatchNorm": the
same fusion (normalisation + activation, overwriting the input, backward from
the output) on GroupNorm statistics, so ``InPlaceAGN`` sits beside
``InPlaceABN`` and ``AGN`` beside ``ABN``, the non-in-place twin.

GroupNorm has no running statistics: training and eval compute the same thing
(statistics per sample and group), so the functional form has no
``training``/``momentum`` arguments.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _activation, _backend, _groupnorm_ops
from .functions import (WEIGHT_MODES, _activation_code, _check_channels, _check_common, _like_layout,
                        _native_autograd, _native_eager, _out_of_place, _output_grad, _output_tensor, _param_grads,
                        _prepare, _refuse_double_backward, _result, _run, _stock_autodiff, _stock_call, _write,
                        module_affine, refuse_torchscript)


class _InPlaceAGNFunction(torch.autograd.Function):
    """y = f(GN(x) [+ residual]) written into x; backward from y (docs/DESIGN.md section 10)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, groups, eps, activation, activation_param, signed, preserve=False):
        backend = _backend.current()  # the backward uses the same, in whatever thread it runs
        ops = _groupnorm_ops.ops_for(x, backend)
        invertible, act = _activation_code(activation, activation_param)
        compiled = invertible and torch.compiler.is_compiling()
        if compiled:
            # A compiled graph: the functional gn_forward, y in a new tensor in the layout
            # the graph gives x, no copy to the traced strides (docs/DESIGN.md section 5.1)
            mean, var = ops.gn_stats(x, groups)
            saved_y, mask = ops.gn_forward(x, mean, var, weight, bias, residual, eps, act, activation_param, signed)
        else:
            work, residual = _prepare(x, residual)
            mean, var = ops.gn_stats(work, groups)
            out = _output_tensor(x, work, preserve)
            saved_y, mask = _write(x, work, residual, invertible, lambda t, r, src: ops.gn_forward_(
                t, mean, var, weight, bias, r, eps, act, activation_param, signed, source=src), out=out)
        ctx.save_for_backward(saved_y, var, weight, bias, residual, mask)
        ctx.config = (eps, act, activation_param, signed, invertible, x.dtype, backend)
        return saved_y if compiled else _result(ctx, x, out)

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward("inplace_agn", "AGN layer (GroupNorm + activation)")
        return _InPlaceAGNFunction._backward(ctx, dy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, dy):
        y, var, weight, bias, residual, mask = ctx.saved_tensors
        eps, act, p, signed, invertible, dtype, backend = ctx.config
        ops = _groupnorm_ops.ops_for(y, backend)
        dy = _output_grad(dy, y, threshold=not invertible)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_r = residual is not None and ctx.needs_input_grad[3]
        G = var.shape[1]
        if (need_x or need_r) and _groupnorm_ops.native_backward(ops, y, act):  # the C++ layer's operator
            dx, dr, s_gz, s_gzx = torch.ops.inplace_abn.gn_backward(y, dy, mask, var, weight, bias, residual, G, eps,
                                                                     act, p, signed, need_r)
            dweight, dbias = _param_grads(s_gz, s_gzx, weight, bias, signed, need_w, need_b)
            return (dx if need_x else None, dweight, dbias, dr if need_r else None, None, None, None, None, None,
                    None)

        # (N, C) sums over the spatial positions of gz and gz xhat; SiLU on the
        # CPU keeps z for the second pass (docs/DESIGN.md section 7.2)
        z = torch.empty_like(y) if need_x and _groupnorm_ops.keeps_z(ops, y, act) else None
        extra = () if z is None else (z,)
        s_gz, s_gzx = ops.gn_backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed, *extra)
        dx = dr = None
        if need_x or need_r:
            N, C = y.shape[:2]
            if weight is None:
                g = torch.ones(C, dtype=s_gz.dtype, device=y.device)
            else:
                g = _activation.effective_weight(weight.detach().to(s_gz.dtype), eps, signed)
            m = y.numel() // (N * G) if N * G else 1  # elements per (n, group)
            # group means of g~ gz and g~ gz xhat, per sample (N, G)
            mean_ggz = (s_gz * g).view(N, G, C // G).sum(2) / m
            mean_ggzx = (s_gzx * g).view(N, G, C // G).sum(2) / m
            if z is None:
                dx, dr = ops.gn_backward_input(y, dy, mask, var, weight, bias, residual, mean_ggz, mean_ggzx, eps,
                                               act, p, signed, need_r)
            else:
                dx, dr = z, ops.gn_backward_input_from_z_(z, y, dy, var, weight, bias, residual, mean_ggz, mean_ggzx,
                                                          eps, act, p, signed, need_r)
            dx = dx.to(dtype) if need_x else None
            dr = dr.to(dtype) if need_r else None
        dweight, dbias = _param_grads(s_gz.sum(0), s_gzx.sum(0), weight, bias, signed, need_w, need_b)
        return dx, dweight, dbias, dr, None, None, None, None, None, None


def _check_groups(x, num_groups):
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(f"inplace_agn: num_groups must be a positive int, got {num_groups!r}")
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % num_groups:
        raise ValueError(
            f"inplace_agn: the input has {x.shape[1]} channels, which num_groups={num_groups} does not divide "
            "(GroupNorm needs C divisible by num_groups)"
        )


def _standard_ops(x, num_groups, weight, bias, eps, activation, activation_param, residual, weight_mode):
    """The same math with stock operators (group_norm + activation), not in
    place: what torch.export and torch.jit.trace record, so that exported
    programs hold only standard operators."""
    g = None if weight is None else _activation.effective_weight(weight, eps, weight_mode == "signed")
    z = F.group_norm(x, num_groups, g, bias, eps)
    if residual is not None:
        z = z + residual
    return _activation.apply(z, activation, activation_param)


def inplace_agn(
    x: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    activation: str = "silu",
    activation_param: float = 0.01,
    *,
    residual: Optional[torch.Tensor] = None,
    weight_mode: str = "abs",
    preserve_input: bool = False,
) -> torch.Tensor:
    """In-place activated GroupNorm.

    For each sample n and group k of C/num_groups consecutive channels, with
    mu, var over the group's channels and spatial positions
    (docs/DESIGN.md section 10)::

        z = g~_c * (x - mu_nk) / sqrt(var_nk + eps) + beta_c [+ residual]
        x <- f(z)

    with g~ the effective weight of `inplace_abn` (``weight_mode="abs"``:
    |weight| + eps, the convention of the BatchNorm layer; ``"signed"``:
    sign(weight) (|weight| + eps), so torch.nn.GroupNorm weights load with
    their signs).

    Args:
        x: (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W) floating tensor,
            contiguous or channels-last; overwritten with the result.
        num_groups: G, dividing C.
        weight, bias: (C,) affine parameters or None.
        eps: added to the variance, and to |weight|.
        activation: ``identity``, ``leaky_relu``, ``elu``, ``silu``/``swish``
            (``relu`` works but saves no memory, and warns once).
        activation_param: leaky_relu slope (> 0 to save memory) or elu alpha.
        residual: optional tensor shaped like x added before the activation,
            sharing no memory with x; it receives the gradient dL/dz.
        weight_mode: ``"abs"`` (default) or ``"signed"``.
        preserve_input: leave x as it is and return the output in a new
            tensor of x's shape and memory layout. The backward still keeps
            only the output, so this saves the same memory as the in-place
            form: for an x that is read again after the layer (a residual
            shortcut). It costs no extra pass over memory (the operators read
            x as their source), except for an x of other strides, which is
            copied first.

    Returns:
        x itself, holding the output (a new tensor with ``preserve_input``).

    Raises, before anything is written, as `inplace_abn` does: for an x that
    autograd would not let an in-place op modify, an x whose elements share
    memory, a residual sharing memory with x (none of these with
    ``preserve_input``), and C not divisible by num_groups. The backward
    raises under ``create_graph=True`` (use `AGN` for double backward).
    Under torch.func transforms and forward-mode AD it runs stock operators,
    as `inplace_abn` does.
    """
    _check_groups(x, num_groups)
    # weight and bias: on the native paths forward_ checks them before writing anything
    # (src/ops/forward.cpp), and Python then only to word a refusal as every path does
    # (below; ~1 us per tensor and call, as in functions._apply)
    _check_common("inplace_agn", x, residual, eps, activation, activation_param, weight_mode, check_channels=False,
                  weight=weight, bias=bias, writes_x=not preserve_input)
    per_channel = dict(weight=weight, bias=bias)
    exporting = torch.compiler.is_exporting() or torch.jit.is_tracing()
    if exporting or _stock_autodiff(x, residual, weight, bias):  # stock operators (torch.func, forward AD too)
        _check_channels("inplace_agn", x, per_channel)

        def standard(src):
            return _standard_ops(src, num_groups, weight, bias, float(eps), activation, float(activation_param),
                                 residual, weight_mode)

        return standard(x) if exporting else _stock_call(x, preserve_input, standard)
    invertible, act = _activation_code(activation, activation_param)
    preserve_input = _out_of_place(preserve_input)
    native = None
    if preserve_input and invertible and x.numel() > 0 and _native_eager(x) and _groupnorm_ops._native_ok(x, act):
        native = _NATIVE_AGN_OUT  # the C++ layer out of place: forward_ reads x, writes a new tensor
    elif (not preserve_input and invertible and x.numel() > 0 and _native_autograd(x, (x, weight, bias, residual))
            and _groupnorm_ops._native_ok(x, act)):
        native = _NATIVE_AGN  # eager: the same steps with the autograd in C++ (docs/DESIGN.md section 7.3)
    if native is not None:  # (src/ops/autograd.cpp; relu, not invertible, never comes here)
        try:
            return native(x, weight, bias, None if residual is None else _like_layout(residual, x), num_groups,
                          float(eps), act, float(activation_param), weight_mode == "signed")
        except (RuntimeError, ValueError, TypeError):
            _check_channels("inplace_agn", x, per_channel)  # this refusal in Python's words
            raise
    _check_channels("inplace_agn", x, per_channel)  # (a refusal comes before relu's warning)
    if not invertible:
        _activation.warn_not_invertible(activation, activation_param)
    args = (x, weight, bias, residual, num_groups, float(eps), activation, float(activation_param),
            weight_mode == "signed", preserve_input)
    return _run(_InPlaceAGNFunction, args, (x, weight, bias, residual))


_NATIVE_AGN = torch.ops.inplace_abn.inplace_agn_.default if _backend.HAS_NATIVE else None
_NATIVE_AGN_OUT = torch.ops.inplace_abn.inplace_agn.default if _backend.HAS_NATIVE else None


class AGN(nn.Module):
    """Activated GroupNorm: stock torch.nn.GroupNorm followed by an activation.

    The non-in-place twin of `InPlaceAGN` (it accepts ``relu`` too, and
    supports double backward). State-dict keys are those of
    torch.nn.GroupNorm (``weight``, ``bias``).

    Args:
        num_groups: G, dividing num_channels.
        num_channels: C.
        eps: added to the variance.
        affine: learn a per-channel weight (ones) and bias (zeros).
        activation: ``identity``, ``relu``, ``leaky_relu``, ``elu``, ``silu``/``swish``.
        activation_param: leaky_relu slope or elu alpha.
        device, dtype (keyword only): where and in which dtype the parameters
            are created.
    """

    __prepare_scriptable__ = refuse_torchscript

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 activation: str = "silu", activation_param: float = 0.01, *, device=None, dtype=None):
        super().__init__()
        _activation.check(activation, activation_param)
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
            raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
        if num_channels % num_groups:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        self.activation = activation
        self.activation_param = activation_param
        if affine:
            self.weight = nn.Parameter(torch.empty(num_channels, **factory_kwargs))
            self.bias = nn.Parameter(torch.empty(num_channels, **factory_kwargs))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return _activation.apply(y, self.activation, self.activation_param, inplace=True)

    def extra_repr(self) -> str:
        rep = f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, " \
              f"activation={self.activation}"
        if self.activation in ("leaky_relu", "elu"):
            rep += f"[{self.activation_param}]"
        return rep


class InPlaceAGN(AGN):
    """In-place activated GroupNorm: GroupNorm + activation fused into one
    operation that overwrites its input and keeps only its output for
    backward (docs/DESIGN.md section 10). Same arguments as `AGN`, plus:

    Args:
        weight_mode: ``"abs"`` (default, as `InPlaceABN`: the effective scale
            is |weight| + eps) or ``"signed"`` (sign(weight)(|weight| + eps):
            torch.nn.GroupNorm weights of either sign load with their meaning).
        preserve_input: keep x and return the output in a new tensor, still
            keeping only the output for backward (see `inplace_agn`): for an
            input that is read again after the layer.

    ``forward(x, residual=None)``: x of shape (N, C, ...) is overwritten with
    f(GN(x) + residual) and returned. relu (or leaky_relu with slope 0) is not
    invertible: such a layer stays correct but saves no memory, and warns once.
    """

    preserve_input = False  # default for layers pickled before the attribute existed

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 activation: str = "silu", activation_param: float = 0.01, weight_mode: str = "abs", *,
                 preserve_input: bool = False, device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps, affine, activation, activation_param, device=device,
                         dtype=dtype)
        if weight_mode not in WEIGHT_MODES:
            raise ValueError(f"weight_mode must be 'abs' or 'signed', got {weight_mode!r}")
        self.weight_mode = weight_mode
        self.preserve_input = preserve_input

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight, bias = module_affine(self)
        return inplace_agn(x, self.num_groups, weight, bias, self.eps, self.activation, self.activation_param,
                           residual=residual, weight_mode=self.weight_mode,
                           preserve_input=self.preserve_input)

    def extra_repr(self) -> str:
        rep = super().extra_repr() + (", weight_mode=signed" if self.weight_mode == "signed" else "")
        return rep + (", preserve_input=True" if self.preserve_input else "")


__all__ = ["inplace_agn", "AGN", "InPlaceAGN"]
