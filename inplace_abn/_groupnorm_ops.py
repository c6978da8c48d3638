"""The GroupNorm operators of the in-place activated GroupNorm
(docs/DESIGN.md section 10).

Schemas live in the ``inplace_abn`` operator namespace next to the BatchNorm
operators of ``src/ops/library.cpp``::

    gn_stats(Tensor x, int groups) -> (Tensor mean, Tensor var)          (N, G) each
    gn_forward_(Tensor(a!) x, Tensor mean, Tensor var, Tensor? weight, Tensor? bias,
                Tensor? residual, float eps, int activation, float activation_param,
                bool signed_weight, Tensor? source=None) -> Tensor mask      (source: read in x's place)
    gn_forward(Tensor x, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual,
                float eps, int activation, float activation_param, bool signed_weight)
                -> (Tensor y, Tensor mask)      gn_forward_'s functional twin, for compiled graphs:
                                                 y new, in x's layout (contiguous where the kernels
                                                 cannot walk x's), x only read
    gn_backward_reduce(Tensor y, Tensor dy, Tensor mask, Tensor? weight, Tensor? bias,
                Tensor? residual, float eps, int activation, float activation_param,
                bool signed_weight, Tensor(b!)? z_out=None)
                -> (Tensor sum_gz, Tensor sum_gzx)                         (N, C) each
    gn_backward_input(Tensor y, Tensor dy, Tensor mask, Tensor var, Tensor? weight,
                Tensor? bias, Tensor? residual, Tensor mean_ggz, Tensor mean_ggzx, float eps,
                int activation, float activation_param, bool signed_weight,
                bool residual_grad) -> (Tensor dx, Tensor dresidual)
    gn_backward_input_from_z_(Tensor(a!) z, Tensor y, Tensor dy, Tensor var, ..., bool residual_grad)
                -> Tensor dresidual      dx from y and z_out's kept inverse, written over it (7.2)

G is ``mean.shape[1]`` (``var.shape[1]``) after ``gn_stats``. Statistics and
sums are in the accumulation dtype (`_activation.acc_dtype`). The mask is the
SiLU branch mask of the BatchNorm operators (`_pure.pack_bits`, one bit per
element in memory order; empty for the other activations).

Each operator has a CompositeExplicitAutograd kernel (the pure-PyTorch
implementation below), a fake kernel and, wherever the native BatchNorm
kernels are built (CPU, CUDA), a kernel for that device that runs them on
views of the input (the "native" section below).
"""
from typing import Optional

import torch

from . import _activation as A
from . import _backend, _pure

OP_NAMES = ("gn_stats", "gn_forward_", "gn_forward", "gn_backward_reduce", "gn_backward_input",
            "gn_backward_input_from_z_")

SCHEMAS = {
    "gn_stats": "gn_stats(Tensor x, int groups) -> (Tensor, Tensor)",
    "gn_forward_": (
        "gn_forward_(Tensor(a!) x, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, "
        "float eps, int activation, float activation_param, bool signed_weight, Tensor? source=None) -> Tensor"),
    "gn_forward": (
        "gn_forward(Tensor x, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, Tensor? residual, "
        "float eps, int activation, float activation_param, bool signed_weight) -> (Tensor, Tensor)"),
    "gn_backward_reduce": (
        "gn_backward_reduce(Tensor y, Tensor dy, Tensor mask, Tensor? weight, Tensor? bias, Tensor? residual, "
        "float eps, int activation, float activation_param, bool signed_weight, Tensor(b!)? z_out=None) "
        "-> (Tensor, Tensor)"),
    "gn_backward_input": (
        "gn_backward_input(Tensor y, Tensor dy, Tensor mask, Tensor var, Tensor? weight, Tensor? bias, "
        "Tensor? residual, Tensor mean_ggz, Tensor mean_ggzx, float eps, int activation, float activation_param, "
        "bool signed_weight, bool residual_grad) -> (Tensor, Tensor)"),
    # SiLU, float32/float64 (docs/DESIGN.md section 7.2): dx from y and what
    # gn_backward_reduce kept of the inverse in z_out (z itself in the pure kernels,
    # h = z / y or a coded z in the native AVX2/AVX512 float32 ones), written over
    # it; returns dresidual
    "gn_backward_input_from_z_": (
        "gn_backward_input_from_z_(Tensor(a!) z, Tensor y, Tensor dy, Tensor var, Tensor? weight, Tensor? bias, "
        "Tensor? residual, Tensor mean_ggz, Tensor mean_ggzx, float eps, int activation, float activation_param, "
        "bool signed_weight, bool residual_grad) -> Tensor"),
}


