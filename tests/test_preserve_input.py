"""preserve_input=True on the BatchNorm layer (InPlaceABN, inplace_abn): the output in a
new tensor, x untouched, and only the output kept for backward: bit for bit the in-place
layer on a copy of x, stock float64 BatchNorm + activation to 1e-10, inputs the in-place
layer refuses, and the memory of a pre-activation residual block. (The GroupNorm layer's
own tests are in test_groupnorm.py; the synchronised layer's in test_distributed.py.)"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import inplace_abn
from host_reads import HostReads
from inplace_abn import InPlaceABN, InPlaceABNSync, InPlaceAGN, functions
from inplace_abn.functions import inplace_abn as iabn
from inplace_abn.memory import model_saved_bytes
from reference import ACTIVATIONS, rel_err
from test_groupnorm import _compiled_matches_eager, _Shortcut  # x + conv(layer(x)), x = conv0(input)

PARAM = {"identity": 0.0, "relu": 0.0, "leaky_relu": 0.1, "elu": 0.7, "silu": 0.0}
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _layer(activation, dtype=torch.float32, C=6):
    g = torch.Generator().manual_seed(len(activation))
    layer = InPlaceABN(C, activation=activation, activation_param=PARAM[activation], weight_mode="signed").to(dtype)
    with torch.no_grad():
        layer.weight.copy_((torch.rand(C, generator=g) + 0.5) * torch.tensor([1, -1, 1, 1, -1, 1.0]))
        layer.bias.copy_(torch.randn(C, generator=g) * 0.3)
        layer.running_mean.copy_(torch.randn(C, generator=g) * 0.1)
        layer.running_var.copy_(torch.rand(C, generator=g) + 0.5)
    return layer


def _data(fmt, dtype, seed=0, shape=(4, 6, 5, 7)):
    g = torch.Generator().manual_seed(seed)
    x, r, dy = (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).contiguous(memory_format=fmt)
                for _ in range(3))
    return x * 1.5 + 0.3, r, dy


def _step(layer, x_in, r_in, dy, preserve):
    """y, the gradients of x, weight, bias (and residual) and the layer's buffers after one call."""
    x0 = x_in.clone().requires_grad_()
    r = None if r_in is None else r_in.clone().requires_grad_()
    layer.preserve_input = preserve
    x = x0 if preserve else x0.clone(memory_format=torch.preserve_format)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # relu's "saves no memory"
        y = layer(x, r)
    if preserve:
        assert y.data_ptr() != x0.data_ptr() and y.stride() == x0.stride()
        assert torch.equal(x0.detach(), x_in), "preserve_input wrote into x"
    inputs = [x0, layer.weight, layer.bias] + ([r] if r is not None else [])
    grads = torch.autograd.grad(y, inputs, dy)
    return [y.detach(), *grads, layer.running_mean.clone(), layer.running_var.clone(),
            layer.num_batches_tracked.clone()]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("activation", list(PARAM))
def test_preserve_input_is_the_in_place_layer_out_of_place(backend, activation, fmt, training, with_residual):
    """The same statistics and kernels (the native path reads x as forward_'s source):
    output, gradients, running statistics and the batch count equal bit for bit."""
    x, r, dy = _data(FORMATS[fmt], torch.float32, seed=len(activation))
    base = _layer(activation).train(training)
    out = _step(copy.deepcopy(base), x, r if with_residual else None, dy, True)
    ref = _step(copy.deepcopy(base), x, r if with_residual else None, dy, False)
    for k, (a, b) in enumerate(zip(out, ref)):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", list(PARAM))
def test_preserve_input_float64_matches_batchnorm(backend, activation, training):
    x, r, dy = _data(torch.channels_last, torch.float64, seed=3)
    layer = _layer(activation, torch.float64).train(training)
    g = torch.sign(layer.weight.detach()) * (layer.weight.detach().abs() + layer.eps)  # the signed scale (dg/dw = 1)
    rm, rv = layer.running_mean.clone(), layer.running_var.clone()
    y, dx, dw, db, dr, *_ = _step(layer, x, r, dy, True)
    xr, gr, br, rr = (t.clone().requires_grad_() for t in (x, g, layer.bias.detach(), r))
    yr = ACTIVATIONS[activation](F.batch_norm(xr, rm, rv, gr, br, training, 0.1, layer.eps) + rr, PARAM[activation])
    ref = torch.autograd.grad(yr, [xr, gr, br, rr], dy)
    assert rel_err(y, yr) <= 1e-10
    for name, a, b in zip(("dx", "dw", "db", "dr"), (dx, dw, db, dr), ref):
        assert rel_err(a, b) <= 1e-10, (name, rel_err(a, b))
    assert rel_err(layer.running_mean, rm) <= 1e-10 and rel_err(layer.running_var, rv) <= 1e-10


