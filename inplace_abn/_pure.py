"""Pure-PyTorch backend: the four operators of ``src/ops.cpp`` written with
torch ops, for devices without native kernels and for machines where the
extension could not be built.

It has the same memory behaviour as the native backend: the forward
overwrites ``x`` and the backward recomputes z and xhat from y (temporaries
live only inside one call). The math mirrors ``src/activations.h``.
"""
import math

import torch

from . import _activation as A

SILU_ZSTAR = -1.2784645427610738
SILU_YSTAR = -0.2784645427610738
SILU_CURV = 0.2178117057198001


acc_dtype = A.acc_dtype


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view((1, -1) + (1,) * (ndim - 2))


def memory_order(x: torch.Tensor) -> torch.Tensor:
    """A view of ``x`` whose row-major order is x's memory order."""
    if x.is_contiguous():
        return x
    if x.dim() in (4, 5) and x.is_contiguous(
        memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    ):
        return x.movedim(1, -1)
    raise ValueError("inplace_abn: expected a contiguous or channels-last tensor")


def _coefficients(weight, bias, eps, signed, C, dtype, device):
    """g~ and beta as (C,) tensors in the accumulation dtype."""
    if weight is None:
        g = torch.ones(C, dtype=dtype, device=device)
    else:
        g = A.effective_weight(weight.detach().to(dtype), eps, signed)
    b = torch.zeros(C, dtype=dtype, device=device) if bias is None else bias.to(dtype)
    return g, b


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (in memory order) into int32 words, bit e%32 of word e//32."""
    flat = memory_order(bits).reshape(-1)
    n = flat.numel()
    words = (n + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.int64, device=bits.device)
    padded[:n] = flat.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, device=bits.device)).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_bits(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_bits`: a bool tensor shaped and laid out like ``like``."""
    shifts = torch.arange(32, device=mask.device, dtype=torch.int64)
    bits = ((mask.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[: like.numel()].bool()
    out = torch.empty_like(like, dtype=torch.bool)
    view = memory_order(out)
    view.copy_(bits.view(view.shape))
    return out


# ---- element-wise math (mirrors src/activations.h) -------------------------


# ELU, as Activation<Act::Elu> in src/activations.h: the forward keeps
# expm1(z) one ulp above -1, so an output stored in float32 or float64 stays
# above -alpha. A y below the forward's least output (y <= -alpha) was rounded
# there by a half-precision store and has no preimage: it is read as
# e^z = 2^-11, between bfloat16's saturation (e^z < 2^-9) and float16's
# (e^z < 2^-12), which the backward cannot tell apart (docs/DESIGN.md section 5).
_ELU_MIN_EXPM1 = {torch.float32: -1 + 2.0**-24, torch.float64: -1 + 2.0**-53}
_ELU_SATURATED_EXPM1 = 2.0**-11 - 1


def _elu_unsaturate(y, p):
    least = p * torch.full((), _ELU_MIN_EXPM1[y.dtype], dtype=y.dtype, device=y.device)
    return torch.where(y < least, p * _ELU_SATURATED_EXPM1, y)


def forward_act(z, act, p):
    if act == A.IDENTITY:
        return z
    if act == A.LEAKY_RELU:
        return torch.where(z >= 0, z, z * p)
    if act == A.ELU:
        return torch.where(z >= 0, z, p * torch.expm1(z.clamp(max=0)).clamp(min=_ELU_MIN_EXPM1[z.dtype]))
    return z * torch.sigmoid(z)


def _silu_inverse(y, left):
    tiny = 1e-30 if y.dtype != torch.float64 else 1e-300
    iters = 3 if y.dtype == torch.float64 else 2
    zs = SILU_ZSTAR
    y = y.clamp(min=SILU_YSTAR)
    d = torch.sqrt((2.0 / SILU_CURV * (y - SILU_YSTAR)).clamp(min=0))
    t = torch.log((-y).clamp(min=tiny))
    zf = t - torch.log((-t).clamp(min=1.0))
    near = y < -0.2
    zl = torch.where(near, zs - d, torch.minimum(zs - d, zf))
    zr = torch.where(y >= 0, torch.maximum(zs + d, y), zs + d)
    z = torch.where(left, zl, zr)
    uselog = left & ~near
    for _ in range(iters):
        s = torch.sigmoid(z)
        one_s = 1 - s
        g = z * s - y
        gp = s * (1 + z * one_s)
        gpp = s * one_s * (2 + z * (1 - 2 * s))
        zneg = z.clamp(max=-tiny)
        h = torch.log(-zneg) + torch.log(s.clamp(min=tiny)) - t
        hp = 1 / zneg + one_s
        hpp = -1 / (zneg * zneg) - s * one_s
        g = torch.where(uselog, h, g)
        gp = torch.where(uselog, hp, gp)
        gpp = torch.where(uselog, hpp, gpp)
        den = gp * gp - 0.5 * g * gpp
        den = torch.where(den.abs() < tiny, torch.full_like(den, tiny), den)
        z = z - g * gp / den
        z = torch.where(left, z.clamp(max=zs), z.clamp(min=zs))
    return z


def inverse_act(y, left, act, p):
    if act == A.IDENTITY:
        return y
    if act == A.LEAKY_RELU:
        return torch.where(y >= 0, y, y / p)
    if act == A.ELU:
        return torch.where(torch.signbit(y), torch.log1p(_elu_unsaturate(y, p) / p), y)
    return _silu_inverse(y.double(), left).to(y.dtype)


def deriv_act(y, z, act, p):
    if act == A.IDENTITY:
        return torch.ones_like(y)
    if act == A.LEAKY_RELU:
        return torch.where(y >= 0, torch.ones_like(y), torch.full_like(y, p))
    if act == A.ELU:
        return torch.where(torch.signbit(y), _elu_unsaturate(y, p) + p, torch.ones_like(y))
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


# ---- the four operators ----------------------------------------------------


def batch_stats(x):
    acc = acc_dtype(x.dtype)
    C = x.shape[1]
    if x.numel() == 0:
        z = torch.zeros(C, dtype=acc, device=x.device)
        return z, z.clone()
    dims = [0] + list(range(2, x.dim()))
    var, mean = torch.var_mean(x.double(), dim=dims, correction=0)  # float64: robust on any batch
    return mean.to(acc), var.to(acc)


def forward_(x, mean, var, weight, bias, residual, eps, act, p, signed):
    acc = acc_dtype(x.dtype)
    C, nd = x.shape[1], x.dim()
    g, b = _coefficients(weight, bias, eps, signed, C, acc, x.device)
    scale = g * torch.rsqrt(var.to(acc) + eps)
    # (x - mean) first: exact for x near a large mean, so no per-element
    # rounding noise of x * scale enters y (and, through y, the backward).
    z = (x.to(acc) - _per_channel(mean.to(acc), nd)) * _per_channel(scale, nd) + _per_channel(b, nd)
    if residual is not None:
        z += residual.to(acc)
    if act == A.SILU:
        mask = pack_bits(z < SILU_ZSTAR)
    else:
        mask = torch.empty(0, dtype=torch.int32, device=x.device)
    x.copy_(forward_act(z, act, p))
    return mask


def _recompute(y, mask, weight, bias, residual, eps, act, p, signed):
    """z, gz's factor f'(z) and xhat from y alone (one call's temporaries)."""
    acc = acc_dtype(y.dtype)
    C, nd = y.shape[1], y.dim()
    g, b = _coefficients(weight, bias, eps, signed, C, acc, y.device)
    ya = y.to(acc)
    left = unpack_bits(mask, y) if act == A.SILU else None
    z = inverse_act(ya, left, act, p)
    fp = deriv_act(ya, z, act, p)
    if residual is not None:
        z = z - residual.to(acc)
    xhat = (z - _per_channel(b, nd)) / _per_channel(g, nd)
    return fp, xhat, g


def backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed):
    fp, xhat, _ = _recompute(y, mask, weight, bias, residual, eps, act, p, signed)
    gz = dy.to(fp.dtype) * fp
    dims = [0] + list(range(2, y.dim()))
    if y.numel() == 0:
        zeros = torch.zeros(y.shape[1], dtype=fp.dtype, device=y.device)
        return zeros, zeros.clone()
    # float64 accumulation: large batches lose nothing to the summation order
    return gz.sum(dims, dtype=torch.float64).to(fp.dtype), (gz * xhat).sum(dims, dtype=torch.float64).to(fp.dtype)


def backward_input(y, dy, mask, var, weight, bias, residual, mean_gz, mean_gzx, eps, act, p, signed, residual_grad):
    fp, xhat, g = _recompute(y, mask, weight, bias, residual, eps, act, p, signed)
    nd = y.dim()
    gz = dy.to(fp.dtype) * fp
    scale = g * torch.rsqrt(var.to(fp.dtype) + eps)
    dx = _per_channel(scale, nd) * (gz - _per_channel(mean_gz.to(fp.dtype), nd) - xhat * _per_channel(mean_gzx.to(fp.dtype), nd))
    dx = dx.to(y.dtype)
    dr = gz.to(y.dtype) if residual_grad else torch.empty(0, dtype=y.dtype, device=y.device)
    return dx, dr