# ---- pure-PyTorch implementation (docs/DESIGN.md section 10) -----------------


def _per_sample_channel(v: torch.Tensor, C: int, ndim: int) -> torch.Tensor:
    """(N, G) per-group values as (N, C, 1, ...): each group's value on its C/G channels."""
    N, G = v.shape
    return v.repeat_interleave(C // G, dim=1).view((N, C) + (1,) * (ndim - 2))


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view((1, -1) + (1,) * (ndim - 2))


def _spatial_sum(t: torch.Tensor) -> torch.Tensor:
    """(N, C) sums over the spatial dimensions, accumulated in float64."""
    if t.dim() == 2:
        return t.double()
    return t.sum(list(range(2, t.dim())), dtype=torch.float64)


def gn_stats(x, groups):
    acc = A.acc_dtype(x.dtype)
    N = x.shape[0]
    if x.numel() == 0:
        z = torch.zeros(N, groups, dtype=acc, device=x.device)
        return z, z.clone()
    # float64: robust on any group size (as _pure.batch_stats)
    var, mean = torch.var_mean(x.double().reshape(N, groups, -1), dim=2, correction=0)
    return mean.to(acc), var.to(acc)


def gn_forward_(x, mean, var, weight, bias, residual, eps, act, p, signed, source=None):
    acc = A.acc_dtype(x.dtype)
    src = _pure.read_from(x, source)
    C, nd = x.shape[1], x.dim()
    g, b = _pure._coefficients(weight, bias, eps, signed, C, acc, x.device)
    rstd = _per_sample_channel(torch.rsqrt(var.to(acc) + eps), C, nd)
    # (x - mean) first, as the BatchNorm forward (docs/DESIGN.md section 1)
    z = (src.to(acc) - _per_sample_channel(mean.to(acc), C, nd)) * (rstd * _per_channel(g, nd)) + _per_channel(b, nd)
    if residual is not None:
        z += residual.to(acc)
    if act == A.SILU:
        mask = _pure.pack_bits(z < _pure.SILU_ZSTAR)
    else:
        mask = torch.empty(0, dtype=torch.int32, device=x.device)
    x.copy_(_pure.forward_act(z, act, p))
    return mask


def _functional(forward_):
    """The functional twin of a ``forward_`` (gn_forward_ / native_gn_forward_): (y, mask), y a new tensor in
    x's layout. Compiled graphs call it: through forward_ into an empty_like(x) with source=x, inductor copied
    x to the traced (contiguous) layout after its channels-last convolutions (docs/DESIGN.md section 5.1)."""
    def forward(x, mean, var, weight, bias, residual, eps, act, p, signed):
        x = _pure.walkable(x)
        y = torch.empty_like(x)
        return y, forward_(y, mean, var, weight, bias, residual, eps, act, p, signed, x)
    return forward


gn_forward = _functional(gn_forward_)


def gn_backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed, z_out=None):
    # z, f'(z) and xhat from y: per element and per channel, so the BatchNorm recomputation serves as is
    fp, xhat, _ = _pure._recompute(y, mask, weight, bias, residual, eps, act, p, signed, z_out)
    gz = dy.to(fp.dtype) * fp
    return _spatial_sum(gz).to(fp.dtype), _spatial_sum(gz * xhat).to(fp.dtype)


def gn_backward_input(y, dy, mask, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p, signed,
                      residual_grad):
    fp, xhat, g = _pure._recompute(y, mask, weight, bias, residual, eps, act, p, signed)
    return _gn_dx(fp, xhat, g, y, dy, var, mean_ggz, mean_ggzx, eps, residual_grad)


