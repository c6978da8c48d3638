"""In-place activated GroupNorm (InPlaceAGN, AGN, inplace_agn) against stock
torch.nn.functional.group_norm + activation in float64 with autograd:
forward, input, weight, bias and residual gradients, every activation,
weight mode, layout, rank and dtype, on both backends; gradcheck, state
dicts, errors, opcheck of the four operators, torch.compile, export and
memory (docs/DESIGN.md section 10)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import inplace_abn
from cases import PARAM, errors, make_case
from inplace_abn import AGN, InPlaceAGN, _activation, inplace_agn
from inplace_abn.memory import model_saved_bytes
from reference import ACTIVATIONS, inplace_floor_gn, rel_err, stock_gn
from test_accuracy import bounds

LAYOUTS = {
    # name: (shape, groups, memory format)
    "2d": ((64, 6), 3, torch.contiguous_format),
    "3d": ((6, 4, 11), 2, torch.contiguous_format),
    "4d": ((4, 6, 6, 7), 3, torch.contiguous_format),
    "4d_channels_last": ((4, 6, 6, 7), 3, torch.channels_last),
    "4d_one_group": ((3, 4, 5, 6), 1, torch.contiguous_format),
    "4d_group_per_channel": ((3, 4, 5, 6), 4, torch.channels_last),
    # each sample fills whole mask words: the native channels-last SiLU path (not the pure fallback)
    "4d_channels_last_words": ((3, 8, 4, 6), 4, torch.channels_last),
    # C >= 16: gn_backward's one-pass channels-last kernel (rows of a vector and a partial one)
    "4d_channels_last_wide": ((2, 24, 4, 5), 4, torch.channels_last),
    "5d": ((3, 4, 3, 5, 4), 2, torch.contiguous_format),
    "5d_channels_last_3d": ((3, 4, 3, 5, 4), 2, torch.channels_last_3d),
}
ACTS = ["identity", "leaky_relu", "elu", "silu", "relu"]
INVERTIBLE = ["identity", "leaky_relu", "elu", "silu"]
INVERTIBLE_CODES = [_activation.CODES[a] for a in INVERTIBLE]
HALF = (torch.bfloat16, torch.float16)


def run(case, fn, layout, activation, weight_mode, with_residual, dtype=None, eps=1e-5):
    """Forward + backward of "ours" or "stock" on the case (in ``dtype`` when
    given, else the case's); returns y and the gradients of x, weight, bias
    (and residual). ``layout``: a name of LAYOUTS or a (shape, groups, format)."""
    shape, groups, fmt = LAYOUTS[layout] if isinstance(layout, str) else layout
    conv = (lambda t: t.to(dtype, copy=True)) if dtype is not None else (lambda t: t.clone())
    x0 = conv(case["x"]).contiguous(memory_format=fmt).requires_grad_()
    w, b = conv(case["w"]).requires_grad_(), conv(case["b"]).requires_grad_()
    r = conv(case["residual"]).contiguous(memory_format=fmt).requires_grad_() if with_residual else None
    p = PARAM[activation]
    x = x0.clone(memory_format=torch.preserve_format)
    if fn == "ours":
        y = inplace_agn(x, groups, w, b, eps, activation, p, residual=r, weight_mode=weight_mode)
        assert y.data_ptr() == x.data_ptr(), "output must share the input's storage"
    else:
        y = stock_gn(x, groups, w, b, eps, activation, p, weight_mode, r)
    inputs = [x0, w, b] + ([r] if with_residual else [])
    grads = torch.autograd.grad(y, inputs, conv(case["dy"]).contiguous(memory_format=fmt))
    return dict(y=y.detach(), dx=grads[0], dw=grads[1], db=grads[2], dr=grads[3] if with_residual else None)


def _case(layout, dtype, seed=0, hostile=False):
    shape = LAYOUTS[layout][0]
    means = torch.full((shape[1],), 1e3, dtype=torch.float64) if hostile else None
    return make_case(shape, dtype, seed=seed, channel_means=means)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("weight_mode", ["abs", "signed"])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float64_matches_groupnorm(backend, layout, activation, weight_mode, with_residual):
    case = _case(layout, torch.float64, seed=len(layout) + len(activation))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # relu's "saves no memory"
        ours = run(case, "ours", layout, activation, weight_mode, with_residual)
    ref = run(case, "stock", layout, activation, weight_mode, with_residual)
    err = errors(ours, ref)
    assert max(err.values()) <= 1e-10, err


@pytest.mark.parametrize("activation", INVERTIBLE)
def test_float64_hostile_channel_means(backend, activation):
    """Channel means of 1e3 (std 1): the statistics and (x - mean) keep float64 exact."""
    for layout in ("4d", "5d_channels_last_3d"):
        case = _case(layout, torch.float64, hostile=True)
        err = errors(run(case, "ours", layout, activation, "signed", True),
                     run(case, "stock", layout, activation, "signed", True))
        assert max(err.values()) <= 1e-10, (layout, err)


@pytest.mark.parametrize("hostile", [False, True], ids=["ordinary", "hostile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", INVERTIBLE)
# (4d_channels_last's samples do not fill whole mask words, so its SiLU runs the pure kernels
# on either backend; 4d_channels_last_words takes the native channels-last kernels)
@pytest.mark.parametrize("layout", ["4d", "4d_channels_last", "4d_channels_last_words", "5d"])
def test_lower_precision_within_bounds(backend, layout, activation, dtype, hostile):
    """Below float64: within 2x the worse of stock at the same precision and
    the in-place floor (`reference.inplace_floor_gn`), with the floors and
    caps of `test_accuracy.bounds`. In float32 the floor is applied too: with
    statistics per (sample, group) over few elements the rounding of y weighs
    more than in BatchNorm (measured: dw floor 2.2e-7 where stock has 1.2e-7)."""
    case = _case(layout, dtype, seed=3, hostile=hostile)
    with_residual = activation == "silu"
    ours = run(case, "ours", layout, activation, "abs", with_residual)
    stock = run(case, "stock", layout, activation, "abs", with_residual)
    ref = run(case, "stock", layout, activation, "abs", with_residual, dtype=torch.float64)
    err, stock_err = errors(ours, ref), errors(stock, ref)
    floor = inplace_floor_gn(ours["y"], case["x"], case["dy"], LAYOUTS[layout][1], case["w"], case["b"], 1e-5,
                             activation, PARAM[activation], "abs", case["residual"] if with_residual else None)
    floor_err = errors(floor, ref)
    if dtype in HALF:
        limit = bounds(dtype, activation, stock_err, floor_err, ordinary=not hostile)
    else:
        worse = {k: max(e, floor_err.get(k, 0.0)) for k, e in stock_err.items()}
        limit = bounds(dtype, activation, worse, ordinary=not hostile)
    bad = {k: (e, limit[k]) for k, e in err.items() if e > limit[k]}
    assert not bad, f"errors above bounds: {bad}; stock {stock_err}, floor {floor_err}"


@pytest.mark.parametrize("activation", INVERTIBLE)
def test_gradcheck(backend, activation):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(4, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 4, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b, r):
        return inplace_agn(x.clone(), 2, w, b, 1e-5, activation, PARAM[activation], residual=r, weight_mode="signed")

    assert torch.autograd.gradcheck(fn, (x, w, b, r))


def test_no_affine_and_no_grad_path(backend):
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    ref = F.silu(F.group_norm(x, 3))
    with torch.no_grad():
        y = inplace_agn(x.clone(), 3)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    x0 = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(inplace_agn(x0.clone(), 3).sum(), x0)
    (gr,) = torch.autograd.grad(F.silu(F.group_norm(x0, 3)).sum(), x0)
    torch.testing.assert_close(gx, gr, rtol=0, atol=1e-12)


def test_empty_batch(backend):
    layer = InPlaceAGN(2, 4)
    x = torch.randn(0, 4, 3, 3, requires_grad=True)
    y = layer(x.clone())
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(layer.weight.grad, torch.zeros(4)) and torch.equal(layer.bias.grad, torch.zeros(4))


def test_modules_match_groupnorm_and_load_its_state_dict():
    g = torch.Generator().manual_seed(0)
    gn = nn.GroupNorm(4, 8)
    with torch.no_grad():
        gn.weight.copy_(torch.rand(8, generator=g) + 0.5)
        gn.bias.copy_(torch.randn(8, generator=g))
    sd = gn.state_dict()
    x = torch.randn(2, 8, 5, 5, generator=g)
    ref = F.silu(gn(x))
    # InPlaceAGN applies the effective weight |w| + eps (both modes, w > 0): an
    # O(eps) relative difference from stock, so its reference uses that weight
    ref_eff = F.silu(F.group_norm(x, 4, gn.weight.detach() + gn.eps, gn.bias.detach(), gn.eps))
    for cls, kw, r in ((AGN, {}, ref), (InPlaceAGN, {"weight_mode": "signed"}, ref_eff), (InPlaceAGN, {}, ref_eff)):
        layer = cls(4, 8, **kw)
        assert set(layer.state_dict()) == set(sd) == {"weight", "bias"}
        layer.load_state_dict(sd, strict=True)
        y = layer(x.clone())
        torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-6)
        if cls is AGN:  # stock GroupNorm + SiLU itself
            assert torch.equal(y, r)
    # and back: an InPlaceAGN checkpoint loads into nn.GroupNorm
    nn.GroupNorm(4, 8).load_state_dict(InPlaceAGN(4, 8).state_dict(), strict=True)
    assert set(AGN(2, 4, affine=False).state_dict()) == set(nn.GroupNorm(2, 4, affine=False).state_dict())


def test_agn_is_groupnorm_plus_activation():
    torch.manual_seed(0)
    for act in ACTS:
        layer = AGN(2, 6, activation=act, activation_param=PARAM[act] or 0.01)
        with torch.no_grad():
            layer.weight.normal_()
            layer.bias.normal_()
        x = torch.randn(3, 6, 4, 4)
        ref = ACTIVATIONS[act](F.group_norm(x, 2, layer.weight, layer.bias, 1e-5), layer.activation_param)
        assert torch.equal(layer(x), ref)


def test_module_repr_and_defaults():
    layer = InPlaceAGN(32, 64)
    assert (layer.num_groups, layer.num_channels, layer.eps, layer.activation, layer.weight_mode) == (
        32, 64, 1e-5, "silu", "abs")
    assert repr(layer) == "InPlaceAGN(32, 64, eps=1e-05, affine=True, activation=silu)"
    meta = InPlaceAGN(2, 4, device="meta", dtype=torch.float16)
    assert meta.weight.device.type == "meta" and meta.weight.dtype == torch.float16


def test_relu_is_correct_and_warns_once(monkeypatch):
    monkeypatch.setattr(_activation, "_warned_not_invertible", False)
    layer = InPlaceAGN(2, 4, activation="relu")
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="not invertible"):
        y = layer(x.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x.clone())  # once per process
    (g,) = torch.autograd.grad(y.sum(), x)
    (gr,) = torch.autograd.grad(F.relu(F.group_norm(x, 2, layer.weight.abs() + 1e-5, layer.bias)).sum(), x)
    torch.testing.assert_close(g, gr)
    # relu keeps its pre-activation (float32) for backward: no saving against leaky_relu
    leaky = InPlaceAGN(2, 4, activation="leaky_relu")
    assert model_saved_bytes(_blocks(lambda c: [layer], 1, 4), torch.randn(2, 3, 8, 8)) > \
        model_saved_bytes(_blocks(lambda c: [leaky], 1, 4), torch.randn(2, 3, 8, 8))


def test_errors_before_any_write():
    x = torch.randn(2, 6, 4)
    w, b = torch.ones(6), torch.zeros(6)
    cases = [
        (dict(num_groups=4), ValueError, "6 channels, which num_groups=4 does not divide"),
        (dict(num_groups=0), ValueError, "num_groups must be a positive int"),
        (dict(weight=torch.ones(5)), ValueError, "input has 6 channels but weight has shape"),
        (dict(bias=torch.zeros(6, dtype=torch.int64)), TypeError, "bias must be floating point"),
        (dict(activation="gelu"), ValueError, "Unknown activation"),
        (dict(weight_mode="raw"), ValueError, "weight_mode must be"),
        (dict(eps=0.0), ValueError, "eps must be > 0"),
        (dict(residual=torch.randn(2, 6, 5)), ValueError, "residual must have the input's shape"),
    ]
    for kw, exc, msg in cases:
        args = dict(num_groups=3, weight=w, bias=b, eps=1e-5, activation="silu", residual=None, weight_mode="abs")
        args.update(kw)
        xc = x.clone()
        residual, weight_mode = args.pop("residual"), args.pop("weight_mode")
        with pytest.raises(exc, match=msg):
            inplace_agn(xc, *args.values(), residual=residual, weight_mode=weight_mode)
        assert torch.equal(xc, x), kw
    with pytest.raises(TypeError, match="floating point input"):
        inplace_agn(torch.ones(2, 6, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="divisible by num_groups"):
        InPlaceAGN(4, 6)
    with pytest.raises(ValueError, match="weight_mode"):
        InPlaceAGN(3, 6, weight_mode="raw")


@pytest.mark.parametrize("records_backward", [True, False])  # the C++ layer checks / Python does
@pytest.mark.parametrize("preserve_input", [False, True])
@pytest.mark.parametrize("name", ["weight", "bias"])
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_per_channel_refusal_is_worded_alike_and_writes_nothing(backend, records_backward, preserve_input, name, bad):
    # On the native paths forward_ checks weight and bias and Python words the refusal
    # (groupnorm.inplace_agn): the same error as on the Python path, before x changes.
    x = torch.randn(2, 6, 4)
    t = dict(weight=torch.rand(6) + 0.5, bias=torch.randn(6))
    t[name] = torch.ones(5) if bad == "shape" else torch.ones(6, dtype=torch.int64)
    for v in t.values():
        v.requires_grad_(records_backward and v.is_floating_point())
    x_before = x.clone()
    err, msg = ((ValueError, f"input has 6 channels but {name} has shape \\[5\\] \\(expected \\[6\\]\\)")
                if bad == "shape" else (TypeError, f"inplace_agn: {name} must be floating point, got torch.int64"))
    with pytest.raises(err, match=msg):
        inplace_agn(x, 3, t["weight"], t["bias"], activation="leaky_relu", preserve_input=preserve_input)
    assert torch.equal(x, x_before)


def test_refusals_as_inplace_abn():
    leaf = torch.randn(2, 4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        inplace_agn(leaf, 2)
    x = torch.randn(2, 4, 3)
    before = x.clone()
    with pytest.raises(RuntimeError, match="residual shares memory with x"):
        inplace_agn(x, 2, residual=x)
    assert torch.equal(x, before)
    with pytest.raises(RuntimeError, match="share one memory location"):
        inplace_agn(torch.randn(1, 4, 1).expand(2, 4, 3), 2)
    x0 = torch.randn(2, 4, 3, requires_grad=True)
    y = inplace_agn(x0.clone(), 2)
    with pytest.raises(RuntimeError, match="double backward.*non-in-place AGN"):
        torch.autograd.grad(y.sum(), x0, create_graph=True)


def test_strided_input_is_written_back(backend):
    base = torch.randn(2, 8, 6, dtype=torch.float64)
    x0 = base.clone().requires_grad_()
    view = x0.clone()[:, ::2]  # not contiguous
    y = inplace_agn(view, 2, activation="elu", activation_param=1.0)
    ref = F.elu(F.group_norm(x0[:, ::2], 2))
    assert y is view
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad(y.sum(), x0)
    (gr,) = torch.autograd.grad(ref.sum(), x0)
    torch.testing.assert_close(g, gr, rtol=0, atol=1e-12)


# ---- operators ---------------------------------------------------------------------


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", [_activation.IDENTITY, _activation.LEAKY_RELU, _activation.ELU, _activation.SILU])
def test_opcheck_groupnorm_operators(act, fmt, residual):
    ops = torch.ops.inplace_abn
    g = torch.Generator().manual_seed(act)
    # S C = 160: whole mask words per sample, so channels-last SiLU takes the native per-sample path
    x = torch.randn(3, 8, 4, 5, generator=g).contiguous(memory_format=fmt)
    w, b = torch.rand(8, generator=g) + 0.5, torch.randn(8, generator=g)
    r = torch.randn(3, 8, 4, 5, generator=g).contiguous(memory_format=fmt) if residual else None
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 1.0}.get(act, 0.0)
    torch.library.opcheck(ops.gn_stats.default, (x, 4))
    mean, var = ops.gn_stats(x, 4)
    torch.library.opcheck(ops.gn_forward_.default, (x.clone(), mean, var, w, b, r, 1e-5, act, p, True))
    y = x.clone()
    mask = ops.gn_forward_(y, mean, var, w, b, r, 1e-5, act, p, False)
    dy = torch.randn_like(y)
    torch.library.opcheck(ops.gn_backward_reduce.default, (y, dy, mask, w, b, r, 1e-5, act, p, False))
    mg, mgx = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    torch.library.opcheck(ops.gn_backward_input.default,
                          (y, dy, mask, var, w, b, r, mg, mgx, 1e-5, act, p, False, residual))
    torch.library.opcheck(ops.gn_forward_.default,
                          (x.clone().bfloat16(), mean, var, None, None, None, 1e-5, act, p, False))
    # gn_forward (compiled layers): gn_forward_'s y and mask to the bit, in x's layout, x read only; an x the
    # kernels cannot walk (every other element of a wider tensor) is taken too, its y contiguous
    y2, mask2 = ops.gn_forward(x, mean, var, w, b, r, 1e-5, act, p, False)
    assert torch.equal(y2, y) and torch.equal(mask2, mask) and y2.stride() == x.stride()
    strided = x.new_zeros(3, 8, 4, 10)[..., ::2].copy_(x)
    y3, mask3 = ops.gn_forward(strided, mean, var, w, b, r, 1e-5, act, p, False)
    y4, mask4 = ops.gn_forward(x.contiguous(), mean, var, w, b, r, 1e-5, act, p, False)
    assert y3.is_contiguous() and torch.equal(y3, y4) and torch.equal(mask3, mask4)
    assert all(torch.equal(a, b_) for a, b_ in zip(ops.gn_stats(strided, 4), ops.gn_stats(x.contiguous(), 4)))
    for xin in (x, strided):
        torch.library.opcheck(ops.gn_stats.default, (xin, 4))
        torch.library.opcheck(ops.gn_forward.default, (xin, mean, var, w, b, r, 1e-5, act, p, False))


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native kernels only")
@pytest.mark.parametrize("weight_mode", ["abs", "signed", None])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape,groups,fmt", [
    ((3, 8, 5, 7), 4, torch.contiguous_format),     # one pass: planes of whole vectors and a partial one
    ((2, 3, 4, 4, 5), 1, torch.contiguous_format),  # one pass
    ((1, 2, 200, 200), 1, torch.contiguous_format),  # blocks above kGnBackwardMaxBlock: two passes
    ((2, 24, 4, 5), 4, torch.channels_last),        # one pass, a sample per block
    ((3, 8, 4, 4), 4, torch.channels_last),         # C < 16: two passes, sample by sample
], ids=["4d", "5d_one_group", "large_blocks", "channels_last", "channels_last_narrow"])
@pytest.mark.parametrize("activation", INVERTIBLE)
def test_gn_backward_operator_matches_groupnorm(activation, shape, groups, fmt, residual, weight_mode):
    """gn_backward, the GroupNorm layer's backward operator, against float64 torch GroupNorm
    + activation with autograd: dx, dresidual and the sums over the batch (dbias, and
    dweight directly in signed mode, through weight_grad in abs mode), on its one-pass
    CPU kernel and its two-pass path. Then opcheck in float32 and bfloat16."""
    ops = torch.ops.inplace_abn
    act, p, eps = _activation.CODES[activation], PARAM[activation], 1e-5
    case = make_case(shape, torch.float64, seed=act)
    case = {k: v.contiguous(memory_format=fmt) if v is not None and v.dim() == len(shape) else v
            for k, v in case.items()}
    x, dy, r = case["x"], case["dy"], case["residual"] if residual else None
    w = None if weight_mode is None else case["w"]
    b = None if weight_mode is None else case["b"]
    signed = weight_mode == "signed"
    mean, var = ops.batch_stats(x, None, None, 0.0, groups)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, eps, act, p, signed, None, groups)
    dx, dr, s_gz, s_gzx = ops.gn_backward(y, dy, mask, var, w, b, r, groups, eps, act, p, signed, residual)

    leaves = [t.clone().requires_grad_() for t in (x, w, b, r) if t is not None]
    xr, wr, br = leaves[0], (leaves[1] if w is not None else None), (leaves[2] if w is not None else None)
    ref = stock_gn(xr, groups, wr, br, eps, activation, p, weight_mode or "abs", leaves[-1] if residual else None)
    assert rel_err(y, ref) < 1e-12
    grads = dict(zip(["x", "w", "b", "r"] if w is not None else ["x", "r"], torch.autograd.grad(ref, leaves, dy)))
    assert rel_err(dx, grads["x"]) < 1e-10
    assert rel_err(dr, grads["r"]) < 1e-10 if residual else dr.numel() == 0
    if w is not None:  # dbias, and dweight (through weight_grad in abs mode, as the layer)
        assert rel_err(s_gz, grads["b"]) < 1e-10
        assert rel_err(s_gzx if signed else ops.weight_grad(s_gzx, w, False), grads["w"]) < 1e-10
    for dtype in (torch.float32, torch.bfloat16):
        yl = x.to(dtype)
        rl = None if r is None else r.to(dtype)
        ml = ops.forward_(yl, mean.float(), var.float(), w, b, rl, eps, act, p, signed, None, groups)
        torch.library.opcheck(ops.gn_backward.default, (yl, dy.to(dtype), ml, var.float(), w, b, rl, groups, eps,
                                                        act, p, signed, residual))


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native kernels only")
def test_gn_backward_operator_errors():
    ops = torch.ops.inplace_abn
    x = torch.randn(2, 4, 6, 6)
    mean, var = ops.batch_stats(x, None, None, 0.0, 2)
    mask = torch.empty(0, dtype=torch.int32)
    args = (x.clone(), torch.randn_like(x), mask, var, None, None, None)
    with pytest.raises(RuntimeError, match="contiguous or channels-last"):
        ops.gn_backward(x.transpose(2, 3), *args[1:], 2, 1e-5, 0, 0.0, False, False)
    with pytest.raises(RuntimeError, match="groups > 0"):
        ops.gn_backward(*args, 0, 1e-5, 0, 0.0, False, False)
    with pytest.raises(RuntimeError, match="does not divide"):
        ops.gn_backward(*args, 3, 1e-5, 0, 0.0, False, False)
    with pytest.raises(RuntimeError, match="slope > 0"):
        ops.gn_backward(*args, 2, 1e-5, 1, -0.1, False, False)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape,fmt", [((3, 8, 4, 5), torch.contiguous_format), ((3, 8, 4, 5), torch.channels_last),
                                       ((3, 6, 4, 5), torch.channels_last)],  # the last: pure fallback (S C = 120)
                         ids=["contiguous", "channels_last", "channels_last_unaligned"])
@pytest.mark.parametrize("backend", ["native", "python"])
def test_silu_backward_from_z(backend, shape, fmt, residual):
    """gn_backward_reduce keeping z and gn_backward_input_from_z_ (the CPU SiLU
    path, docs/DESIGN.md section 7.2): opcheck, sums bitwise those without
    z_out, dx and dresidual within a few ulp of gn_backward_input's."""
    if backend == "native" and not inplace_abn.HAS_NATIVE:
        pytest.skip("native extension not built")
    g = torch.Generator().manual_seed(11)
    ops = torch.ops.inplace_abn if backend == "native" else inplace_abn._groupnorm_ops._PURE_OPS
    act, G = _activation.SILU, 2
    x = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
    w, b = torch.rand(shape[1], generator=g) + 0.5, torch.randn(shape[1], generator=g)
    r = torch.randn(shape, generator=g).contiguous(memory_format=fmt) if residual else None
    mean, var = ops.gn_stats(x, G)
    y = x.clone()
    mask = ops.gn_forward_(y, mean, var, w, b, r, 1e-5, act, 0.0, True)
    dy = torch.randn_like(y)
    z = torch.empty_like(y)
    sums = ops.gn_backward_reduce(y, dy, mask, w, b, r, 1e-5, act, 0.0, True, z)
    for got, want in zip(sums, ops.gn_backward_reduce(y, dy, mask, w, b, r, 1e-5, act, 0.0, True)):
        assert torch.equal(got, want)
    mg, mgx = torch.randn(3, G, generator=g), torch.randn(3, G, generator=g)
    args = (y, dy, var, w, b, r, mg, mgx, 1e-5, act, 0.0, True, residual)
    if backend == "native":
        torch.library.opcheck(torch.ops.inplace_abn.gn_backward_reduce.default,
                              (y, dy, mask, w, b, r, 1e-5, act, 0.0, True, torch.empty_like(y)))
        torch.library.opcheck(torch.ops.inplace_abn.gn_backward_input_from_z_.default, (z.clone(),) + args)
    dx_ref, dr_ref = ops.gn_backward_input(y, dy, mask, var, w, b, r, mg, mgx, 1e-5, act, 0.0, True, residual)
    dr = ops.gn_backward_input_from_z_(z, *args)
    tol = 16 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(z, dx_ref, rtol=0, atol=tol * dx_ref.abs().max().item())
    if residual:
        torch.testing.assert_close(dr, dr_ref, rtol=0, atol=tol * dr_ref.abs().max().item())


def _f64(a):
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("act", INVERTIBLE_CODES)
def test_batchnorm_operators_in_groupnorm_mode(act, residual, fmt):
    """batch_stats, forward_, backward_reduce, backward_input(_from_z_) with groups > 0
    (the native GroupNorm path, docs/DESIGN.md section 10; channels-last runs sample by
    sample): opcheck, and the pure GroupNorm operators' results to float32 rounding;
    other strides, C not divisible by groups and statistics of the wrong size are refused."""
    ops, pure = torch.ops.inplace_abn, inplace_abn._groupnorm_ops._PURE_OPS
    g = torch.Generator().manual_seed(5 + act)
    N, C, G = 3, 8, 4
    x = torch.randn(N, C, 4, 5, generator=g, dtype=torch.float64).float().contiguous(memory_format=fmt)
    w, b = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
    r = torch.randn(N, C, 4, 5, generator=g).contiguous(memory_format=fmt) if residual else None
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 1.0}.get(act, 0.0)
    mean, var = pure.gn_stats(x, G)
    torch.library.opcheck(ops.batch_stats.default, (x, None, None, 0.0, G))
    for got, want in zip(ops.batch_stats(x, None, None, 0.0, G), (mean, var)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    close = dict(rtol=0, atol=1e-5)
    y, y_ref = x.clone(), x.clone()
    torch.library.opcheck(ops.forward_.default, (x.clone(), mean, var, w, b, r, 1e-5, act, p, False, None, G))
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, p, False, None, G)
    mask_ref = pure.gn_forward_(y_ref, mean, var, w, b, r, 1e-5, act, p, False)
    torch.testing.assert_close(y, y_ref, **close)
    assert torch.equal(mask, mask_ref)
    dy = torch.randn(y.shape, generator=g).contiguous(memory_format=fmt)
    reduce_args = (y, dy, mask, w, b, r, 1e-5, act, p, False, None, G)
    torch.library.opcheck(ops.backward_reduce.default, reduce_args)
    # against the pure operators in float64 on the same float32 values: near the SiLU
    # minimum, the float32 inverses of the two backends differ (section 3, CPU table)
    want64 = pure.gn_backward_reduce(*[_f64(a) for a in reduce_args[:-2]])
    for got, want in zip(ops.backward_reduce(*reduce_args), want64):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4)
    mg, mgx = torch.randn(N, G, generator=g), torch.randn(N, G, generator=g)
    input_args = (y, dy, mask, var, w, b, r, mg, mgx, 1e-5, act, p, False, residual)
    torch.library.opcheck(ops.backward_input.default, input_args + (1.0, G))
    for got, want in zip(ops.backward_input(*input_args, 1.0, G), pure.gn_backward_input(*input_args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    if act == _activation.SILU:
        z = torch.empty_like(y)
        ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, False, z, G)
        from_z = (y, dy, var, w, b, r, mg, mgx, 1e-5, act, p, False, residual, 1.0, G)
        torch.library.opcheck(ops.backward_input_from_z_.default, (z.clone(),) + from_z)
        ops.backward_input_from_z_(z, *from_z)
        torch.testing.assert_close(z, pure.gn_backward_input(*input_args)[0], rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="contiguous or channels-last input"):
        ops.forward_(x.clone().transpose(2, 3), mean, var, w, b, None, 1e-5, act, p, False, None, G)
    with pytest.raises(RuntimeError, match="keeps no running statistics"):
        ops.batch_stats(x, torch.zeros(C), None, 0.1, G)
    with pytest.raises(RuntimeError, match="does not divide"):
        ops.forward_(x.clone(), mean, var, w, b, None, 1e-5, act, p, False, None, 3)
    with pytest.raises(RuntimeError, match="mean must hold N \\* groups = 12"):
        ops.forward_(x.clone(), mean[:2], var, w, b, None, 1e-5, act, p, False, None, G)
    with pytest.raises(RuntimeError, match="mean_gz_xhat must hold"):
        ops.backward_input(y, dy, mask, var, w, b, r, mg, mgx[:, :2], 1e-5, act, p, False, residual, 1.0, G)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.backward_reduce(y, dy, mask, w[:4], b, r, 1e-5, act, p, False, None, G)


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")
def test_channels_last_groupnorm_mode_pads_each_sample_mask():
    """Channels-last SiLU whose samples do not fill whole mask words (3x3 px, 6 channels:
    54 bits a sample): the native operators keep one padded mask per sample, and forward,
    sums and dx still match the pure GroupNorm operators."""
    ops, pure = torch.ops.inplace_abn, inplace_abn._groupnorm_ops._PURE_OPS
    g = torch.Generator().manual_seed(11)
    N, C, G, act = 3, 6, 3, _activation.SILU
    x = (torch.randn(N, C, 3, 3, generator=g) * 2).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(N, C, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
    mean, var = ops.batch_stats(x, None, None, 0.0, G)
    y, y_ref = x.clone(), x.clone()
    torch.library.opcheck(ops.forward_.default, (x.clone(), mean, var, w, b, None, 1e-5, act, 0.0, False, None, G))
    mask = ops.forward_(y, mean, var, w, b, None, 1e-5, act, 0.0, False, None, G)
    mask_ref = pure.gn_forward_(y_ref, mean, var, w, b, None, 1e-5, act, 0.0, False)
    assert mask.numel() == N * 2 and mask_ref.numel() == 6  # 2 words a sample; 162 bits in 6 words
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
    for got, want in zip(ops.backward_reduce(y, dy, mask, w, b, None, 1e-5, act, 0.0, False, None, G),
                         pure.gn_backward_reduce(y_ref, dy, mask_ref, w, b, None, 1e-5, act, 0.0, False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    mg, mgx = torch.randn(N, G, generator=g), torch.randn(N, G, generator=g)
    dx, _ = ops.backward_input(y, dy, mask, var, w, b, None, mg, mgx, 1e-5, act, 0.0, False, False, 1.0, G)
    dx_ref, _ = pure.gn_backward_input(y_ref, dy, mask_ref, var, w, b, None, mg, mgx, 1e-5, act, 0.0, False, False)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-4)


def test_operators_have_composite_kernels_a_device_kernel_can_override():
    """The pure kernels are registered to CompositeExplicitAutograd, which a
    TORCH_LIBRARY_IMPL(inplace_abn, CPU/CUDA) kernel overrides per device."""
    for name in inplace_abn._groupnorm_ops.OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"inplace_abn::{name}", "CompositeExplicitAutograd")
    schema = str(torch.ops.inplace_abn.gn_forward_.default._schema)
    assert "Tensor(a!) x" in schema


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")
def test_native_kernels_serve_the_cpu():
    """Where the BatchNorm kernels are built, the GroupNorm operators have CPU
    kernels of their own (the BatchNorm kernels on GroupNorm views)."""
    for name in inplace_abn._groupnorm_ops.OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"inplace_abn::{name}", "CPU"), name


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")
@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("layout", ["2d", "4d", "4d_channels_last", "4d_channels_last_words", "5d_channels_last_3d"])
def test_backends_agree(layout, activation):
    """Native and pure kernels agree to float32 rounding (they round differently:
    the native statistics accumulate in float32, the pure ones in float64; near
    SiLU's minimum f' is ~0 and its inversion ill-conditioned, hence the
    tolerance relative to the largest value, 1e-5, not per element)."""
    case = _case(layout, torch.float32, seed=5)
    with inplace_abn.use_backend("python"):
        a = run(case, "ours", layout, activation, "signed", True)
    with inplace_abn.use_backend("native"):
        b = run(case, "ours", layout, activation, "signed", True)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5 * a[k].abs().max().item(), msg=k)


