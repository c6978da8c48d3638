"""Edge cases where the in-place layer must be right or refuse before it
writes anything (issue 11): double backward, aliasing residuals, views that
autograd refuses to see modified, state left untouched by refused inputs,
forward-mode AD, empty batches, state-dict loading and factory kwargs."""
from collections import OrderedDict
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn

from inplace_abn import ABN, HAS_NATIVE, InPlaceABN, InPlaceABNSync, inplace_abn, inplace_abn_sync
from inplace_abn import _activation as _A
from inplace_abn import _backend, _pure
from reference import _silu_inverse_exact, rel_err, stock


def _layer_state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


def _assert_same_state(before, layer):
    after = layer.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


# ---- 1. double backward ------------------------------------------------------


@pytest.mark.parametrize("activation", ["leaky_relu", "silu", "relu"])
def test_double_backward_is_refused(backend, activation):
    """A gradient penalty (loss linear in y, then create_graph=True) needs the
    second derivative through BN; the in-place backward is not differentiable,
    so it must refuse instead of returning a constant input gradient."""
    torch.manual_seed(0)
    layer = InPlaceABN(3, activation=activation, activation_param=0.01).double()
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 3, 5, dtype=torch.float64)
    y = layer(x * 1)
    with pytest.raises(RuntimeError, match="double backward.*non-in-place ABN"):
        torch.autograd.grad((y * v).sum(), x, create_graph=True)
    # The first-order backward is unaffected, and matches the stock layer.
    y = layer(x * 1)
    (gx,) = torch.autograd.grad((y * v).sum(), x)
    ref = stock(x, layer.weight, layer.bias, None, None, activation=activation, activation_param=0.01)
    (gr,) = torch.autograd.grad((ref * v).sum(), x)
    assert rel_err(gx, gr) < 1e-10


def test_abn_double_backward_still_works():
    """The layer the error message points to does give second derivatives."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    layer = ABN(3, activation="elu", activation_param=1.0).double()
    assert torch.autograd.gradgradcheck(lambda t: layer(t), (x,))


# ---- 2. residual sharing memory with x -------------------------------------


def _residual_aliases():
    x = torch.randn(2, 4, 3)
    yield "residual is x", x, x
    buf = torch.randn(8, 3, 3)
    yield "shifted overlap", buf[:5], buf[3:]
    x = torch.randn(2, 4, 3, 3)
    yield "same bytes, other strides", x, x.transpose(2, 3)


@pytest.mark.parametrize("case", range(3))
def test_residual_overlapping_x_is_refused(backend, case):
    """The saved residual would hold y after the write: dx and dw silently wrong."""
    name, x, residual = list(_residual_aliases())[case]
    saved = x.clone()
    with pytest.raises(RuntimeError, match="residual shares memory with x"):
        inplace_abn(x, None, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.1, residual=residual)
    assert torch.equal(x, saved), name


def test_residual_overlapping_x_is_refused_under_compile():
    """Functionalization used to turn x = h[:5], residual = h[3:] into silently
    wrong gradients (the norm of dx 14% off); while tracing there are no addresses, so a
    residual viewing x's base is refused."""
    import torch._dynamo

    def model(x, w):
        h = x * 2
        return inplace_abn(h[:5], w, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.1, residual=h[3:])

    torch._dynamo.reset()
    try:
        x = torch.randn(8, 3, 5, dtype=torch.float64, requires_grad=True)
        w = torch.rand(3, dtype=torch.float64, requires_grad=True)
        with pytest.raises(RuntimeError, match="residual shares memory with x"):
            torch.compile(model, backend="aot_eager")(x, w)
    finally:
        torch._dynamo.reset()


