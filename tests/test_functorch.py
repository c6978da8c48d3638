"""torch.func transforms (grad, jacrev, jvp, vmap, model ensembles) over the in-place
layers: they run stock operators there (functions._stock_call), so every derivative and
batched result must be that of float64 stock BatchNorm / GroupNorm + activation, the
in-place contract (y written into x) must hold, and what cannot be done must raise
before anything is written."""
import pytest
import torch

from inplace_abn import InPlaceABN, InPlaceABNSync, InPlaceAGN
from reference import rel_err, stock, stock_gn

ACTS = [("leaky_relu", 0.1), ("elu", 0.7), ("silu", 0.0), ("identity", 0.0), ("relu", 0.0)]


def _layer(kind, activation, p, training, weight_mode="abs"):
    """An in-place layer (float64, random affine and statistics) and its stock function of x."""
    torch.manual_seed(1)
    if kind == "bn":
        # training with running statistics would mutate captured buffers, which
        # torch.func refuses for stock BatchNorm too (test below)
        layer = InPlaceABN(6, activation=activation, activation_param=p, weight_mode=weight_mode,
                           track_running_stats=not training).double().train(training)
    else:
        layer = InPlaceAGN(3, 6, activation=activation, activation_param=p, weight_mode=weight_mode).double()
    with torch.no_grad():
        layer.weight.uniform_(-1.5, 1.5)
        layer.bias.normal_()
        if kind == "bn" and not training:
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    w, b = layer.weight.detach(), layer.bias.detach()
    if kind == "bn":
        rm = None if training else layer.running_mean.clone()
        rv = None if training else layer.running_var.clone()
        ref = lambda x: stock(x, w, b, rm, rv, training, 0.1, 1e-5, activation, p, weight_mode)  # noqa: E731
    else:
        ref = lambda x: stock_gn(x, 3, w, b, 1e-5, activation, p, weight_mode)  # noqa: E731
    return layer, ref


CASES = [("bn", True), ("bn", False), ("gn", True)]
IDS = ["bn_train", "bn_eval", "gn"]


@pytest.mark.parametrize("kind,training", CASES, ids=IDS)
@pytest.mark.parametrize("activation,p", ACTS)
def test_grad_jacrev_jvp_match_stock(kind, training, activation, p):
    layer, ref = _layer(kind, activation, p, training)
    torch.manual_seed(2)
    x, v = torch.randn(4, 6, 3, 2, dtype=torch.float64), torch.randn(4, 6, 3, 2, dtype=torch.float64)
    g = torch.func.grad(lambda a: (layer(a * 1) * v).sum())(x)
    g_ref = torch.func.grad(lambda a: (ref(a) * v).sum())(x)
    assert rel_err(g, g_ref) < 1e-13
    # and autograd's own gradient of the stock reference (torch.func is not the reference's only path)
    xr = x.clone().requires_grad_()
    (g_autograd,) = torch.autograd.grad((ref(xr) * v).sum(), xr)
    assert rel_err(g, g_autograd) < 1e-13
    xs = x[:2, :, :2, :1]
    assert rel_err(torch.func.jacrev(lambda a: layer(a * 1))(xs), torch.func.jacrev(ref)(xs)) < 1e-13
    y, ty = torch.func.jvp(lambda a: layer(a * 1), (x,), (v,))
    y_ref, ty_ref = torch.func.jvp(ref, (x,), (v,))
    assert rel_err(y, y_ref) < 1e-14 and rel_err(ty, ty_ref) < 1e-13


@pytest.mark.parametrize("kind,training", CASES, ids=IDS)
def test_vmap_matches_stock_per_slice(kind, training):
    """vmap over a leading dimension: each slice is its own batch (its own statistics
    in training), as with stock layers; y is written into each x."""
    layer, ref = _layer(kind, "silu", 0.0, training)
    x = torch.randn(3, 4, 6, 5, dtype=torch.float64)

    def f(a):
        a = a * 1
        y = layer(a)
        assert y is a  # the in-place contract, on the batched tensor
        return y

    out = torch.func.vmap(f)(x)
    expected = torch.stack([ref(x[i]) for i in range(3)])
    assert rel_err(out, expected) < 1e-14