# ---- compile, export ------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = norm
        self.conv1 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv1(self.norm(self.conv0(x)))


def _compiled_matches_eager(eager):
    """torch.compile(fullgraph=True) of a copy of ``eager``: the same output and parameter gradients."""
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 6, 6)
    ye, yc = eager(x), compiled(x)
    torch.testing.assert_close(yc, ye)
    ye.square().sum().backward()
    yc.square().sum().backward()
    for (n, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, msg=n)


def test_compile_fullgraph_training_matches_eager():
    torch.manual_seed(0)
    _compiled_matches_eager(_Block(InPlaceAGN(4, 8, activation="silu", weight_mode="signed")))


def test_export_uses_standard_group_norm():
    model = _Block(InPlaceAGN(4, 8, activation="leaky_relu", activation_param=0.1)).eval()
    x = torch.randn(2, 3, 6, 6)
    ep = torch.export.export(model, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("inplace_abn" in t for t in targets), targets
    assert any("group_norm" in t for t in targets), targets
    assert any("leaky_relu" in t for t in targets), targets
    torch.testing.assert_close(ep.module()(x), model(x.clone()))


# ---- memory ------------------------------------------------------------------------


def _blocks(norm, n_blocks=3, C=16):
    layers = [nn.Conv2d(3, C, 3, padding=1)]
    for _ in range(n_blocks):
        layers += norm(C) + [nn.Conv2d(C, C, 3, padding=1)]
    return nn.Sequential(*layers)


def test_saved_bytes_groupnorm_silu_conv_blocks():
    """Stock GroupNorm -> SiLU -> conv saves three full tensors per block (the
    GroupNorm input, the SiLU input, the conv input); the in-place layer
    saves the conv input only (which the conv saves anyway), plus the SiLU
    branch mask (1 bit per element)."""
    N, C, H, W, blocks = 2, 16, 16, 16, 3
    x = torch.randn(N, 3, H, W)
    stock = _blocks(lambda c: [nn.GroupNorm(4, c), nn.SiLU()], blocks, C)
    ours = _blocks(lambda c: [InPlaceAGN(4, c)], blocks, C)
    s, o = model_saved_bytes(stock, x), model_saved_bytes(ours, x)
    t = N * C * H * W * 4  # one activation tensor, float32
    mask = N * C * H * W // 8
    small = 2 * N * 4 * 4 * blocks  # per-(n, group) mean and rstd (stock) / var (ours)
    input_bytes = x.numel() * 4  # the first conv's input
    assert s - input_bytes == pytest.approx(3 * t * blocks, abs=small)
    assert o - input_bytes == pytest.approx((t + mask) * blocks, abs=small)
    # two tensors per block fewer (the conv input is saved by both)
    assert (s - o) / (t * blocks) == pytest.approx(2 - 1 / 32, abs=0.01)


# ---- preserve_input: the out-of-place form --------------------------------------------

PRESERVE_LAYOUTS = ["2d", "4d", "4d_channels_last", "4d_channels_last_words", "4d_channels_last_wide",
                    "5d_channels_last_3d"]


def _preserve_run(case, layout, activation, with_residual, preserve):
    """y and the gradients of x, weight, bias (and residual) of the layer; with
    ``preserve`` x is a leaf passed as it is (an in-place layer would refuse
    it) and must come out unchanged, y a new tensor in x's layout."""
    shape, groups, fmt = LAYOUTS[layout]
    x0 = case["x"].clone().contiguous(memory_format=fmt).requires_grad_()
    w, b = case["w"].clone().requires_grad_(), case["b"].clone().requires_grad_()
    r = case["residual"].clone().contiguous(memory_format=fmt).requires_grad_() if with_residual else None
    x = x0 if preserve else x0.clone(memory_format=torch.preserve_format)
    y = inplace_agn(x, groups, w, b, 1e-5, activation, PARAM[activation], residual=r, weight_mode="signed",
                    preserve_input=preserve)
    if preserve:
        assert y.data_ptr() != x0.data_ptr() and y.stride() == x0.stride()
        assert torch.equal(x0.detach(), case["x"]), "preserve_input wrote into x"
    inputs = [x0, w, b] + ([r] if with_residual else [])
    grads = torch.autograd.grad(y, inputs, case["dy"].contiguous(memory_format=fmt))
    return dict(y=y.detach(), dx=grads[0], dw=grads[1], db=grads[2], dr=grads[3] if with_residual else None)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("layout", PRESERVE_LAYOUTS)
def test_preserve_input_is_the_in_place_layer_out_of_place(backend, layout, activation, with_residual):
    """Bit for bit the in-place layer's output and gradients (the same statistics
    and kernels; the native path reads x as forward_'s source), x untouched."""
    case = _case(layout, torch.float32, seed=7)
    out = _preserve_run(case, layout, activation, with_residual, True)
    ref = _preserve_run(case, layout, activation, with_residual, False)
    for k, v in out.items():
        assert v is None or torch.equal(v, ref[k]), k


@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("layout", ["4d", "4d_channels_last_words", "5d_channels_last_3d"])
def test_preserve_input_float64_matches_groupnorm(backend, layout, activation):
    case = _case(layout, torch.float64, seed=11)
    ours = _preserve_run(case, layout, activation, True, True)
    ref = run(case, "stock", layout, activation, "signed", True)
    err = errors(ours, ref)
    assert max(err.values()) <= 1e-10, err


def test_preserve_input_takes_what_the_in_place_layer_refuses(backend):
    """x may be a leaf requiring grad, an inference tensor, an expanded tensor, or
    the residual itself: nothing is written to it."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    leaf = base.clone().requires_grad_()
    y = inplace_agn(leaf, 2, activation="elu", activation_param=1.0, residual=leaf, preserve_input=True)
    ref = F.elu(F.group_norm(base.clone().requires_grad_(), 2) + base)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    assert torch.equal(leaf.detach(), base)
    (gx,) = torch.autograd.grad(y.sum(), leaf)
    x64 = base.clone().requires_grad_()
    (gr,) = torch.autograd.grad(F.elu(F.group_norm(x64, 2) + x64).sum(), x64)
    torch.testing.assert_close(gx, gr, rtol=0, atol=1e-12)
    expanded = torch.randn(1, 4, 1, generator=g).expand(2, 4, 3)
    torch.testing.assert_close(inplace_agn(expanded, 2, activation="identity", preserve_input=True),
                               F.group_norm(expanded, 2), rtol=0, atol=1e-6)
    with torch.inference_mode():
        inf = torch.randn(2, 8, 4, 4, generator=g)
    keep = inf.clone()
    y = inplace_agn(inf, 4, preserve_input=True)
    assert torch.equal(inf, keep)
    torch.testing.assert_close(y, F.silu(F.group_norm(keep, 4)), rtol=0, atol=1e-5)


class _Shortcut(nn.Module):
    """x + conv(layer(x)), x = conv0(input): the layer's input is read again."""

    def __init__(self, layer, C=16):
        super().__init__()
        self.conv0, self.layer, self.conv1 = nn.Conv2d(3, C, 3, padding=1), layer, nn.Conv2d(C, C, 3, padding=1)

    def forward(self, inp):
        x = self.conv0(inp)
        return x + self.conv1(self.layer(x))


def test_preserve_input_saves_what_the_in_place_layer_saves():
    """Stock GroupNorm -> SiLU -> conv on a shortcut's input saves three tensors;
    preserve_input saves the output alone (which the conv saves anyway) and
    the mask, as the in-place layer on a clone of x does."""
    N, C, H, W = 2, 16, 16, 16
    inp = torch.randn(N, 3, H, W)
    torch.manual_seed(0)
    stock = _Shortcut(nn.Sequential(nn.GroupNorm(4, C), nn.SiLU()))
    ours = _Shortcut(InPlaceAGN(4, C, preserve_input=True))
    s, o = model_saved_bytes(stock, inp), model_saved_bytes(ours, inp)
    t, mask, small = N * C * H * W * 4, N * C * H * W // 8, 2 * N * 4 * 4
    assert s - o == pytest.approx(2 * t - mask, abs=small)
    assert "preserve_input=True" in repr(ours.layer)


def test_preserve_input_compiles_fullgraph():
    """Under torch.compile the layer reads x as the operators' source: same results as eager."""
    torch.manual_seed(0)
    _compiled_matches_eager(_Shortcut(InPlaceAGN(4, 16, activation="silu", weight_mode="signed",
                                                 preserve_input=True)))


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", INVERTIBLE_CODES)
def test_forward_operator_with_source(act, fmt):
    """forward_(out, ..., source=x) reads x and writes out: bit for bit the in-place
    result, x untouched; the source must match out's shape, dtype and strides
    and must not partly overlap it."""
    ops = torch.ops.inplace_abn
    g = torch.Generator().manual_seed(13 + act)
    N, C, G = 3, 8, 4
    x = torch.randn(N, C, 4, 5, generator=g).contiguous(memory_format=fmt)
    w, b, r = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g), torch.randn_like(x)
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 1.0}.get(act, 0.0)
    for groups in (0, G):
        mean, var = ops.batch_stats(x, None, None, 0.0, groups)
        args = (mean, var, w, b, r, 1e-5, act, p, True, None, groups)
        keep, inplace, out = x.clone(), x.clone(), torch.empty_like(x)
        mask_in = ops.forward_(inplace, *args)
        mask_out = ops.forward_(out, *args, x)
        assert torch.equal(out, inplace) and torch.equal(mask_out, mask_in) and torch.equal(x, keep)
        torch.library.opcheck(ops.forward_.default, (torch.empty_like(x),) + args + (x,))
    with pytest.raises(RuntimeError, match="source must have x's shape, dtype and device"):
        ops.forward_(torch.empty_like(x), *args, x.double())
    with pytest.raises(RuntimeError, match="source must have x's memory layout"):
        other = torch.channels_last if fmt == torch.contiguous_format else torch.contiguous_format
        ops.forward_(torch.empty_like(x), *args, x.contiguous(memory_format=other))
    buf = torch.randn(x.numel() + C)  # out and a source one channel row further on
    out, src = buf[:x.numel()].view(x.shape), buf[C:].view(x.shape)
    mean, var = ops.batch_stats(src, None, None, 0.0, 0)
    with pytest.raises(RuntimeError, match="share part of their memory"):
        ops.forward_(out, mean, var, w, b, None, 1e-5, act, p, True, None, 0, src)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", INVERTIBLE_CODES)
