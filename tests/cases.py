"""Shared case generation for the accuracy tests: one input in float64, the
same values rounded to the test dtype, and the float64 reference on the
rounded values (so input rounding is not counted as error)."""
import torch

from inplace_abn import functions
from reference import inplace_floor, rel_err, stock

LAYOUTS = {
    # name: (shape, memory format)
    "2d": ((64, 6), torch.contiguous_format),
    "3d": ((6, 5, 11), torch.contiguous_format),
    "4d": ((4, 5, 6, 7), torch.contiguous_format),
    # planes of 144 elements: the CPU kernels' planar walk for every activation (the other
    # contiguous shapes take the rows walk for ELU and SiLU, src/cpu/kernel_utils.h walk_of)
    "4d_planes": ((2, 4, 12, 12), torch.contiguous_format),
    "4d_channels_last": ((4, 5, 6, 7), torch.channels_last),
    "5d": ((3, 4, 3, 5, 4), torch.contiguous_format),
    "5d_channels_last_3d": ((3, 4, 3, 5, 4), torch.channels_last_3d),
}
PARAM = {"identity": 0.0, "relu": 0.0, "leaky_relu": 0.1, "elu": 0.8, "silu": 0.0, "swish": 0.0}


def make_case(shape, dtype, seed=0, mean_scale=1.0, std=1.0, channel_means=None):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = torch.randn(shape, generator=g, dtype=torch.float64) * std
    cm = channel_means if channel_means is not None else torch.randn(C, generator=g, dtype=torch.float64) * mean_scale
    x = x + cm.view((1, C) + (1,) * (len(shape) - 2))
    w = torch.rand(C, generator=g, dtype=torch.float64) * 1.5 + 0.25
    w = torch.where(torch.rand(C, generator=g) < 0.3, -w, w)  # some negative weights
    b = torch.randn(C, generator=g, dtype=torch.float64) * 0.5
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(
        x=x.to(dtype), dy=dy.to(dtype), residual=r.to(dtype),
        w=w.to(pdtype), b=b.to(pdtype),
        rm=(torch.randn(C, generator=g, dtype=torch.float64) * 0.1).to(pdtype),
        rv=(torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(pdtype),
    )


def run(case, fn, memory_format, training, activation, weight_mode, with_residual, dtype=None,
        momentum=0.1, eps=1e-5, param=None):
    """Forward+backward of fn ("ours" or "stock") on the case, in the case's dtype
    (or promoted to float64 when dtype is given), with the activation parameter
    ``param`` (default PARAM[activation]). Returns outputs, grads, running stats."""
    conv = (lambda t: t.to(dtype, copy=True)) if dtype is not None else (lambda t: t.clone())
    x0 = conv(case["x"]).contiguous(memory_format=memory_format).requires_grad_()
    w = conv(case["w"]).requires_grad_()
    b = conv(case["b"]).requires_grad_()
    r = conv(case["residual"]).contiguous(memory_format=memory_format).requires_grad_() if with_residual else None
    rm, rv = conv(case["rm"]), conv(case["rv"])
    p = PARAM[activation] if param is None else param
    x = x0.clone(memory_format=torch.preserve_format)  # non-leaf: in-place is allowed
    if fn == "ours":
        y = functions.inplace_abn(x, w, b, rm, rv, training, momentum, eps, activation, p,
                                  residual=r, weight_mode=weight_mode)
        assert y.data_ptr() == x.data_ptr(), "output must share the input's storage"
    else:
        y = stock(x, w, b, rm, rv, training, momentum, eps, activation, p, weight_mode, r)
    inputs = [x0, w, b] + ([r] if with_residual else [])
    grads = torch.autograd.grad(y, inputs, conv(case["dy"]).contiguous(memory_format=memory_format))
    return dict(y=y.detach(), dx=grads[0], dw=grads[1], db=grads[2], dr=grads[3] if with_residual else None,
                rm=rm, rv=rv)


def errors(out, ref):
    return {k: rel_err(out[k], ref[k]) for k in out if out[k] is not None}


def floor(case, ours, training, activation, weight_mode, with_residual, eps=1e-5, param=None):
    """The in-place floor (reference.inplace_floor) for ``ours``, the output of
    run(case, "ours", ...): the gradients computed exactly in float64 from our
    rounded y, stored in the output dtypes."""
    return inplace_floor(ours["y"], case["x"], case["dy"], case["w"], case["b"], case["rm"], case["rv"],
                         training, eps, activation, PARAM[activation] if param is None else param, weight_mode,
                         case["residual"] if with_residual else None)