def _gn_dx(fp, xhat, g, y, dy, var, mean_ggz, mean_ggzx, eps, residual_grad):
    C, nd = y.shape[1], y.dim()
    gz = dy.to(fp.dtype) * fp
    rstd = _per_sample_channel(torch.rsqrt(var.to(fp.dtype) + eps), C, nd)
    dx = rstd * (_per_channel(g, nd) * gz - _per_sample_channel(mean_ggz.to(fp.dtype), C, nd)
                 - xhat * _per_sample_channel(mean_ggzx.to(fp.dtype), C, nd))
    dr = gz.to(y.dtype) if residual_grad else torch.empty(0, dtype=y.dtype, device=y.device)
    return dx.to(y.dtype), dr


def gn_backward_input_from_z_(z, y, dy, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p, signed,
                              residual_grad):
    fp, xhat, g = _pure.from_z(z, weight, bias, residual, eps, signed)
    dx, dr = _gn_dx(fp, xhat, g, y, dy, var, mean_ggz, mean_ggzx, eps, residual_grad)
    z.copy_(dx)
    return dr


PURE = {name: globals()[name] for name in OP_NAMES}


# ---- native: the BatchNorm kernels on GroupNorm views (docs/DESIGN.md section 10) ----
#
# GroupNorm's statistics are BatchNorm statistics of a view: a contiguous
# (N, C, *) tensor seen as (1, N*G, (C/G)*S) has one "channel" per (n, group),
# and seen as (1, N*C, S) one "channel" per (n, c), whose coefficients are the
# per-sample ones of GroupNorm. So the four vectorised, parallel and
# deterministic BatchNorm kernels of src/ (CPU and CUDA) do all the element
# work, and only (N, C)-sized vectors are built here. A channels-last tensor
# has no such view (n and c are not adjacent in memory): its samples run one
# at a time, each a (1, C, ...) channels-last BatchNorm input.

_BN = torch.ops.inplace_abn


def _native_ok(x, act):
    """Whether the BatchNorm kernels serve this call. A channels-last SiLU mask
    concatenates per-sample masks, which is the memory-order mask of the whole
    tensor only when every sample fills whole 32-bit words; other shapes take
    the pure kernels (forward and backward decide alike: y has x's layout)."""
    if not _pure.is_channels_last(x) or act != A.SILU:
        return True
    return (x.numel() // max(x.shape[0], 1)) % 32 == 0


def native_gn_stats(x, groups):
    if x.numel() == 0:
        return gn_stats(x, groups)
    return _BN.batch_stats(_pure.walkable(x), None, None, 0.0, groups)


def native_gn_forward_(x, mean, var, weight, bias, residual, eps, act, p, signed, source=None):
    if not _native_ok(x, act):
        return gn_forward_(x, mean, var, weight, bias, residual, eps, act, p, signed, source)
    if x.numel() == 0:
        return x.new_empty(0, dtype=torch.int32)
    return _BN.forward_(x, mean, var, weight, bias, residual, eps, act, p, signed, None, mean.shape[1], source)


native_gn_forward = _functional(native_gn_forward_)


def native_gn_backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed, z_out=None):
    if not _native_ok(y, act) or y.numel() == 0 or (z_out is not None and not y.is_cpu):
        return gn_backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed, z_out)
    # (groups: any divisor of C gives the same (N, C) sums)
    return _BN.backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed, z_out, 1)


def native_gn_backward_input(y, dy, mask, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p, signed,
                             residual_grad):
    if not _native_ok(y, act) or y.numel() == 0:
        return gn_backward_input(y, dy, mask, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p, signed,
                                 residual_grad)
    return _BN.backward_input(y, dy, mask, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p, signed,
                              residual_grad, 1.0, var.shape[1])


def native_gn_backward_input_from_z_(z, y, dy, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p,
                                    signed, residual_grad):
    # (the fallback condition is native_gn_backward_reduce's: z holds what that reduce kept)
    if not _native_ok(y, act) or y.numel() == 0 or not y.is_cpu:
        return gn_backward_input_from_z_(z, y, dy, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p,
                                         signed, residual_grad)
    return _BN.backward_input_from_z_(z, y, dy, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, act, p, signed,
                                      residual_grad, 1.0, var.shape[1])


# ---- registration --------------------------------------------------------------

_lib = torch.library.Library("inplace_abn", "FRAGMENT")
# gn_stats and gn_forward take x in any layout (`_pure.walkable`): compiled graphs then hand it over in
# theirs, without a copy to the traced strides (docs/DESIGN.md section 5.1)
FLEXIBLE = (torch.Tag.flexible_layout,)