def test_residual_in_the_same_storage_without_overlap_works(backend):
    """x and residual interleaved in one storage share no element: allowed, and right."""
    torch.manual_seed(0)
    buf = torch.randn(8, 3, 4, 4, dtype=torch.float64)
    x, r = buf[0::2], buf[1::2]
    w = torch.rand(3, dtype=torch.float64) + 0.5
    b = torch.randn(3, dtype=torch.float64)
    ref = stock(x.clone(), w, b, None, None, residual=r.clone(), activation="silu")
    out = inplace_abn(x, w, b, None, None, True, 0.1, 1e-5, "silu", 0.0, residual=r)
    assert rel_err(out, ref) < 1e-12


def test_residual_copy_gives_right_gradients(backend):
    """The error message's advice, residual=x.clone(), gives the stock gradients."""
    torch.manual_seed(0)
    x0 = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, dtype=torch.float64, requires_grad=True)
    h = x0 * 2
    y = inplace_abn(h, w, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.1, residual=h.clone())
    gx, gw = torch.autograd.grad(y.square().sum(), (x0, w))
    h = x0 * 2
    ref = stock(h, w, None, None, None, activation="leaky_relu", activation_param=0.1, residual=h)
    rx, rw = torch.autograd.grad(ref.square().sum(), (x0, w))
    assert rel_err(gx, rx) < 1e-10 and rel_err(gw, rw) < 1e-10


# ---- 3. inputs autograd refuses to see modified ----------------------------


def _refused_inputs():
    leaf = torch.randn(6, 3, 4, requires_grad=True)
    yield "view of a leaf", leaf, leaf[:2]
    leaf = torch.randn(4, 3, 6, requires_grad=True)
    yield "strided view of a leaf", leaf, leaf[:, :, ::2]
    leaf = torch.randn(4, 6, 3, requires_grad=True)
    yield "transposed view of a leaf", leaf, leaf.transpose(1, 2)
    base = torch.randn(8, 3, 4, requires_grad=True) * 1
    yield "split output", base, base.split(4)[0]
    base = torch.randn(8, 3, 4, requires_grad=True) * 1
    with torch.no_grad():
        v = base[:4]
    yield "view made under no_grad", base, v
    leaf = torch.randn(4, 3, 4, requires_grad=True)
    yield "leaf", leaf, leaf


@pytest.mark.parametrize("case", range(6))
def test_refused_inputs_are_left_intact(backend, case):
    """torch.relu_ refuses these before writing; so must the layer (it used to
    overwrite the leaf and only then have autograd raise)."""
    name, owner, x = list(_refused_inputs())[case]
    saved = owner.detach().clone()
    with pytest.raises(RuntimeError):
        x.relu_()
    assert torch.equal(owner.detach(), saved)
    with pytest.raises(RuntimeError, match="inplace_abn overwrites its input"):
        inplace_abn(x, None, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.01)
    assert torch.equal(owner.detach(), saved), name


def test_inference_tensor_outside_inference_mode_is_left_intact(backend):
    with torch.inference_mode():
        x = torch.randn(4, 3)
    saved = x.clone()
    with pytest.raises(RuntimeError, match="inference tensor"):
        inplace_abn(x, None, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.01)
    assert torch.equal(x, saved)


def test_views_of_leaves_are_fine_without_grad(backend):
    """Under no_grad autograd allows the write (so does torch.relu_): no false alarm."""
    leaf = torch.randn(6, 3, 4, requires_grad=True)
    with torch.no_grad():
        ref = stock(leaf[:2].clone(), None, None, None, None, activation="leaky_relu", activation_param=0.01)
        out = inplace_abn(leaf[:2], None, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.01)
    assert rel_err(out, ref) < 1e-6 and torch.equal(leaf[:2].detach(), out)


# ---- 4. refused inputs leave the layer's state untouched -------------------


