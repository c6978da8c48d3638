"""Pure-PyTorch backend: the operators of ``src/ops/library.cpp`` written with
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


acc_dtype = A.acc_dtype


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view((1, -1) + (1,) * (ndim - 2))


def is_channels_last(x: torch.Tensor) -> bool:
    """Channels-last (4-D) or channels-last-3d (5-D) memory, and not also contiguous."""
    return x.dim() in (4, 5) and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def can_walk(x: torch.Tensor) -> bool:
    """Whether the native kernels walk x's memory as it is: contiguous or channels-last."""
    return x.is_contiguous() or is_channels_last(x)


def walkable(x: torch.Tensor) -> torch.Tensor:
    """x itself where the kernels can walk it, else a contiguous copy (as the native
    functional forwards do, src/ops/functional_forward.cpp)."""
    return x if can_walk(x) else x.contiguous()


def memory_order(x: torch.Tensor) -> torch.Tensor:
    """A view of ``x`` whose row-major order is x's memory order."""
    if x.is_contiguous():
        return x
    if is_channels_last(x):
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
# (e^z < 2^-12), which the backward cannot tell apart (docs/DESIGN.md section 8).
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


# SiLU inverse: the algorithm of Activation<Act::Silu> in src/activations.h,
# step for step and in the same precision (float32 for every dtype but
# float64), so both backends read y, its sign bit and the branch bit the same
# way and differ only by the last bits of exp / log / reciprocal (docs/DESIGN.md
# section 3). The polynomial coefficients are those of activations.h.
_SILU_P_RIGHT = (-0.0043686086494414723, 0.062003737048004402, -0.36262603785051117, 1.1115199507157363,
                 -1.9551651604062918, 2.3944104373567097, -2.0065284169598572, 3.0292001880235917)
_SILU_P_LEFT = (-2456.5751156132851, 2846.9829655336471, -1371.8111195864028, 319.24391719304128,
                -44.01896125413203, -0.55674147407820462, -2.1119491106932879, -3.0300407982908322)
_SILU_P_MID = (-6.6388539923139274e-06, 2.3622421356503015e-05, -1.2901139011804238e-05, 9.4744024228088976e-05,
               -0.00079536020730284172, 0.0036689775722755966, -0.020607534197272181, 0.18296765133101114,
               1.874256446353217)
_SILU_P_TAIL = (-1.4676309751270514e-05, 5.055591860745925e-05, 8.1898479707041648e-05, -0.0002393719920013013,
                -0.00040097981410288264, -0.0019697637817100858, 0.0201733419042236, 0.93583540482163208,
                3.8116962991303072)


def _horner(u, coefs):
    """coefs[0] u^k + ... + coefs[k], as the fma chains of activations.h (numbers or per-lane tensors)."""
    p = u * coefs[0] + coefs[1]
    for c in coefs[2:]:
        p = u * p + c
    return p


def _silu_zmin(dtype):
    """Lowest z the left branch returns (e^-z finite): zmin() of activations.h."""
    return -700.0 if dtype == torch.float64 else -87.0


def _silu_guess(y, left):
    """Initial guess of activations.h (y >= y* already); returns (z, d = sqrt(y - y*))."""

    def pick(r, l):  # per lane: l on the left branch, r on the right, in y's dtype
        return torch.where(left, torch.full_like(y, l), torch.full_like(y, r))

    d = torch.sqrt(y - SILU_YSTAR)
    # z* + d P(d), P_R on the right branch (d <= sqrt(8 - y*)), P_L on the left (d <= sqrt(-0.1 - y*))
    dd = torch.minimum(d, pick(2.8772320974785948, 0.4224506394374067))
    c = [pick(r, l) for r, l in zip(_SILU_P_RIGHT, _SILU_P_LEFT)]  # c8 .. c1
    # Estrin's scheme, as activations.h evaluates it
    dd2 = dd * dd
    q0, q1, q2, q3 = dd * c[6] + c[7], dd * c[4] + c[5], dd * c[2] + c[3], dd * c[0] + c[1]
    z = dd * ((dd2 * dd2) * (dd2 * q3 + q2) + (dd2 * q1 + q0)) + SILU_ZSTAR
    z = torch.where(y > 8.0, y, z)  # right branch, y > 8: z = y
    # left tail, y > -0.1: v = -log(-y), -z = v + P_M(v) (v <= 7) or v + P_T(log v)
    tail = left & (y > -0.1)
    v = -torch.log(torch.clamp(0.0 - y, min=torch.finfo(y.dtype).tiny))
    zt = -(v + _horner(torch.clamp(v, max=7.0) - 4.6512925464970225, _SILU_P_MID))
    lg = torch.clamp(torch.log(torch.clamp(v, min=2.302585092994046)) - 3.7237083318137576, max=2.889675886565802)
    zt = torch.where(tail & (v > 7.0), -(v + _horner(lg, _SILU_P_TAIL)), zt)
    return torch.where(tail, torch.clamp(zt, min=_silu_zmin(y.dtype)), z), d