def test_gn_forward_and_pure_forward_with_source(act, fmt):
    """gn_forward_(out, ..., source=x) (the dispatched operator and the pure function) and
    the pure BatchNorm forward_ with source: out as the in-place call's x, x untouched;
    a source of another shape, dtype or layout is refused."""
    ops, pure = torch.ops.inplace_abn, inplace_abn._groupnorm_ops._PURE_OPS
    g = torch.Generator().manual_seed(29 + act)
    x = torch.randn(3, 8, 4, 8, generator=g).contiguous(memory_format=fmt)
    w, b, r = torch.rand(8, generator=g) + 0.5, torch.randn(8, generator=g), torch.randn_like(x)
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 1.0}.get(act, 0.0)
    mean, var = pure.gn_stats(x, 4)
    bn_mean, bn_var = inplace_abn._pure.batch_stats(x)
    keep = x.clone()
    calls = [(ops.gn_forward_, (mean, var, w, b, r, 1e-5, act, p, True)),
             (pure.gn_forward_, (mean, var, w, b, r, 1e-5, act, p, True)),
             (inplace_abn._pure.forward_, (bn_mean, bn_var, w, b, r, 1e-5, act, p, True))]
    for fn, args in calls:
        inplace, out = x.clone(), torch.empty_like(x)
        mask_in = fn(inplace, *args)
        mask_out = fn(out, *args, source=x)
        assert torch.equal(out, inplace) and torch.equal(mask_out, mask_in) and torch.equal(x, keep), fn
        other = torch.channels_last if fmt == torch.contiguous_format else torch.contiguous_format
        for bad in (x.double(), x[:2], x.contiguous(memory_format=other)):
            with pytest.raises(RuntimeError, match="source must have x's"):
                fn(torch.empty_like(x), *args, source=bad)
    torch.library.opcheck(ops.gn_forward_.default, (torch.empty_like(x), mean, var, w, b, r, 1e-5, act, p, True),
                          {"source": x})