def _bad_inputs():
    """(name, the error message it must raise, a maker of (x, residual))."""
    yield "expanded input", "several elements of x share one memory location", \
        lambda: (torch.randn(1, 4, 3, 3).expand(5, 4, 3, 3), None)
    yield "one value per channel", "more than 1 value per channel", lambda: (torch.randn(1, 4), None)
    yield "wrong channel count", "the input has 3 channels but weight has shape", lambda: (torch.randn(5, 3, 2), None)
    yield "residual of another shape", "residual must have the input's shape", \
        lambda: (torch.randn(5, 4, 2), torch.randn(5, 4, 3))
    x = torch.randn(5, 4, 2)
    yield "residual is x", "residual shares memory with x", lambda: (x, x)
    leaf = torch.randn(10, 4, 2, requires_grad=True)
    yield "view of a leaf", "x is a view of a leaf tensor that requires grad", lambda: (leaf[:5], None)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("case", range(6))
def test_refused_input_leaves_state_untouched(backend, case, momentum):
    name, message, make = list(_bad_inputs())[case]
    layer = InPlaceABN(4, momentum=momentum, activation="elu", activation_param=1.0)
    layer(torch.randn(6, 4, 2))  # one real batch first: num_batches_tracked = 1
    before = _layer_state(layer)
    x, residual = make()
    x_before = x.detach().clone()
    with pytest.raises((RuntimeError, ValueError), match=message):
        layer(x, residual=residual)
    _assert_same_state(before, layer)
    assert torch.equal(x.detach(), x_before), name
    # The next good batch is counted as the second.
    layer(torch.randn(6, 4, 2))
    assert layer.num_batches_tracked.item() == 2


# ---- 7. forward-mode AD ------------------------------------------------------