def _silu_inverse_deriv(y, left):
    """z = f^-1(y) on the branch ``left`` (bool) and f'(z), as Activation<Silu>::inverse_deriv.

    y of any floating dtype; computed in its accumulation dtype and returned in it.
    """
    y = y.to(A.acc_dtype(y.dtype))
    single = y.dtype != torch.float64
    # max(y, y*) as activations.h writes it (y > y* ? y : y*): keeps -0.0
    y = torch.where(y > SILU_YSTAR, y, torch.full_like(y, SILU_YSTAR))
    z, d = _silu_guess(y, left)
    # No Halley step within d_skip of y*, where the guess is already within the conditioning error.
    skip = d < (1e-2 if single else 1e-7)
    iters = 1 if single else 2
    for i in range(iters):
        e = torch.exp(-z)
        q = 1.0 + e
        s = 1.0 / q
        oms = e * s  # 1 - s, accurate when s -> 1
        g = z - y * q
        gp = z * oms + 1.0
        gpp = oms * (z * (-2.0 * s + 1.0) + 2.0)
        den = (-0.5 * g) * gpp + gp * gp
        dz = torch.where(skip, torch.zeros_like(z), g * gp * (1.0 / den))
        if i + 1 < iters:
            zn = torch.clamp(z - dz, min=_silu_zmin(y.dtype))  # e^-z must stay finite for the next step
            dz = z - zn
            z = zn
        else:
            z = torch.clamp(z - dz, min=_silu_zmin(y.dtype))  # deriv_of_z needs e^-z finite too
    # f'(z - dz) = f'(z) - f''(z) dz, with f' = s gp, f'' = s gpp
    return z, s * (gp - gpp * dz)


def inverse_act(y, left, act, p):
    if act == A.IDENTITY:
        return y
    if act == A.LEAKY_RELU:
        return torch.where(torch.signbit(y), y / p, y)
    if act == A.ELU:
        return torch.where(torch.signbit(y), torch.log1p(_elu_unsaturate(y, p) / p), y)
    return _silu_inverse_deriv(y, left)[0].to(y.dtype)


def deriv_act(y, z, act, p):
    if act == A.IDENTITY:
        return torch.ones_like(y)
    if act == A.LEAKY_RELU:
        return torch.where(y > 0, torch.ones_like(y), torch.full_like(y, p))  # f'(0): the left one, as torch
    if act == A.ELU:
        return torch.where(y > 0, torch.ones_like(y), _elu_unsaturate(y, p) + p)
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


# ---- the operators ---------------------------------------------------------


def move_running(r, s, factor, m, keep=None):
    """r <- (1 - m) r + m (s factor), in float64, rounded to r's dtype: the formula of the
    native batch_stats (src/ops/batch_stats.cpp), so both give the same bits. ``factor``
    may be a device tensor; where the 0-dim bool ``keep`` is True, r is left as it is."""
    new = r.double() * (1.0 - m) + (s.double() * factor) * m
    if keep is not None:
        new = torch.where(keep, r, new)
    r.copy_(new)


def batch_stats(x, running_mean=None, running_var=None, momentum=0.0):
    acc = acc_dtype(x.dtype)
    C = x.shape[1]
    if x.numel() == 0:  # n = 0: the running statistics stay as they are
        z = torch.zeros(C, dtype=acc, device=x.device)
        return z, z.clone()
    n = x.numel() // C
    if (running_mean is not None or running_var is not None) and n <= 1:
        raise RuntimeError(f"inplace_abn: expected more than 1 value per channel when training, got {n}")
    dims = [0] + list(range(2, x.dim()))
    var, mean = torch.var_mean(x.double(), dim=dims, correction=0)  # float64: robust on any batch
    mean, var = mean.to(acc), var.to(acc)
    with torch.no_grad():
        if running_mean is not None:
            move_running(running_mean, mean, 1.0, momentum)
        if running_var is not None:
            move_running(running_var, var, n / (n - 1), momentum)
    return mean, var


def weight_grad(sum_gz_xhat, weight, signed):
    """dweight = S_gx dg~/dweight: sign(weight) (abs mode) or 1 (signed), in weight's dtype."""
    if signed:
        return sum_gz_xhat.to(weight.dtype, copy=True)
    return (sum_gz_xhat * torch.sign(weight.detach().to(sum_gz_xhat.dtype))).to(weight.dtype)


def read_from(x, source):
    """The tensor a forward reads: x, or ``source`` (the out-of-place layer), which must
    have x's shape, dtype, device and strides (as the native forward_ checks)."""
    if source is None:
        return x
    if (source.shape != x.shape or source.dtype != x.dtype or source.device != x.device
            or source.stride() != x.stride()):
        raise RuntimeError(f"inplace_abn: source must have x's shape, dtype, device and strides ({tuple(x.shape)} "
                           f"{x.dtype} on {x.device}, strides {x.stride()}), got {tuple(source.shape)} "
                           f"{source.dtype} on {source.device}, strides {source.stride()}")
    return source