# ---- native kernels: thread count ----------------------------------------------------


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native kernels only")
@pytest.mark.parametrize("shape,groups,fmt", [
    ((4, 64, 24, 24), 32, torch.contiguous_format),  # the one-pass gn_backward
    ((2, 4, 130, 130), 1, torch.contiguous_format),  # blocks too large for it: one (1, N*C, S) view per operator
    ((3, 64, 12, 20), 8, torch.channels_last),       # sample by sample; gn_backward's one pass per sample
    ((3, 8, 12, 20), 4, torch.channels_last),        # C < 16: gn_backward's two passes
    ((512, 96), 12, torch.contiguous_format),         # (N, C): S = 1
])
@pytest.mark.parametrize("activation", ["leaky_relu", "silu"])
def test_native_result_independent_of_thread_count(shape, groups, fmt, activation):
    """The BatchNorm kernels split GroupNorm's views by shape, not by thread:
    1, 2 and 3 threads agree bitwise (forward, input, weight, bias and residual
    gradients)."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
    r0 = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
    dy = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
    outs = []
    threads_before = torch.get_num_threads()
    try:
        with inplace_abn.use_backend("native"):
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                layer = InPlaceAGN(groups, shape[1], activation=activation)
                xin, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
                y = layer(xin.clone(), residual=r)
                y.backward(dy)
                outs.append((y.detach(), xin.grad, layer.weight.grad, layer.bias.grad, r.grad))
    finally:
        torch.set_num_threads(threads_before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", INVERTIBLE)
def test_extreme_preactivations(backend, activation, fmt, dtype):
    """Channels scaled far out (gamma up to 1e30, beta up to +-100): y element by
    element against float64 group_norm + activation, every gradient finite,
    and dx, channel by channel, within twice the in-place floor at every element
    whose output keeps its z (SiLU below z ~ -88 / -700 and ELU's flat tail lose
    it; their gz ~ 0 keeps them out of the others' dx).
    test_accuracy.py::test_extreme_preactivations has the BatchNorm layer."""
    gammas = [1e-3, 1.0, 10.0, 100.0, 1e4, 1e30, 1.0, 1e-3]
    betas = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -100.0, 100.0]
    C = len(gammas)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, C, 4, 8, generator=g, dtype=torch.float64)
    case = dict(x=x, w=torch.tensor(gammas, dtype=torch.float64), b=torch.tensor(betas, dtype=torch.float64),
                dy=torch.randn(x.shape, generator=g, dtype=torch.float64), residual=None)
    layout = ((2, C, 4, 8), 4, fmt)  # groups of 2 channels
    ours = run(case, "ours", layout, activation, "signed", False, dtype=dtype)
    ref = run(case, "stock", layout, activation, "signed", False, dtype=torch.float64)
    z = stock_gn(x, 4, case["w"], case["b"], activation="identity", weight_mode="signed")
    rtol, tiny = (1e-5, 1e-30) if dtype == torch.float32 else (1e-12, 1e-300)
    y, yr = ours["y"].double(), ref["y"]
    bad = ~((y - yr).abs() <= rtol * yr.abs() + tiny) | (y.isfinite() != yr.isfinite())
    assert not bad.any(), f"y at z = {z[bad][:4].tolist()}: {y[bad][:4].tolist()} vs {yr[bad][:4].tolist()}"
    for k in ("dx", "dw", "db"):
        assert ours[k].isfinite().all(), f"{k} not finite at z = {z[~ours[k].isfinite()][:4].tolist()}"
    lost = {"silu": -85.0 if dtype == torch.float32 else -700.0,
            "elu": -15.0 if dtype == torch.float32 else -36.0}.get(activation, -float("inf"))
    keep = z > lost
    # Channel by channel (one norm over all would be the gamma = 1e30 group's alone): within
    # twice the in-place floor (the exact backward from the stored y) or a few ulp.
    floor = inplace_floor_gn(ours["y"], x, case["dy"], 4, case["w"], case["b"], 1e-5, activation,
                             PARAM[activation], "signed")
    ulps = 1e-6 if dtype == torch.float32 else 1e-14
    for c in range(C):
        k = keep[:, c]
        dxr = ref["dx"][:, c][k]
        scale = dxr.norm().clamp_min(1e-300)
        err = ((ours["dx"].double()[:, c][k] - dxr).norm() / scale).item()
        floor_err = ((floor["dx"].double()[:, c][k] - dxr).norm() / scale).item()
        assert err <= max(2 * floor_err, ulps), f"dx of channel {c} (gamma {gammas[c]}): {err} > 2 x floor {floor_err}"
