"""The core test matrix on the GPU (skipped cleanly without one): CUDA kernels
against stock float64 BatchNorm + activation, and CPU-vs-GPU agreement."""
import copy
import warnings

import pytest
import torch

import inplace_abn
from cases import LAYOUTS, errors, make_case
from reference import rel_err, stock

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

ACTIVATIONS = ["identity", "leaky_relu", "elu", "silu"]
PARAM = {"identity": 0.0, "leaky_relu": 0.1, "elu": 0.8, "silu": 0.0}
# float32 reductions on the GPU accumulate in float (docs/DESIGN.md section 6): float-level bounds.
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _run(case, device, fmt, activation, weight_mode, dtype=None, fn="ours"):
    conv = (lambda t: t.to(device=device, dtype=dtype or t.dtype, copy=True))
    x0 = conv(case["x"]).contiguous(memory_format=fmt).requires_grad_()
    w, b = conv(case["w"]).requires_grad_(), conv(case["b"]).requires_grad_()
    rm, rv = conv(case["rm"]), conv(case["rv"])
    x = x0.clone()
    p = PARAM[activation]
    if fn == "ours":
        y = inplace_abn.inplace_abn(x, w, b, rm, rv, True, 0.1, 1e-5, activation, p, weight_mode=weight_mode)
    else:
        y = stock(x, w, b, rm, rv, True, 0.1, 1e-5, activation, p, weight_mode)
    grads = torch.autograd.grad(y, [x0, w, b], conv(case["dy"]).contiguous(memory_format=fmt))
    return {k: v.detach().cpu() for k, v in zip(["y", "dx", "dw", "db", "rm", "rv"], [y, *grads, rm, rv])}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("weight_mode", ["abs", "signed"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_matches_float64_reference(activation, weight_mode, layout, dtype):
    case = make_case(LAYOUTS[layout][0], dtype, seed=5)
    fmt = LAYOUTS[layout][1]
    with inplace_abn.use_backend("native"):
        ours = _run(case, "cuda", fmt, activation, weight_mode)
    ref = _run(case, "cpu", fmt, activation, weight_mode, dtype=torch.float64, fn="stock")
    err = errors(ours, ref)
    limit = TOL[dtype] * (10 if activation == "silu" and dtype == torch.float32 else 1)
    assert max(err.values()) <= limit, err


@pytest.mark.parametrize("layout", ["4d", "4d_channels_last", "5d_channels_last_3d", "2d"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_agrees_with_cpu(activation, layout):
    case = make_case(LAYOUTS[layout][0], torch.float32, seed=9)
    fmt = LAYOUTS[layout][1]
    with inplace_abn.use_backend("native"):
        gpu = _run(case, "cuda", fmt, activation, "abs")
        cpu = _run(case, "cpu", fmt, activation, "abs")
    for k in gpu:
        assert rel_err(gpu[k], cpu[k]) <= 2e-5 * (10 if activation == "silu" else 1), k


def test_cuda_empty_batch_and_mask():
    x = torch.randn(0, 4, 3, 3, device="cuda")
    mean, var = torch.ops.inplace_abn.batch_stats(x)
    assert mean.shape == (4,) and torch.all(mean == 0) and torch.all(var == 0)
    y = torch.randn(3, 5, 7, 11, device="cuda")
    mask = torch.ops.inplace_abn.forward_(y, torch.zeros(5, device="cuda"), torch.ones(5, device="cuda"),
                                          None, None, None, 1e-5, 3, 0.0, False)
    assert mask.dtype == torch.int32 and mask.numel() == (y.numel() + 31) // 32


# ---- activated GroupNorm: the BatchNorm kernels on GroupNorm views ------------------

GN_LAYOUTS = {
    "4d": ((4, 32, 9, 11), 8, torch.contiguous_format),
    "4d_channels_last": ((3, 32, 6, 8), 4, torch.channels_last),  # S C = 1536: native per-sample path
    "2d": ((64, 24), 6, torch.contiguous_format),
    "5d": ((2, 16, 3, 5, 4), 4, torch.contiguous_format),
}


def _run_gn(case, device, shape_groups_fmt, activation, dtype=None, fn="ours"):
    from reference import stock_gn
    _, groups, fmt = shape_groups_fmt
    conv = (lambda t: t.to(device=device, dtype=dtype or t.dtype, copy=True))
    x0 = conv(case["x"]).contiguous(memory_format=fmt).requires_grad_()
    w, b = conv(case["w"]).requires_grad_(), conv(case["b"]).requires_grad_()
    x = x0.clone()
    p = PARAM[activation]
    if fn == "ours":
        y = inplace_abn.inplace_agn(x, groups, w, b, 1e-5, activation, p, weight_mode="signed")
    else:
        y = stock_gn(x, groups, w, b, 1e-5, activation, p, "signed", None)
    grads = torch.autograd.grad(y, [x0, w, b], conv(case["dy"]).contiguous(memory_format=fmt))
    return {k: v.detach().cpu() for k, v in zip(["y", "dx", "dw", "db"], [y, *grads])}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(GN_LAYOUTS))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_groupnorm_matches_float64_reference(activation, layout, dtype):
    case = make_case(GN_LAYOUTS[layout][0], dtype, seed=7)
    with inplace_abn.use_backend("native"):
        ours = _run_gn(case, "cuda", GN_LAYOUTS[layout], activation)
    ref = _run_gn(case, "cpu", GN_LAYOUTS[layout], activation, dtype=torch.float64, fn="stock")
    err = errors(ours, ref)
    limit = TOL[dtype] * (10 if activation == "silu" and dtype == torch.float32 else 1)
    assert max(err.values()) <= limit, err


def test_cuda_groupnorm_runs_native_kernels():
    for name in ("gn_stats", "gn_forward_", "gn_backward_reduce", "gn_backward_input", "gn_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"inplace_abn::{name}", "CUDA"), name


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("training", [True, False])
def test_cuda_relu_one_pass_and_eval_agree_with_cpu(fmt, training):
    """The ReLU path (forward_ with z_out, the CUDA kernel's z store), the running-statistics
    update inside batch_stats, weight_grad and the eval backward (sums_scale 0) match the CPU."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(4, 6, 5, 7, generator=g) * 2 + 1).contiguous(memory_format=fmt)
    dy = torch.randn(x.shape, generator=g).contiguous(memory_format=fmt)
    out = {}
    for dev in ("cpu", "cuda"):
        layer = inplace_abn.InPlaceABN(6, activation="relu").to(dev).train(training)
        with torch.no_grad():
            layer.running_var.fill_(1.5)
        x0 = x.to(dev).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (relu is not invertible: warned once)
            y = layer(x0.clone())
        y.backward(dy.to(dev))
        out[dev] = [t.detach().cpu() for t in (y, x0.grad, layer.weight.grad, layer.bias.grad, layer.running_mean,
                                              layer.running_var)]
    for a, b in zip(out["cpu"], out["cuda"]):
        assert rel_err(b, a) < 2e-5


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", ACTIVATIONS + ["relu"])
def test_cuda_preserve_input_is_the_in_place_layer(activation, fmt):
    """preserve_input on the GPU (forward_kernel reading its source pointer): x untouched,
    and bit for bit the in-place layer on a copy, for the BatchNorm and GroupNorm layers."""
    g = torch.Generator().manual_seed(len(activation))
    x_cpu = torch.randn(4, 8, 6, 5, generator=g) * 1.5 + 0.3
    dy = torch.randn(x_cpu.shape, generator=g).cuda().contiguous(memory_format=fmt)
    p = PARAM.get(activation, 0.0)
    for make in (lambda: inplace_abn.InPlaceABN(8, activation=activation, activation_param=p),
                 lambda: inplace_abn.InPlaceAGN(4, 8, activation=activation, activation_param=p)):
        torch.manual_seed(0)
        base = make().cuda()
        results = []
        for preserve in (True, False):
            layer = copy.deepcopy(base)
            layer.preserve_input = preserve
            x0 = x_cpu.cuda().contiguous(memory_format=fmt).requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # relu's "saves no memory"
                y = layer(x0 if preserve else x0.clone(memory_format=torch.preserve_format))
            if preserve:
                assert torch.equal(x0.detach().cpu(), x_cpu) and y.data_ptr() != x0.data_ptr()
            grads = torch.autograd.grad(y, [x0, layer.weight, layer.bias], dy)
            results.append([y.detach(), *grads])
        for a, b in zip(*results):
            assert torch.equal(a, b)
