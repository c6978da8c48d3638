"""Independent reference: stock torch.nn.functional.batch_norm + activation,
evaluated in float64 with autograd."""
import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "identity": lambda z, p: z,
    "relu": lambda z, p: F.relu(z),
    "leaky_relu": lambda z, p: F.leaky_relu(z, p),
    "elu": lambda z, p: F.elu(z, p),
    "silu": lambda z, p: F.silu(z),
    "swish": lambda z, p: F.silu(z),
}


def effective_weight(w, eps, weight_mode):
    """g~ of docs/DESIGN.md section 1, differentiable in w."""
    a = w.abs() + eps
    if weight_mode == "signed":
        # sign(0) = +1 for the forward; d g~/dw = 1 everywhere.
        sign = torch.where(w < 0, -1.0, 1.0).to(w.dtype)
        return sign * a.detach() + (w - w.detach())
    return a


def stock(x, weight, bias, running_mean, running_var, training=True, momentum=0.1, eps=1e-5,
          activation="leaky_relu", activation_param=0.01, weight_mode="abs", residual=None, dtype=None):
    """Stock BatchNorm + activation in ``dtype`` (default: x's); returns y."""
    dtype = dtype or x.dtype
    w = None if weight is None else effective_weight(weight, eps, weight_mode)
    z = F.batch_norm(x.to(dtype), running_mean, running_var,
                     None if w is None else w.to(dtype) if dtype == torch.float64 else w,
                     None if bias is None else bias.to(dtype) if dtype == torch.float64 else bias,
                     training, momentum, eps)
    if residual is not None:
        z = z + residual.to(dtype)
    return ACTIVATIONS[activation](z, activation_param)


def rel_err(a, ref):
    """Norm-wise relative error of a against ref (float64)."""
    a, ref = a.detach().double(), ref.detach().double()
    den = ref.norm()
    if den == 0:
        return (a - ref).norm().item()
    return ((a - ref).norm() / den).item()


SILU_ZSTAR = -1.2784645427610738  # argmin of z sigmoid(z)


def _silu_inverse_exact(y, left):
    """z with z sigmoid(z) = y on the branch ``left`` (z < z*), in float64 by
    bisection (no shared code with the library's Halley iteration). y below the
    minimum f(z*) gives z*; a left-branch y >= 0 (a negative f(z) rounded to
    zero) gives the bracket's end -800, where f'(z) and f'(z) z vanish."""
    f = lambda z: z * torch.sigmoid(z)  # noqa: E731
    lo = torch.where(left, torch.full_like(y, -800.0), torch.full_like(y, SILU_ZSTAR))
    hi = torch.where(left, torch.full_like(y, SILU_ZSTAR), y.clamp(min=0) + 1.0)
    for _ in range(110):  # the bracket shrinks below one ulp of z
        mid = 0.5 * (lo + hi)
        # f increases with z on the right branch and decreases on the left
        go_up = (f(mid) < y) != left
        lo = torch.where(go_up, mid, lo)
        hi = torch.where(go_up, hi, mid)
    return 0.5 * (lo + hi)


def exact_inverse(y_in, z_exact, activation, p):
    """(z, f'(z)) in float64 from the stored output ``y_in``, exactly: the
    preimage of y as rounded to its dtype, on SiLU's branch of ``z_exact``
    (the float64 pre-activation, which the forward's mask records)."""
    y = y_in.to(torch.float64)
    neg = torch.signbit(y)  # -0 keeps the negative branch, as in the library
    if activation == "identity":
        z, fp = y, torch.ones_like(y)
    elif activation == "leaky_relu":
        z, fp = torch.where(neg, y / p, y), torch.where(neg, torch.full_like(y, p), torch.ones_like(y))
    elif activation == "elu":
        # y <= -alpha has no preimage: f(z) -> -alpha was rounded onto or
        # past it. Take the end of its rounding interval, the preimage of the
        # midpoint between y and its neighbour towards zero in y's dtype.
        toward0 = torch.nextafter(y_in, torch.zeros_like(y_in)).to(torch.float64)
        y_b = torch.where(y > -p, y, 0.5 * (y + toward0))
        z = torch.where(neg, torch.log1p(y_b / p), y)
        fp = torch.where(neg, y_b + p, 1.0)
    elif activation in ("silu", "swish"):
        left = z_exact < SILU_ZSTAR
        z = _silu_inverse_exact(y, left)
        s = torch.sigmoid(z)
        fp = s * (1 + z * (1 - s))
        fp = torch.where(left & (y >= 0), 0.0, fp)
    else:
        raise ValueError(f"no in-place floor for {activation!r} (not invertible)")
    return z, fp