@pytest.mark.parametrize("dual", ["x", "weight", "bias", "residual", "running_mean", "running_var"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("preserve_input", [False, True])
def test_forward_ad_runs_stock_operators(backend, dual, training, preserve_input):
    """A tangent on any input: the backward from y alone has no forward mode, so the
    layer computes y with stock operators. The output and its tangent are those of
    float64 BatchNorm + activation under forward AD, the running statistics move as
    theirs, and y is written into x (returned) unless preserve_input."""
    torch.manual_seed(0)
    t = dict(x=torch.randn(4, 3, 5, dtype=torch.float64), weight=torch.rand(3, dtype=torch.float64) - 0.5,
             bias=torch.randn(3, dtype=torch.float64), residual=torch.randn(4, 3, 5, dtype=torch.float64),
             running_mean=torch.randn(3, dtype=torch.float64), running_var=torch.rand(3, dtype=torch.float64) + 0.5)
    tangent = torch.randn_like(t[dual])
    with fwAD.dual_level():
        ours = {k: fwAD.make_dual(v, tangent) if k == dual else v for k, v in t.items()}
        theirs = {k: fwAD.make_dual(v.clone(), tangent) if k == dual else v.clone() for k, v in t.items()}
        x = ours["x"] * 1  # (a new tensor, whatever carries the tangent)
        x_before = x.clone()
        out = inplace_abn(x, ours["weight"], ours["bias"], ours["running_mean"], ours["running_var"], training, 0.1,
                          1e-5, "silu", 0.0, residual=ours["residual"], weight_mode="signed",
                          preserve_input=preserve_input)
        y, ty = fwAD.unpack_dual(out)
        ref = stock(theirs["x"], theirs["weight"], theirs["bias"], theirs["running_mean"], theirs["running_var"],
                    training, 0.1, 1e-5, "silu", 0.0, "signed", theirs["residual"])
        ry, rty = fwAD.unpack_dual(ref)
        assert (out is x) != preserve_input
        if preserve_input:
            assert torch.equal(fwAD.unpack_dual(x).primal, fwAD.unpack_dual(x_before).primal)
        assert rel_err(y, ry) < 1e-14
        # (torch's batch_norm takes the running statistics as constants: their tangents reach no output)
        assert ty is None if rty is None else rel_err(ty, rty) < 1e-14
        assert (rty is None) == (dual in ("running_mean", "running_var"))
        for k in ("running_mean", "running_var"):
            assert rel_err(fwAD.unpack_dual(ours[k]).primal, fwAD.unpack_dual(theirs[k]).primal) < 1e-14, k


def test_forward_ad_warns_once_that_it_saves_nothing(monkeypatch):
    from inplace_abn import functions

    monkeypatch.setattr(functions, "_warned_stock_autodiff", False)
    layer = InPlaceABN(3)
    with fwAD.dual_level():
        x = fwAD.make_dual(torch.randn(4, 3, 5), torch.randn(4, 3, 5))
        with pytest.warns(RuntimeWarning, match="no memory saved"):
            layer(x * 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            layer(x * 1)


def test_forward_ad_is_refused_by_the_synchronised_layer(backend, world_of_one):
    """The synchronised layer has no stock counterpart here: a tangent raises, before
    anything is written."""
    layer = InPlaceABNSync(3)
    before = _layer_state(layer)
    with fwAD.dual_level():
        x = fwAD.make_dual(torch.randn(4, 3, 5), torch.randn(4, 3, 5)) * 1
        saved = fwAD.unpack_dual(x).primal.clone()
        with pytest.raises(RuntimeError, match="inplace_abn_sync does not support.*forward-mode AD"):
            layer(x)
        assert torch.equal(fwAD.unpack_dual(x).primal, saved)
    _assert_same_state(before, layer)


def test_plain_tensors_inside_a_dual_level_still_work(backend):
    x = torch.randn(4, 3, 5)
    ref = stock(x.clone(), None, None, None, None)
    with fwAD.dual_level():
        out = inplace_abn(x, None, None, None, None)
    assert rel_err(out, ref) < 1e-6


# ---- 8. load_state_dict keeps num_batches_tracked ----------------------------


@pytest.mark.parametrize("metadata", [None, {"version": 1}])
def test_load_state_dict_without_count_keeps_it_like_batchnorm(metadata):
    ours, bn = InPlaceABN(4), nn.BatchNorm2d(4)
    for m in (ours, bn):
        m.num_batches_tracked.fill_(7)
    sd = {k: v.clone() for k, v in InPlaceABN(4).state_dict().items() if k != "num_batches_tracked"}
    for m in (ours, bn):
        d = OrderedDict(sd)
        if metadata is not None:
            d._metadata = {"": dict(metadata)}
        m.load_state_dict(d, strict=False)
    assert bn.num_batches_tracked.item() == 7
    assert ours.num_batches_tracked.item() == 7
    ours.load_state_dict({}, strict=False)
    assert ours.num_batches_tracked.item() == 7


def test_load_state_dict_into_meta_layer_like_batchnorm():
    """On the meta device there is no count to keep: 0, as torch does."""
    sd = {k: v for k, v in InPlaceABN(4).state_dict().items() if k != "num_batches_tracked"}
    for m in (InPlaceABN(4, device="meta"), nn.BatchNorm2d(4, device="meta")):
        m.load_state_dict(sd, strict=False, assign=True)
        assert m.num_batches_tracked.device.type == "cpu" and m.num_batches_tracked.item() == 0
        assert m.running_var.device.type == "cpu"


# ---- 10. empty batches in training -------------------------------------------


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 3, 0, 4), (0, 3)])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("cls", [InPlaceABN, InPlaceABNSync])
def test_empty_batch_matches_batchnorm(backend, shape, momentum, cls):
    torch.manual_seed(0)
    bn = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(3, momentum=momentum)
    layer = cls(3, momentum=momentum, activation="silu", weight_mode="signed")
    for m in (bn, layer):
        m.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        m.num_batches_tracked.fill_(3)
    x = torch.randn(shape, requires_grad=True)
    ref = nn.functional.silu(bn(x))
    ref.sum().backward()
    x2 = torch.randn(shape, requires_grad=True)
    out = layer(x2 * 1)
    out.sum().backward()
    assert out.shape == ref.shape
    assert x2.grad.shape == x.grad.shape
    assert torch.equal(layer.weight.grad, bn.weight.grad) and torch.equal(layer.bias.grad, bn.bias.grad)
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(layer, k), getattr(bn, k)), k