def _declared(name):
    try:
        torch._C._get_schema(f"inplace_abn::{name}", "")
    except RuntimeError:
        return False
    return True


NATIVE = {name: globals()["native_" + name] for name in OP_NAMES}


def _register():
    # where the BatchNorm kernels exist (without the extension, nowhere: these operators
    # then run their pure kernels everywhere)
    native_keys = [key for key, device in (("CPU", "cpu"), ("CUDA", "cuda")) if _backend._has_device_kernel(device)]
    for name in OP_NAMES:
        if not _declared(name):
            _lib.define(SCHEMAS[name], tags=FLEXIBLE if name in ("gn_stats", "gn_forward") else ())
        _lib.impl(name, PURE[name], "CompositeExplicitAutograd")
        for key in native_keys:
            _lib.impl(name, NATIVE[name], key)

    def acc(t):
        return A.acc_dtype(t.dtype)

    @torch.library.register_fake("inplace_abn::gn_stats", lib=_lib)
    def _(x, groups):
        return x.new_empty(x.shape[0], groups, dtype=acc(x)), x.new_empty(x.shape[0], groups, dtype=acc(x))

    @torch.library.register_fake("inplace_abn::gn_forward_", lib=_lib)
    def forward_fake(x, mean, var, weight, bias, residual, eps, activation, activation_param, signed_weight,
                     source=None):
        words = (x.numel() + 31) // 32 if activation == A.SILU else 0
        return x.new_empty(words, dtype=torch.int32)

    @torch.library.register_fake("inplace_abn::gn_forward", lib=_lib)
    def _(x, mean, var, weight, bias, residual, eps, activation, activation_param, signed_weight):
        y = torch.empty_like(_pure.walkable(x))
        return y, forward_fake(y, mean, var, weight, bias, residual, eps, activation, activation_param, signed_weight)

    @torch.library.register_fake("inplace_abn::gn_backward_reduce", lib=_lib)
    def _(y, dy, mask, weight, bias, residual, eps, activation, activation_param, signed_weight, z_out=None):
        N, C = y.shape[:2]
        return y.new_empty(N, C, dtype=acc(y)), y.new_empty(N, C, dtype=acc(y))

    @torch.library.register_fake("inplace_abn::gn_backward_input", lib=_lib)
    def _(y, dy, mask, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, activation, activation_param,
          signed_weight, residual_grad):
        return torch.empty_like(y), (torch.empty_like(y) if residual_grad else y.new_empty(0))

    @torch.library.register_fake("inplace_abn::gn_backward_input_from_z_", lib=_lib)
    def _(z, y, dy, var, weight, bias, residual, mean_ggz, mean_ggzx, eps, activation, activation_param, signed_weight,
          residual_grad):
        return torch.empty_like(z) if residual_grad else z.new_empty(0)


_register()


class _Ops:
    """The operators under their schema names, as the backend chooses them."""

    def __init__(self, table):
        self.__dict__.update(table)


_PURE_OPS = _Ops(PURE)
_DISPATCHED_OPS = _Ops({name: getattr(torch.ops.inplace_abn, name) for name in OP_NAMES})


def native_backward(ops, y: torch.Tensor, act: int) -> bool:
    """Whether the backward on y runs the native ``inplace_abn::gn_backward`` (the
    operator of the C++ layer, src/ops/gn_backward.cpp): the dispatched operators on
    a device with native kernels, where their forward used the native kernels too."""
    return (ops is _DISPATCHED_OPS and _backend._has_device_kernel("cpu" if y.is_cpu else y.device.type)
            and _native_ok(y, act))


def keeps_z(ops, y: torch.Tensor, act: int) -> bool:
    """Whether the backward keeps z between its passes (`_backend.silu_keeps_z`)
    with the dispatched operators (their CPU kernels are the native ones)."""
    return ops is _DISPATCHED_OPS and _backend.silu_keeps_z(y, act)


def ops_for(x: torch.Tensor, choice: Optional[str] = None):
    """The pure functions under ``use_backend("python")`` (or ``choice``), else the
    dispatched operators (a device's native kernel where one is registered, else
    the composite pure kernel)."""
    choice = _backend.current() if choice is None else choice
    return _PURE_OPS if choice == "python" else _DISPATCHED_OPS
