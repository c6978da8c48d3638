"""timm: convert_model on its models (its norm + activation modules BatchNormAct2d,
SyncBatchNormAct, GroupNormAct; the nn.Identity placeholders between a norm and
what it fuses, drop_path / drop_block at rate 0; its fx leaves, the "same"-padding
convolutions), exact in float64 against the stock timm model (with ReLU swapped
for the leaky_relu(0.01) that the conversion uses); and timm's InplaceAbn layer,
written for the original inplace_abn package, running on this one."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

timm = pytest.importorskip("timm")

from inplace_abn import InPlaceABN, InPlaceABNSync, InPlaceAGN  # noqa: E402
from inplace_abn.convert import convert_model  # noqa: E402
from inplace_abn.memory import model_saved_bytes  # noqa: E402
from test_convert import _assert_equivalent, _randomize_bn, _swap_relu  # noqa: E402
from timm.layers import BatchNormAct2d, GroupNormAct  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _model(name, **kwargs):
    torch.manual_seed(0)
    return _randomize_bn(timm.create_model(name, pretrained=False, num_classes=10, **kwargs)).double()


def _x(size=64, seed=1):
    return torch.randn(2, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_efficientnet_silu_norm_act_modules_are_converted_exactly(training):
    """EfficientNet-B0: every BatchNormAct2d becomes an InPlaceABN with its own SiLU (bn+act) or, with an
    identity act, fuses the residual add behind drop_path (an nn.Identity at rate 0); outputs, gradients and
    running statistics equal timm's in float64; state-dict keys unchanged; under half the saved memory."""
    model = _model("efficientnet_b0")
    conv, report = convert_model(copy.deepcopy(model), return_report=True)
    assert report.counts() == {"bn+act": 33, "bn+add": 9, "bn": 7, "left": 0}, str(report)
    assert all(c.source == "SiLU (BatchNormAct2d.act)" for c in report.converted if c.pattern == "bn+act")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in conv.modules())
    assert model.state_dict().keys() == conv.state_dict().keys()
    _assert_equivalent(model, conv, _x(64), training=training)  # (at 32 px the last stages normalise 2 values)
    model.train(), conv.train()
    assert model_saved_bytes(conv, _x()) < 0.5 * model_saved_bytes(model, _x())


def test_keep_modules_keeps_timm_model_api():
    """keep_modules=True: timm's EfficientNet class comes back (reset_classifier, forward_features,
    pretrained_cfg work), every norm converted with its own SiLU, equal to timm's model in float64."""
    model = _model("efficientnet_b0")
    conv, report = convert_model(model, keep_modules=True, return_report=True)
    assert type(conv) is type(model) and conv.pretrained_cfg == model.pretrained_cfg
    assert report.counts() == {"bn+act": 33, "bn": 16, "left": 0}, str(report)
    for training in (True, False):
        _assert_equivalent(model, conv, _x(), training=training)
    # timm's own activation checkpointing (checkpoint_seq over the stages) on both: recomputed stages rerun the
    # layers in their forward, running statistics counted twice as for BatchNorm
    model.set_grad_checkpointing(True), conv.set_grad_checkpointing(True)
    _assert_equivalent(model, conv, _x())
    conv.reset_classifier(5)
    assert conv(_x()).shape == (2, 5) and conv.forward_features(_x()).shape == (2, 1280, 2, 2)


@pytest.mark.parametrize("name,counts", [
    ("resnet18", {"bn+add+act": 8, "bn+act": 9, "bn": 3, "left": 0}),  # plain BatchNorm2d, drop_block identities
    ("regnetx_002", {"bn+add+act": 13, "bn+act": 27, "bn": 4, "left": 0}),  # BatchNormAct2d with ReLU
])
def test_relu_models_equal_their_leaky_relu_twins(name, counts):
    """ReLU (a module, or the act of a BatchNormAct2d) becomes leaky_relu(0.01): the converted model equals
    the timm model with every ReLU swapped for LeakyReLU(0.01), in training, to float64 rounding."""
    model = _model(name)
    conv, report = convert_model(copy.deepcopy(model), return_report=True)
    assert report.counts() == counts, str(report)
    _assert_equivalent(_swap_relu(model), conv, _x())