def test_empty_batch_functional(backend):
    x = torch.randn(0, 3, 5)
    rm, rv = torch.zeros(3), torch.ones(3)
    out = inplace_abn(x, None, None, rm, rv, True, 0.1, 1e-5, "leaky_relu", 0.01)
    assert out.shape == (0, 3, 5)
    assert torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))


def test_empty_batch_on_every_rank_synchronised(backend, world_of_one):
    """Global count 0: the synchronised path returns the empty output as torch
    does, after its collectives (the statistics all_reduce runs with zeros)."""
    rm, rv = torch.full((3,), 0.5), torch.ones(3)
    w = torch.ones(3, requires_grad=True)
    x = torch.randn(0, 3, 4, requires_grad=True)
    out = inplace_abn_sync(x * 1, w, None, rm, rv, True, 0.1, 1e-5, "leaky_relu", 0.01)
    out.sum().backward()
    assert out.shape == (0, 3, 4) and torch.equal(w.grad, torch.zeros(3))
    assert torch.equal(rm, torch.full((3,), 0.5)) and torch.equal(rv, torch.ones(3))
    # A global count of 1 still raises.
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        inplace_abn_sync(torch.randn(1, 3), w, None, rm, rv, True, 0.1, 1e-5, "leaky_relu", 0.01)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_synchronised_layer_empty_and_refused_batches(backend, world_of_one, momentum):
    """The module over a real process group: an empty batch behaves as
    torch.nn.BatchNorm2d (counted, statistics kept); a refused one (global
    count 1) changes nothing."""
    layer, bn = InPlaceABNSync(3, momentum=momentum), nn.BatchNorm2d(3, momentum=momentum)
    for m in (layer, bn):
        m(torch.randn(4, 3, 2, 2) + 1)
        m.running_mean.copy_(layer.running_mean)
        m.running_var.copy_(layer.running_var)
    x = torch.randn(0, 3, 2, 2)
    assert layer(x.clone()).shape == bn(x).shape
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(layer, k), getattr(bn, k)), k
    before = _layer_state(layer)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.randn(1, 3, 1, 1))
    _assert_same_state(before, layer)


# ---- 11. factory kwargs ----------------------------------------------------


@pytest.mark.parametrize("cls", [ABN, InPlaceABN, InPlaceABNSync])
def test_factory_kwargs_like_batchnorm(cls):
    bn = nn.BatchNorm2d(5, device="meta", dtype=torch.float64)
    layer = cls(5, device="meta", dtype=torch.float64)
    for name, t in bn.state_dict(keep_vars=True).items():
        ours = getattr(layer, name)
        assert (ours.device, ours.dtype) == (t.device, t.dtype), name
    layer = cls(5, dtype=torch.float64)
    assert layer.weight.dtype == torch.float64 and layer.num_batches_tracked.dtype == torch.long
    assert layer(torch.randn(4, 5, 3, dtype=torch.float64)).dtype == torch.float64


def test_meta_init_then_materialise():
    layer = torch.nn.utils.skip_init(InPlaceABN, 6, activation="elu", activation_param=1.0)
    layer.reset_parameters()
    ref = InPlaceABN(6, activation="elu", activation_param=1.0)
    _assert_same_state(_layer_state(ref), layer)
    meta = InPlaceABN(6, device="meta").to_empty(device="cpu")
    meta.reset_parameters()
    x = torch.randn(4, 6, 3)
    assert torch.equal(meta(x.clone()), InPlaceABN(6)(x.clone()))


def test_positional_arguments_unchanged():
    layer = InPlaceABN(4, 1e-3, 0.2, True, True, "elu", 0.5, "signed")
    assert (layer.eps, layer.momentum, layer.activation, layer.activation_param, layer.weight_mode) == (
        1e-3, 0.2, "elu", 0.5, "signed")
    sync = InPlaceABNSync(4, 1e-3, 0.2, True, True, "elu", 0.5, None, "signed")
    assert sync.group is None and sync.weight_mode == "signed"


