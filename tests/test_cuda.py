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
        x0 = x.to(dev, copy=True).requires_grad_()  # (a leaf on both devices)
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


# ---- operators on CUDA tensors: schema, fake kernels, autograd registration -------

@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", [0, 1, 2, 3], ids=ACTIVATIONS)
def test_cuda_opcheck(act, fmt, residual):
    """torch.library.opcheck of every BatchNorm operator with CUDA tensors (test_opcheck.py
    does the same on the CPU), the fused bn_backward and the composite layer included."""
    from test_opcheck import _args, opcheck_operators
    ops = torch.ops.inplace_abn
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in _args(act, fmt, residual)]
    x, mean, var, w, b, r, p = args
    y, dy, mask = opcheck_operators(args, act, True, residual)
    torch.library.opcheck(ops.bn_backward.default,
                          (y, dy, mask, var, w, b, r, 1e-5, act, p, False, True, [True, True, True, residual]))
    C = x.shape[1]
    args = (x.clone(), w.requires_grad_(), b.requires_grad_(), torch.zeros(C, device="cuda"),
            torch.ones(C, device="cuda"), r, True, 0.1, 1e-5, act, p, False, False,
            torch.zeros((), dtype=torch.long, device="cuda"))
    for util in ("test_schema", "test_autograd_registration", "test_faketensor"):
        torch.library.opcheck(ops.inplace_abn_.default, args, test_utils=util)
    # dx_out = dy on CUDA: computed apart and copied (the kernels take __restrict__ pointers), the same bits
    need = [True, True, True, residual]
    with torch.no_grad():
        want = ops.bn_backward(y, dy, mask, var, w, b, r, 1e-5, act, p, False, True, need)
        inout = dy.clone(memory_format=torch.preserve_format)
        got = ops.bn_backward(y, inout, mask, var, w, b, r, 1e-5, act, p, False, True, need, False, inout)
    assert got[0].numel() == 0 and torch.equal(inout, want[0])


# ---- no host synchronisation: a training step captured in a CUDA graph -------------

@pytest.mark.parametrize("activation", ["leaky_relu", "silu", "relu"])
def test_cuda_graph_capture_of_a_training_step(activation):
    """The layer's training forward and backward make no host-synchronising call
    (capture would fail), and replaying the graph gives bit for bit the eager step:
    output, the three gradients, running statistics and num_batches_tracked."""
    torch.manual_seed(0)
    layer = inplace_abn.InPlaceABN(16, activation=activation, activation_param=0.1).cuda()
    x = torch.randn(8, 16, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    dy = torch.randn_like(x)

    def step(m):
        y = m(x.clone(memory_format=torch.preserve_format))
        return (y, *torch.autograd.grad(y, [x, m.weight, m.bias], dy))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # relu's "saves no memory"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
            for _ in range(2):
                step(layer)
        torch.cuda.current_stream().wait_stream(side)
        eager = copy.deepcopy(layer)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(layer)
        graph.replay()
        want = step(eager)
    torch.cuda.synchronize()
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), captured, want):
        assert torch.equal(a, b), name
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(layer, name), getattr(eager, name)), name


# ---- realistic sizes: many chunks per channel, vector loads, all grid shapes --------

BIG = {
    "resnet": ((32, 256, 56, 56), torch.contiguous_format),
    "resnet_cl": ((32, 256, 56, 56), torch.channels_last),
    "deep": ((64, 2048, 7, 7), torch.contiguous_format),
    "deep_cl": ((64, 2048, 7, 7), torch.channels_last),
    "odd_cl": ((16, 67, 33, 35), torch.channels_last),  # C with an odd factor: per-element coefficient loads
    "rows": ((131072, 96), torch.contiguous_format),
    "wide": ((2, 70001, 5), torch.contiguous_format),  # more channels than a grid's y dimension
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["leaky_relu", "silu"])
@pytest.mark.parametrize("size", list(BIG))
def test_cuda_realistic_sizes_match_float64(size, activation, dtype):
    shape, fmt = BIG[size]
    case = make_case(shape, dtype, seed=11)
    with inplace_abn.use_backend("native"):
        ours = _run(case, "cuda", fmt, activation, "abs")
    ref = _run(case, "cuda", fmt, activation, "abs", dtype=torch.float64, fn="stock")
    err = errors(ours, ref)
    limit = TOL[dtype] * (10 if activation == "silu" and dtype == torch.float32 else 1)
    assert max(err.values()) <= limit, err


# ---- more than 2^31 elements: 64-bit indexing in every kernel ----------------------

def _device_gib():
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0


@pytest.mark.skipif(_device_gib() < 60, reason="needs about 45 GiB of GPU memory")
@pytest.mark.parametrize("layout", ["4d", "4d_channels_last", "2d"])
def test_cuda_beyond_two_to_the_31_elements(layout):
    """A batch of R copies of one tile has the tile's batch statistics, so every copy's
    output and input gradient are the tile's, and the parameter gradients R times the
    tile's: the last copy, past element 2^31, checked against the float64 reference."""
    tile_shape = (16384, 128) if layout == "2d" else (2, 64, 128, 128)
    fmt = torch.channels_last if layout == "4d_channels_last" else torch.contiguous_format
    R = 1025  # R * 2^21 elements > 2^31
    case = make_case(tile_shape, torch.float32, seed=3)
    ref = _run(case, "cuda", fmt, "silu", "abs", dtype=torch.float64, fn="stock")
    reps = (R,) + (1,) * (len(tile_shape) - 1)
    n0 = tile_shape[0]
    leaf = case["x"].cuda().repeat(*reps).contiguous(memory_format=fmt).requires_grad_()
    assert leaf.numel() > 2**31
    w, b = case["w"].cuda().requires_grad_(), case["b"].cuda().requires_grad_()
    rm, rv = case["rm"].cuda(), case["rv"].cuda()
    dy = case["dy"].cuda().repeat(*reps).contiguous(memory_format=fmt)
    with inplace_abn.use_backend("native"):
        y = inplace_abn.inplace_abn(leaf.clone(memory_format=torch.preserve_format), w, b, rm, rv, True, 0.1, 1e-5,
                                    "silu", 0.0)
    dx, dw, db = torch.autograd.grad(y, [leaf, w, b], dy)
    del dy, leaf
    for name, big, want in (("y", y, ref["y"]), ("dx", dx, ref["dx"])):
        for first in (0, (R - 1) * n0):
            assert rel_err(big[first:first + n0], want.cuda()) < 2e-4, (name, first)
    assert rel_err(dw, ref["dw"].cuda() * R) < 2e-4 and rel_err(db, ref["db"].cuda() * R) < 2e-4
    assert rel_err(rm, ref["rm"].cuda()) < 2e-4