def forward_(x, mean, var, weight, bias, residual, eps, act, p, signed, z_out=None, source=None):
    """y into x from x itself or, with ``source`` (x's shape and layout), from source."""
    if z_out is not None and act != A.IDENTITY:
        raise RuntimeError(f"inplace_abn: z_out is the ReLU path and needs activation 0 (identity), got {act}")
    acc = acc_dtype(x.dtype)
    C, nd = x.shape[1], x.dim()
    g, b = _coefficients(weight, bias, eps, signed, C, acc, x.device)
    scale = g * torch.rsqrt(var.to(acc) + eps)
    # (x - mean) first: exact for x near a large mean, so no per-element
    # rounding noise of x * scale enters y (and, through y, the backward).
    src = read_from(x, source)
    z = (src.to(acc) - _per_channel(mean.to(acc), nd)) * _per_channel(scale, nd) + _per_channel(b, nd)
    if residual is not None:
        z += residual.to(acc)
    if act == A.SILU:
        mask = pack_bits(z < SILU_ZSTAR)
    else:
        mask = torch.empty(0, dtype=torch.int32, device=x.device)
    if z_out is not None:  # ReLU (identity code): z kept for backward, max(z, 0) into x
        z_out.copy_(z)
        x.copy_(torch.relu(z))
    else:
        x.copy_(forward_act(z, act, p))
    return mask


def _recompute(y, mask, weight, bias, residual, eps, act, p, signed, z_out=None):
    """gz's factor f'(z), xhat and g~ from y alone (one call's temporaries); z
    itself is copied into ``z_out`` when given."""
    acc = acc_dtype(y.dtype)
    C, nd = y.shape[1], y.dim()
    g, b = _coefficients(weight, bias, eps, signed, C, acc, y.device)
    ya = y.to(acc)
    if act == A.SILU:  # z and f'(z) from one Halley iteration, as the native kernels
        z, fp = _silu_inverse_deriv(ya, unpack_bits(mask, y))
    else:
        z = inverse_act(ya, None, act, p)
        fp = deriv_act(ya, z, act, p)
    if z_out is not None:
        z_out.copy_(z)
    return (fp,) + _xhat(z, g, b, residual, nd)


def _xhat(z, g, b, residual, nd):
    """(xhat, g~): xhat = (z [- residual] - beta) / g~."""
    if residual is not None:
        z = z - residual.to(z.dtype)
    return (z - _per_channel(b, nd)) / _per_channel(g, nd), g


def from_z(z, weight, bias, residual, eps, signed):
    """f'(z), xhat and g~ from a stored SiLU z (docs/DESIGN.md section 7.2)."""
    g, b = _coefficients(weight, bias, eps, signed, z.shape[1], z.dtype, z.device)
    return (deriv_act(None, z, A.SILU, 0.0),) + _xhat(z, g, b, residual, z.dim())


def backward_reduce(y, dy, mask, weight, bias, residual, eps, act, p, signed):
    fp, xhat, _ = _recompute(y, mask, weight, bias, residual, eps, act, p, signed)
    gz = dy.to(fp.dtype) * fp
    dims = [0] + list(range(2, y.dim()))
    if y.numel() == 0:
        zeros = torch.zeros(y.shape[1], dtype=fp.dtype, device=y.device)
        return zeros, zeros.clone()
    # float64 accumulation: large batches lose nothing to the summation order
    return gz.sum(dims, dtype=torch.float64).to(fp.dtype), (gz * xhat).sum(dims, dtype=torch.float64).to(fp.dtype)


def _scaled(v, k, dtype):
    """k v in ``dtype`` (k = 0: zeros, whatever v holds; k = 1: v itself)."""
    if k == 0.0:
        return torch.zeros(v.shape, dtype=dtype, device=v.device)
    return v.to(dtype) if k == 1.0 else (v.double() * k).to(dtype)


def backward_input(y, dy, mask, var, weight, bias, residual, mean_gz, mean_gzx, eps, act, p, signed, residual_grad,
                   sums_scale=1.0):
    fp, xhat, g = _recompute(y, mask, weight, bias, residual, eps, act, p, signed)
    nd = y.dim()
    gz = dy.to(fp.dtype) * fp
    scale = g * torch.rsqrt(var.to(fp.dtype) + eps)
    mean_gz, mean_gzx = _scaled(mean_gz, sums_scale, fp.dtype), _scaled(mean_gzx, sums_scale, fp.dtype)
    dx = _per_channel(scale, nd) * (gz - _per_channel(mean_gz, nd) - xhat * _per_channel(mean_gzx, nd))
    dx = dx.to(y.dtype)
    dr = gz.to(y.dtype) if residual_grad else torch.empty(0, dtype=y.dtype, device=y.device)
    return dx, dr