# ---- pure SiLU inverse = native SiLU inverse ---------------------------------


def _silu_z_and_fprime(ops, y, left):
    """(z, f'(z)) that the backward recomputes from y and the branch bits, read
    through backward_input with unit scale (eval form: dx = gz, or dx = xhat)."""
    C = y.shape[1]
    one, zero = torch.ones(C, dtype=y.dtype), torch.zeros(C, dtype=y.dtype)
    mask = _pure.pack_bits(left)
    fp, _ = ops.backward_input(y, torch.ones_like(y), mask, one, None, None, None, zero, zero, 1e-30, _A.SILU, 0.0,
                               False, False)
    z, _ = ops.backward_input(y, torch.zeros_like(y), mask, one, None, None, None, zero, -one, 1e-30, _A.SILU, 0.0,
                              False, False)
    return z, fp


@pytest.mark.skipif(not HAS_NATIVE, reason="compares against the native extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pure_silu_inverse_matches_native(dtype):
    """Both backends run the inverse of src/activations.h: same branch rule,
    same reading of y = +-0 (left: f underflowed, z at the clamp), and the
    same results to a few ulp, except near the minimum, where the AVX2/AVX512
    float table must be the closer of the two to the exact inverse."""
    ys = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=dtype).view(-1, 1)
    left = torch.tensor([False, False, True, True]).view(-1, 1)
    zn, fn = _silu_z_and_fprime(_backend.NATIVE, ys, left)
    zp, fp = _silu_z_and_fprime(_pure, ys, left)
    # The same operations on the same values: the same z, bit for bit, whatever the sign of zero.
    assert torch.equal(zp, zn) and torch.equal(zp[0], zp[1]) and torch.equal(zp[2], zp[3])
    assert torch.equal(fp[:2], torch.full((2, 1), 0.5, dtype=dtype)) and torch.equal(fn[:2], fp[:2])
    # Left branch: f' = s (gp - gpp dz) at z near the clamp; exp may differ in its last bit.
    ulp = torch.finfo(dtype).eps
    assert ((fp[2:] - fn[2:]).abs() <= 4 * ulp * fn[2:].abs()).all() and (fn[2:] != 0).all()
    # Near the minimum (ill-conditioned: z is good to ~sqrt(eps)) and across both branches.
    z = torch.cat([torch.linspace(-1.4, -1.16, 2001, dtype=torch.float64),
                   torch.linspace(-80.0, 20.0, 2001, dtype=torch.float64)])
    y = (z * torch.sigmoid(z)).to(dtype).view(-1, 1)
    y[:2] = _pure.SILU_YSTAR  # y* itself, on both branches
    left = (z < _pure.SILU_ZSTAR).view(-1, 1)
    left[:2, 0] = torch.tensor([True, False])
    zn, fn = _silu_z_and_fprime(_backend.NATIVE, y, left)
    zp, fp = _silu_z_and_fprime(_pure, y, left)
    tol_z, tol_f = (2e-5, 4e-6) if dtype == torch.float32 else (1e-9, 1e-10)
    # The AVX2/AVX512 float kernels evaluate the fitted table of src/cpu/silu_table.h,
    # not the guess and Halley step: within tolerance of the pure backend, or, near the
    # minimum (where y - y* keeps more bits there), no farther from the exact inverse.
    z_ex = _silu_inverse_exact(y.double(), left)
    s = torch.sigmoid(z_ex)
    f_ex = s * (1 + z_ex * (1 - s))
    near = (zp - zn).abs() <= tol_z * zn.abs().clamp(min=1)
    closer = (zn.double() - z_ex).abs() <= (zp.double() - z_ex).abs()
    assert (near | closer).all() and (~near).sum() <= 40
    assert ((fp - fn).abs() <= tol_f).all() or (
        ((fn.double() - f_ex).abs() <= torch.maximum((fp.double() - f_ex).abs(), torch.full_like(f_ex, tol_f))).all())
