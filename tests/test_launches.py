"""Operator calls per layer call (issue 13 item 3) and the skipped backward pass of a
frozen eval-mode layer (item 2), counted at the dispatcher with a TorchDispatchMode
(tests/host_reads.py) on the CPU; the local layer reads nothing back to the host.

Counted: every operator that reaches the dispatcher below autograd, except
``aten.detach`` (autograd's own bookkeeping of saved tensors and leaves, no kernel).
Stock BatchNorm + activation is 3-6 calls forward and 2-4 backward.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import inplace_abn
from inplace_abn import InPlaceABN, InPlaceAGN, _pure
from host_reads import HostReads
from reference import rel_err

native_only = pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")


def _counted(layer, x, dy):
    """(forward ops, backward ops, forward host reads, backward host reads) of layer(x)."""
    xin = x.clone().requires_grad_()
    h = xin.clone()  # (CloneBackward passes the gradient through: no operator)
    with HostReads() as f:
        y = layer(h)
    with HostReads() as b:
        y.backward(dy)

    def calls(ops):
        return [o for o in ops if o != "aten.detach.default"]

    return calls(f.ops), calls(b.ops), f.reads, b.reads


@native_only
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("silu", 0.0), ("elu", 1.0),
                                              ("identity", 0.0)])
def test_training_call_counts(activation, param, fmt):
    """Training: forward = bn_forward_ (batch_stats with the running-statistics update, then
    forward_, in one call, as stock's native_batch_norm), the layer counting the batch in
    num_batches_tracked without an operator call (a new version of the buffer, as add_
    would make); backward = bn_backward (both passes and dweight in one call, as stock's
    native_batch_norm_backward)."""
    layer = InPlaceABN(16, activation=activation, activation_param=param)
    x = torch.randn(4, 16, 8, 8).contiguous(memory_format=fmt)
    version = layer.num_batches_tracked._version
    fwd, bwd, fr, br = _counted(layer, x, torch.randn_like(x))
    assert fwd == ["inplace_abn.bn_forward_.default"], fwd
    assert layer.num_batches_tracked.item() == 1 and layer.num_batches_tracked._version == version + 1
    # preserve_input: the output's allocation, and no copy of x (forward_ reads it)
    out = InPlaceABN(16, activation=activation, activation_param=param, preserve_input=True)
    pfwd, pbwd, _, _ = _counted(out, x, torch.randn_like(x))
    assert pfwd == ["aten.empty_like.default", "inplace_abn.bn_forward_.default"], pfwd
    # one operator: the reduce pass, the input pass (for SiLU from the reduce pass's z,
    # docs/DESIGN.md section 7.2) and weight_grad's sign(w), in src/ops/bn_backward.cpp
    assert bwd == ["inplace_abn.bn_backward.default"], bwd
    assert len(fwd) <= 4 and len(bwd) <= 3
    assert fr == [] and br == [], (fr, br)


@native_only
def test_eval_call_counts():
    """Eval with trainable parameters: forward = a copy of running_var (saved for backward) +
    forward_; backward = bn_backward. Under no_grad: forward_ only."""
    layer = InPlaceABN(16).eval()
    x = torch.randn(4, 16, 8, 8)
    fwd, bwd, fr, br = _counted(layer, x, torch.randn_like(x))
    assert fwd == ["aten.clone.default", "inplace_abn.forward_.default"], fwd
    assert bwd == ["inplace_abn.bn_backward.default"], bwd
    assert fr == [] and br == []
    xc = x.clone()
    with torch.no_grad(), HostReads() as f:
        layer(xc)
    assert f.ops == ["inplace_abn.forward_.default"] and f.reads == [], (f.ops, f.reads)


@native_only
def test_relu_call_counts():
    """ReLU (not invertible): z is written by bn_forward_ itself (z_out, allocated first),
    no copy and clamp; the backward applies ReLU's derivative inside its operators, no
    threshold pass."""
    layer = InPlaceABN(16, activation="relu")
    x = torch.randn(4, 16, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (warned once per process: not invertible)
        fwd, bwd, _, _ = _counted(layer, x, torch.randn_like(x))
    assert fwd == ["aten.empty_like.default", "inplace_abn.bn_forward_.default"], fwd
    assert layer.num_batches_tracked.item() == 1
    # ReLU's derivative is applied by both passes of bn_backward as they read dy (relu=True)
    assert bwd == ["inplace_abn.bn_backward.default"], bwd


@native_only
@pytest.mark.parametrize("weight_mode", ["abs", "signed"])
@pytest.mark.parametrize("activation", ["silu", "leaky_relu"])
def test_groupnorm_call_counts(activation, weight_mode):
    """GroupNorm: forward = batch_stats + forward_ (GroupNorm mode); backward = gn_backward
    (one pass over memory for a contiguous x on the CPU) plus weight_grad's sign(w) in abs
    mode (docs/DESIGN.md section 10)."""
    for fmt in (torch.contiguous_format, torch.channels_last):
        layer = InPlaceAGN(4, 16, activation=activation, weight_mode=weight_mode)
        x = torch.randn(4, 16, 8, 8).contiguous(memory_format=fmt)
        fwd, bwd, fr, br = _counted(layer, x, torch.randn_like(x))
        assert fwd == ["inplace_abn.batch_stats.default", "inplace_abn.forward_.default"], fwd
        abs_mode = ["inplace_abn.weight_grad.default"] if weight_mode == "abs" else []
        assert bwd == ["inplace_abn.gn_backward.default"] + abs_mode, bwd
        assert fr == [] and br == [], (fr, br)
        # preserve_input: the output's allocation, and no copy of x (forward_ reads it)
        layer.preserve_input = True
        layer.zero_grad(set_to_none=True)  # (no accumulation into the first run's gradients)
        fwd, bwd, fr, br = _counted(layer, x, torch.randn_like(x))
        assert fwd == ["inplace_abn.batch_stats.default", "aten.empty_like.default",
                       "inplace_abn.forward_.default"], fwd
        assert bwd == ["inplace_abn.gn_backward.default"] + abs_mode, bwd


def _stock_eval_grads(x, layer, dy):
    """Stock float64 BatchNorm (eval) + leaky_relu: dx with frozen parameters."""
    xd = x.double().requires_grad_()
    g = layer.weight.detach().double().abs() + layer.eps
    z = F.batch_norm(xd, layer.running_mean.double(), layer.running_var.double(), g,
                     layer.bias.detach().double(), False, 0.0, layer.eps)
    F.leaky_relu(z, layer.activation_param).backward(dy.double())
    return xd.grad


@pytest.mark.parametrize("backend", ["native", "python"])
def test_frozen_eval_skips_backward_reduce(backend, monkeypatch):
    """Eval mode, weight and bias frozen: only dx is needed, and it does not depend on the
    sums, so the reduce pass does not run (native: bn_backward's profiler ranges; python:
    backward_reduce is not called); dx matches stock float64."""
    if backend == "native" and not inplace_abn.HAS_NATIVE:
        pytest.skip("native extension not built")
    g = torch.Generator().manual_seed(0)
    layer = InPlaceABN(8, activation_param=0.1).eval()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, generator=g))
        layer.bias.copy_(torch.randn(8, generator=g))
        layer.running_mean.copy_(torch.randn(8, generator=g))
        layer.running_var.copy_(torch.rand(8, generator=g) + 0.5)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = torch.randn(4, 8, 5, 5, generator=g, dtype=torch.float64)
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    layer.double()
    calls = []
    original = _pure.backward_reduce
    monkeypatch.setattr(_pure, "backward_reduce", lambda *a: calls.append(a) or original(*a))

    def passes(fn):
        """The passes of bn_backward (profiler ranges in src/ops/bn_backward.cpp) that fn ran."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return sorted(e.name for e in prof.events() if e.name.startswith("inplace_abn::bn_backward ("))

    xin = x.clone().requires_grad_()
    with inplace_abn.use_backend(backend):
        ran = passes(lambda: layer(xin.clone()).backward(dy))
    assert calls == []
    if backend == "native":
        assert ran == ["inplace_abn::bn_backward (input pass)"], ran
    assert rel_err(xin.grad, _stock_eval_grads(x, layer, dy)) < 1e-12
    # with a trainable bias the sums are needed again
    layer.bias.requires_grad_(True)
    with inplace_abn.use_backend(backend):
        ran = passes(lambda: layer(x.clone().requires_grad_().clone()).backward(dy))
    if backend == "native":  # (4, 8, 5, 5): both passes in bn_backward's one-pass kernel
        assert ran == ["inplace_abn::bn_backward (one pass)"], ran
        with inplace_abn.use_backend(backend):  # channels-last: the two passes
            xcl = x.clone().contiguous(memory_format=torch.channels_last)
            ran = passes(lambda: layer(xcl.requires_grad_().clone()).backward(dy))
        assert ran == ["inplace_abn::bn_backward (input pass)", "inplace_abn::bn_backward (reduce pass)"], ran
    else:
        assert len(calls) == 1
