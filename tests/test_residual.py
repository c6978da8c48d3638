"""Fused residual y = f(BN(x) + r), through the module and the functional API:
written into x's storage, only y and r saved for backward, the gradient for r
returned, against stock float64 F.batch_norm + add + activation with autograd."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from inplace_abn import InPlaceABN
from inplace_abn.functions import inplace_abn as iabn
from reference import ACTIVATIONS, rel_err

PARAM = {"identity": 0.0, "relu": 0.0, "leaky_relu": 0.1, "elu": 0.7, "silu": 0.0}
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
SHAPE = (3, 5, 6, 7)


def _data(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    C = SHAPE[1]
    x = torch.randn(SHAPE, generator=g, dtype=torch.float64) * 1.5 + torch.randn(C, 1, 1, generator=g,
                                                                                  dtype=torch.float64)
    r = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    dy = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    w = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5) * torch.tensor([1, -1, 1, 1, -1.0],
                                                                               dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64) * 0.3
    rm = torch.randn(C, generator=g, dtype=torch.float64) * 0.1
    rv = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    return [t.to(dtype) for t in (x, r, dy, w, b, rm, rv)]


def _stock(x, r, w, b, rm, rv, training, activation, eps=1e-5, momentum=0.1):
    """Stock float64 path; w is the effective scale g~ itself (signed mode reproduces it)."""
    z = F.batch_norm(x, rm, rv, w, b, training, momentum, eps) + r
    return ACTIVATIONS[activation](z, PARAM[activation])


def _signed_weight(g, eps=1e-5):
    """The signed-mode weight whose scale sign(w)(|w| + eps) is g (|g| > eps)."""
    return torch.sign(g) * (g.abs() - eps)


def _check(y, grads, ref_y, ref_grads, stats=(), ref_stats=()):
    assert rel_err(y, ref_y) <= 1e-10
    for name, a, b in zip(("dx", "dr", "dw", "db"), grads, ref_grads):
        assert rel_err(a, b) <= 1e-10, f"{name}: {rel_err(a, b)}"
    for a, b in zip(stats, ref_stats):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", list(PARAM))
@pytest.mark.parametrize("api", ["module", "functional"])
def test_residual_matches_stock_float64(backend, api, activation, training, fmt):
    x0, r0, dy, g, b, rm, rv = _data(seed=len(activation) + 10 * training)
    mf = FORMATS[fmt]
    x0, r0, dy = (t.contiguous(memory_format=mf) for t in (x0, r0, dy))

    # stock
    xs, rs = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    ws, bs = g.clone().requires_grad_(), b.clone().requires_grad_()
    rm_s, rv_s = rm.clone(), rv.clone()
    ys = _stock(xs, rs, ws, bs, rm_s, rv_s, training, activation)
    ref_grads = torch.autograd.grad(ys, (xs, rs, ws, bs), dy)

    # ours
    xl, rl = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    x = xl.clone(memory_format=torch.preserve_format)  # a non-leaf that may be overwritten
    r = rl.clone(memory_format=torch.preserve_format)
    ptr = x.data_ptr()
    if api == "module":
        layer = InPlaceABN(SHAPE[1], activation=activation, activation_param=PARAM[activation],
                           weight_mode="signed").double()
        with torch.no_grad():
            layer.weight.copy_(_signed_weight(g))
            layer.bias.copy_(b)
            layer.running_mean.copy_(rm)
            layer.running_var.copy_(rv)
        layer.train(training)
        w_, b_ = layer.weight, layer.bias
        with pytest.warns(RuntimeWarning) if activation == "relu" else contextlib.nullcontext():
            y = layer(x, residual=r)
        stats = (layer.running_mean, layer.running_var)
    else:
        w_ = _signed_weight(g).requires_grad_()
        b_ = b.clone().requires_grad_()
        rm_o, rv_o = rm.clone(), rv.clone()
        with pytest.warns(RuntimeWarning) if activation == "relu" else contextlib.nullcontext():
            y = iabn(x, w_, b_, rm_o, rv_o, training, 0.1, 1e-5, activation, PARAM[activation], residual=r,
                     weight_mode="signed")
        stats = (rm_o, rv_o)
    assert y.data_ptr() == ptr, "the output must be written into x's storage"
    assert y.is_contiguous(memory_format=mf)
    grads = torch.autograd.grad(y, (xl, rl, w_, b_), dy)
    _check(y, grads, ys, ref_grads, stats, (rm_s, rv_s))


@pytest.fixture(autouse=True)
def _reset_relu_warning(monkeypatch):
    # The not-invertible warning is issued once per process: re-arm it for each test.
    from inplace_abn import _activation

    monkeypatch.setattr(_activation, "_warned_not_invertible", False)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("activation", ["identity", "leaky_relu", "elu", "silu"])
def test_residual_saves_only_output_and_residual(backend, activation, fmt):
    """The full-size tensors saved for backward are y (x's storage) and r: nothing else."""
    mf = FORMATS[fmt]
    x0, r0, *_ = _data(seed=1, dtype=torch.float32)
    x = x0.contiguous(memory_format=mf).requires_grad_().clone(memory_format=torch.preserve_format)
    r = r0.contiguous(memory_format=mf).requires_grad_().clone(memory_format=torch.preserve_format)
    layer = InPlaceABN(SHAPE[1], activation=activation, activation_param=PARAM[activation] or 0.01)
    big = set()

    def pack(t):
        if t.numel() >= x.numel() // 8:  # per-channel vectors and the packed SiLU bits are small
            big.add(t.untyped_storage().data_ptr())
        return t

    expected = {x.untyped_storage().data_ptr(), r.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, residual=r)
    assert big == expected
    y.sum().backward()  # still differentiable


def test_residual_gradient_reaches_shortcut_branch(backend):
    """r computed by another branch: its gradient flows back through it."""
    torch.manual_seed(0)
    conv_a = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    conv_b = torch.nn.Conv2d(4, 4, 1).double()
    inp = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    layer = InPlaceABN(4, activation="leaky_relu", activation_param=0.01, weight_mode="signed").double()

    def ours():
        return layer(conv_a(inp), residual=conv_b(inp))

    def ref():
        g = layer.weight + 1e-5  # positive weights: g~ = |w| + eps = w + eps
        z = F.batch_norm(conv_a(inp), None, None, g, layer.bias, True, 0.0, 1e-5) + conv_b(inp)
        return F.leaky_relu(z, 0.01)

    params = [inp, conv_a.weight, conv_b.weight, conv_b.bias, layer.weight, layer.bias]
    dy = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    ga = torch.autograd.grad(ours(), params, dy)
    gb = torch.autograd.grad(ref(), params, dy)
    for a, b in zip(ga, gb):
        assert rel_err(a, b) <= 1e-10