def inplace_floor(y, x, dy, weight, bias, running_mean, running_var, training=True, eps=1e-5,
                  activation="leaky_relu", activation_param=0.01, weight_mode="abs", residual=None):
    """The in-place floor: the exact float64 backward computed from the output
    ``y`` as stored (rounded to its dtype), as every in-place method must.

    Each element's z is the exact float64 preimage f^-1(y) (for SiLU on the
    branch of the exact z = BN(x) [+ residual], computed here in float64;
    where y left f's range through rounding, f'(z) = 0 and the element
    contributes nothing), xhat = (z [- residual] - beta) / g~, f'(z) exact, and
    dx, dweight, dbias (and dresidual) follow from the BatchNorm backward in
    float64 with the batch statistics of x in float64 (training) or the
    running statistics (eval) and the same ``dy``. The remaining error against
    the float64 reference is the conditioning of the in-place algorithm
    (docs/DESIGN.md section 8), not an implementation's rounding; in half
    precision it grows like eps_dtype |beta| / |gamma|.

    Returns a dict of float64 tensors: dx, dw, db and dr (None without a residual).
    """
    d = torch.float64
    y_in = y.detach()
    x, dy, y = x.detach().to(d), dy.detach().to(d), y_in.to(d)
    w = weight.detach().to(d)
    b = bias.detach().to(d)
    r = None if residual is None else residual.detach().to(d)
    C, nd = x.shape[1], x.dim()
    shape = (1, C) + (1,) * (nd - 2)
    dims = [0] + list(range(2, nd))
    g = effective_weight(w, eps, weight_mode)
    dg = torch.ones_like(w) if weight_mode == "signed" else torch.sign(w)  # d g~ / d weight
    if training:
        var, mean = torch.var_mean(x, dim=dims, correction=0)
    else:
        mean, var = running_mean.detach().to(d), running_var.detach().to(d)
    inv_std = torch.rsqrt(var + eps)
    # exact z, only to choose SiLU's branch (what the forward's mask records)
    z_exact = (x - mean.view(shape)) * (g * inv_std).view(shape) + b.view(shape)
    if r is not None:
        z_exact = z_exact + r
    z, fp = exact_inverse(y_in, z_exact, activation, activation_param)
    gz = dy * fp
    if r is not None:
        z = z - r
    xhat = (z - b.view(shape)) / g.view(shape)
    db = gz.sum(dims)
    s_gzx = (gz * xhat).sum(dims)
    dw = s_gzx * dg
    if training:
        n = x.numel() // C
        dx = (g * inv_std).view(shape) * (gz - (db / n).view(shape) - xhat * (s_gzx / n).view(shape))
    else:
        dx = (g * inv_std).view(shape) * gz
    # stored in the output dtypes, as any implementation must
    pd = weight.dtype
    return dict(dx=dx.to(y_in.dtype), dw=dw.to(pd), db=db.to(pd), dr=None if r is None else gz.to(y_in.dtype))


def stock_gn(x, groups, weight, bias, eps=1e-5, activation="silu", activation_param=0.01, weight_mode="abs",
             residual=None, dtype=None):
    """Stock GroupNorm + activation in ``dtype`` (default: x's); returns y.

    In float64 (the reference) each (sample, group) is first shifted by its
    mean, a constant (detached), which changes neither y nor any gradient:
    torch's channels-last group_norm computes the variance in one pass, with
    an error ~ 1e-16 (mean/std)^2, 5e-10 for channel means of 1e3.
    """
    dtype = dtype or x.dtype
    w = None if weight is None else effective_weight(weight, eps, weight_mode)
    wide = dtype == torch.float64
    x = x.to(dtype)
    if wide and x.numel():
        N = x.shape[0]
        shift = x.detach().reshape(N, groups, -1).mean(2, keepdim=True)
        x = (x.reshape(N, groups, -1) - shift).reshape(x.shape)
    z = F.group_norm(x, groups, None if w is None else w.to(dtype) if wide else w,
                     None if bias is None else bias.to(dtype) if wide else bias, eps)
    if residual is not None:
        z = z + residual.to(dtype)
    return ACTIVATIONS[activation](z, activation_param)


def inplace_floor_gn(y, x, dy, groups, weight, bias, eps=1e-5, activation="silu", activation_param=0.01,
                     weight_mode="abs", residual=None):
    """`inplace_floor` for GroupNorm (docs/DESIGN.md section 10): the exact
    float64 backward from the stored output ``y``, with the per-(sample,
    group) statistics of x in float64. Returns dx, dw, db, dr as `inplace_floor`."""
    d = torch.float64
    y_in = y.detach()
    x, dy = x.detach().to(d), dy.detach().to(d)
    w, b = weight.detach().to(d), bias.detach().to(d)
    r = None if residual is None else residual.detach().to(d)
    N, C, nd = x.shape[0], x.shape[1], x.dim()
    cshape = (1, C) + (1,) * (nd - 2)
    g = effective_weight(w, eps, weight_mode).view(cshape)
    dg = torch.ones_like(w) if weight_mode == "signed" else torch.sign(w)

    def grouped(t):  # (N, G, C/G * spatial), logical order
        return t.reshape(N, groups, -1)

    var, mean = torch.var_mean(grouped(x), dim=2, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    xhat_exact = ((grouped(x) - mean) * rstd).reshape(x.shape)
    z_exact = xhat_exact * g + b.view(cshape) + (0 if r is None else r)
    z, fp = exact_inverse(y_in, z_exact, activation, activation_param)
    gz = dy * fp
    if r is not None:
        z = z - r
    xhat = (z - b.view(cshape)) / g
    sdims = [0] + list(range(2, nd))
    db = gz.sum(sdims)
    dw = (gz * xhat).sum(sdims) * dg
    h = grouped(gz * g)  # dL/dxhat
    hx = grouped(gz * g * xhat)
    dx = (rstd * (h - h.mean(2, keepdim=True) - grouped(xhat) * hx.mean(2, keepdim=True))).reshape(x.shape)
    pd = weight.dtype
    return dict(dx=dx.to(y_in.dtype), dw=dw.to(pd), db=db.to(pd), dr=None if r is None else gz.to(y_in.dtype))