def test_preserve_input_takes_what_the_in_place_layer_refuses(backend):
    """A leaf requiring grad, x as its own residual, an expanded tensor, an inference tensor:
    nothing is written to them."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    leaf = base.clone().requires_grad_()
    y = iabn(leaf, None, None, None, None, True, 0.1, 1e-5, "elu", 1.0, residual=leaf, preserve_input=True)
    assert torch.equal(leaf.detach(), base)
    x64 = base.clone().requires_grad_()
    ref = F.elu(F.batch_norm(x64, None, None, training=True) + x64)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), leaf)[0], torch.autograd.grad(ref.sum(), x64)[0],
                               rtol=0, atol=1e-12)
    expanded = torch.randn(1, 4, 5, generator=g).expand(3, 4, 5)
    layer = InPlaceABN(4, activation="identity", preserve_input=True)
    g1 = torch.full((4,), 1 + layer.eps)  # the effective scale of weight 1: |1| + eps
    torch.testing.assert_close(layer(expanded), F.batch_norm(expanded, None, None, g1, training=True), rtol=0,
                               atol=1e-5)
    with torch.inference_mode():
        inf = torch.randn(3, 4, 5, generator=g)
    keep = inf.clone()
    layer.eval()
    y = layer(inf)
    assert torch.equal(inf, keep)
    torch.testing.assert_close(y, F.batch_norm(keep, layer.running_mean, layer.running_var, g1, training=False),
                               rtol=0, atol=1e-5)
    assert "preserve_input=True" in repr(layer)


def test_pre_activation_block_saves_the_output_only():
    """Stock BN -> leaky_relu -> conv on the shortcut's input saves x (BatchNorm), the BN
    output (leaky_relu) and the conv input; preserve_input saves the output alone (which
    the conv saves too): two tensors less, as the in-place layer on a clone of x."""
    N, C, H, W = 2, 16, 12, 12
    inp = torch.randn(N, 3, H, W)
    torch.manual_seed(0)
    stock = _Shortcut(nn.Sequential(nn.BatchNorm2d(C), nn.LeakyReLU(0.01)))
    ours = _Shortcut(InPlaceABN(C, preserve_input=True))
    s, o = model_saved_bytes(stock, inp), model_saved_bytes(ours, inp)
    t = N * C * H * W * 4
    assert s - o == pytest.approx(2 * t, abs=8 * C * 4)


def test_sync_layer_without_process_group_preserves_input(monkeypatch):
    monkeypatch.setattr(functions, "_warned_no_dist", False)  # (it warns once per process)
    layer = InPlaceABNSync(4, preserve_input=True)
    x = torch.randn(3, 4, 5, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="not initialized"):
        y = layer(x)
    assert y.data_ptr() != x.data_ptr()
    g1 = torch.full((4,), 1 + layer.eps)
    torch.testing.assert_close(y, F.leaky_relu(F.batch_norm(x, None, None, g1, training=True), 0.01), rtol=0,
                               atol=1e-5)


@pytest.mark.parametrize("agn", [False, True], ids=["abn", "agn"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", list(PARAM))
def test_python_layer_path_reads_x_without_a_copy(activation, training, agn):
    """The Python autograd path (the pure backend; also torch.compile's and the synchronised
    layer's) writes y to a new tensor and reads x as the operators' source: the operators
    called are the in-place layer's plus y's allocation, no copy of x; the results are the
    in-place layer's on a copy, bit for bit."""
    x, _, dy = _data(torch.channels_last, torch.float32, seed=5, shape=(4, 6, 5, 8))
    if agn:
        base = InPlaceAGN(3, 6, activation=activation, activation_param=PARAM[activation]).train(training)
    else:
        base = _layer(activation).train(training)
    results, calls = [], []
    for preserve in (True, False):
        layer = copy.deepcopy(base)
        layer.preserve_input = preserve
        x0 = x.clone().requires_grad_()
        h = x0 if preserve else x0.clone(memory_format=torch.preserve_format)
        with warnings.catch_warnings(), inplace_abn.use_backend("python"), HostReads() as rec:
            warnings.simplefilter("ignore", RuntimeWarning)  # relu's "saves no memory"
            y = layer(h)
        calls.append([op for op in rec.ops if op != "aten.detach.default"])
        results.append([y.detach(), *torch.autograd.grad(y, [x0, layer.weight, layer.bias], dy)])
        if preserve:
            assert torch.equal(x0.detach(), x) and y.data_ptr() != x0.data_ptr() and y.stride() == x0.stride()
    out, ref = calls
    assert "aten.empty_like.default" in out, out
    out.remove("aten.empty_like.default")
    assert out == ref, (out, ref)
    for k, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), k


def test_preserve_input_compiles_fullgraph():
    """Under torch.compile the layer reads x as the operators' source: eager's results."""
    torch.manual_seed(0)
    _compiled_matches_eager(_Shortcut(InPlaceABN(16, activation="silu", weight_mode="signed",
                                                    preserve_input=True)))