def test_same_padding_models_trace_through_timm_leaves():
    """tf_efficientnet_b0's Conv2dSame pads with Python arithmetic on the input size, which torch.fx cannot
    trace; timm registers it as an fx leaf, and convert_model's tracer honours timm's registry."""
    model = _model("tf_efficientnet_b0")
    conv, report = convert_model(copy.deepcopy(model), return_report=True)
    assert report.counts()["left"] == 0 and len(report.converted) == 49, str(report)
    _assert_equivalent(model, conv, _x(48))


def test_unsupported_norm_act_modules_are_left_with_a_reason():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), BatchNormAct2d(4, act_layer=nn.ReLU6),
        nn.Conv2d(4, 4, 3), BatchNormAct2d(4, act_layer=nn.SiLU, drop_layer=nn.Dropout),
        nn.Conv2d(4, 4, 3), BatchNormAct2d(4, act_layer=nn.SiLU)).double()
    conv, report = convert_model(copy.deepcopy(model), return_report=True)
    left = {x.name: x.reason for x in report.left}
    assert left == {"1": "the activation of BatchNormAct2d, ReLU6, is not supported (identity, ReLU, LeakyReLU, "
                         "ELU, SiLU)",
                    "3": "BatchNormAct2d applies Dropout between the norm and its activation"}, left
    assert [c.name for c in report.converted] == ["5"]
    assert type(conv.get_submodule("1")) is BatchNormAct2d and isinstance(conv.get_submodule("5"), InPlaceABN)
    torch.manual_seed(3)
    y0 = model.eval()(_x(16))
    assert torch.allclose(conv.eval()(_x(16)), y0, rtol=1e-12, atol=1e-12)


def test_group_norm_act_and_sync_batch_norm_act():
    """timm's GroupNormAct becomes an InPlaceAGN (exact in float64), and the SyncBatchNormAct of timm's own
    convert_sync_batchnorm an InPlaceABNSync with the activation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), GroupNormAct(8, num_groups=4, act_layer=nn.SiLU),
                          nn.Conv2d(8, 8, 3), GroupNormAct(8, num_groups=2, act_layer=nn.ELU)).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
    conv, report = convert_model(copy.deepcopy(model), return_report=True)
    assert report.counts() == {"gn+act": 2, "left": 0}, str(report)
    assert [(type(conv.get_submodule(n)), conv.get_submodule(n).activation) for n in ("1", "3")] == [
        (InPlaceAGN, "silu"), (InPlaceAGN, "elu")]
    _assert_equivalent(model, conv, _x(12))

    synced = timm.layers.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4, act_layer=nn.SiLU)))
    conv, report = convert_model(synced, return_report=True)
    layer = conv.get_submodule("1")
    assert type(layer) is InPlaceABNSync and layer.activation == "silu", str(report)


@pytest.mark.parametrize("act,param", [("leaky_relu", 0.01), ("elu", 1.0), ("identity", 0.0)])
def test_timm_inplace_abn_layer_runs_on_this_package(act, param):
    """timm.layers.InplaceAbn imports inplace_abn.functions.inplace_abn (the original package's API) and
    calls it positionally; on this package it computes BatchNorm with the |w| + eps scale + activation, its
    gradients and running statistics, to float64 rounding."""
    from timm.layers import inplace_abn as timm_iabn
    from reference import stock

    assert timm_iabn.has_iabn  # timm found this package as inplace_abn
    torch.manual_seed(0)
    layer = timm_iabn.InplaceAbn(6, act_layer=act, act_param=param).double()
    with torch.no_grad():
        layer.weight.uniform_(-1.5, 1.5), layer.bias.uniform_(-0.5, 0.5)
    x0 = torch.randn(3, 6, 5, 5, dtype=torch.float64)
    w, b = (p.detach().clone().requires_grad_() for p in (layer.weight, layer.bias))
    rm, rv = layer.running_mean.clone(), layer.running_var.clone()
    xr = x0.clone().requires_grad_()
    ref = stock(xr, w, b, rm, rv, activation=act, activation_param=param, weight_mode="abs")
    x = x0.clone().requires_grad_()
    y = layer(x * 1)
    g = torch.randn_like(ref)
    ref.backward(g)
    y.backward(g)
    for got, want in ((y, ref), (x.grad, xr.grad), (layer.weight.grad, w.grad), (layer.bias.grad, b.grad),
                      (layer.running_mean, rm), (layer.running_var, rv)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)