@pytest.mark.parametrize("kind", ["bn", "gn"])
def test_ensemble_of_layers_under_vmap(kind):
    """torch.func.stack_module_state + functional_call, vmapped over the parameters of
    three layers with one shared input: y is batched and x is not, so it cannot be
    written into x; the error says to use preserve_input, which then gives each
    layer's own result."""
    layers = [_layer(kind, "leaky_relu", 0.1, False)[0] for _ in range(3)]
    for i, m in enumerate(layers):
        with torch.no_grad():
            m.weight.mul_(i + 1)
    params, buffers = torch.func.stack_module_state(layers)
    base = _layer(kind, "leaky_relu", 0.1, False)[0]
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    x_before = x.clone()

    def call(pr, bu):
        return torch.func.functional_call(base, (pr, bu), (x,))

    with pytest.raises(RuntimeError, match="cannot be written into x.*preserve_input=True"):
        torch.func.vmap(call)(params, buffers)
    assert torch.equal(x, x_before)
    base.preserve_input = True
    out = torch.func.vmap(call)(params, buffers)
    assert torch.equal(x, x_before)
    expected = torch.stack([m(x.clone()) for m in layers])
    assert rel_err(out, expected) < 1e-14


def test_training_with_running_statistics_refused_like_stock():
    """Updating the running statistics mutates captured buffers, which torch.func
    refuses for torch.nn.BatchNorm2d as well: the same error, and nothing written
    (x, running statistics and the batch count as they were)."""
    layer, bn = InPlaceABN(4).double(), torch.nn.BatchNorm2d(4).double()
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    for m in (layer, bn):
        with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
            torch.func.grad(lambda a: m(a * 1).sum())(x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    seen = {}

    def f(a):
        seen["x"] = a = a * 1
        seen["before"] = a.clone()
        return layer(a).sum()

    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        torch.func.grad(f)(x)
    assert torch.equal(seen["x"], seen["before"])
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in state.items())


def test_synchronised_layer_refuses_transforms(world_of_one):
    layer = InPlaceABNSync(4)
    with pytest.raises(RuntimeError, match="inplace_abn_sync does not support torch.func"):
        torch.func.grad(lambda a: layer(a * 1).sum())(torch.randn(3, 4, 2))
    assert layer.num_batches_tracked.item() == 0
    # eval mode synchronises nothing: the local layer's stock path
    layer.eval()
    g = torch.func.grad(lambda a: layer(a * 1).sum())(torch.randn(3, 4, 2))
    assert g.shape == (3, 4, 2)


@pytest.mark.parametrize("kind", ["bn", "gn"])
def test_residual_under_transforms(kind):
    """A residual, batched under vmap (no storage to compare with x's) and, under grad,
    even a view of x: the transform's path computes from a copy of x, so the write of y
    spoils nothing the derivatives need."""
    layer, _ = _layer(kind, "elu", 0.7, False)
    w, b = layer.weight.detach(), layer.bias.detach()
    if kind == "bn":
        def ref(x, r):
            return stock(x, w, b, layer.running_mean, layer.running_var, False, 0.1, 1e-5, "elu", 0.7, "abs", r)
    else:
        def ref(x, r):
            return stock_gn(x, 3, w, b, 1e-5, "elu", 0.7, "abs", r)
    x, r = torch.randn(2, 4, 6, 5, dtype=torch.float64), torch.randn(2, 4, 6, 5, dtype=torch.float64)
    out = torch.func.vmap(lambda a, c: layer(a * 1, c))(x, r)
    assert rel_err(out, torch.stack([ref(x[i], r[i]) for i in range(2)])) < 1e-14
    g = torch.func.grad(lambda a: (lambda u: layer(u, u[:]).pow(2).sum())(a * 1))(x[0])
    g_ref = torch.func.grad(lambda a: ref(a, a).pow(2).sum())(x[0])
    assert rel_err(g, g_ref) < 1e-13


@pytest.mark.parametrize("kind,training", [("bn", True), ("gn", True)], ids=["bn_train", "gn"])
def test_second_derivatives_under_transforms(kind, training):
    """torch.func.hessian: the transforms' path is differentiable twice (plain eager
    double backward stays refused, test_edge_cases.py)."""
    layer, ref = _layer(kind, "elu", 0.7, training)
    x = torch.randn(2, 6, 2, 1, dtype=torch.float64)
    h = torch.func.hessian(lambda a: layer(a * 1).pow(3).sum())(x)
    assert rel_err(h, torch.func.hessian(lambda a: ref(a).pow(3).sum())(x)) < 1e-13
