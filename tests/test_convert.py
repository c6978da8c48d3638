"""Whole-model converter (inplace_abn.convert_model): patterns, safety rules,
exact equivalence in float64, training, state dicts and the memory targets."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

torchvision = pytest.importorskip("torchvision")

from inplace_abn import InPlaceABN, InPlaceABNSync  # noqa: E402
from inplace_abn.convert import bn_weight_to_signed, convert_model, load_batchnorm_state_dict  # noqa: E402
from inplace_abn.memory import model_saved_bytes  # noqa: E402
from reference import rel_err  # noqa: E402

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchvision / fx chatter
        yield


def _randomize_bn(model, seed=0):
    """Non-trivial BatchNorm parameters and statistics, some weights negative."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BN):
                C = m.num_features
                w = torch.rand(C, generator=g) + 0.5
                m.weight.copy_(torch.where(torch.rand(C, generator=g) < 0.3, -w, w))
                m.bias.copy_(torch.randn(C, generator=g) * 0.2)
                m.running_mean.copy_(torch.randn(C, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(C, generator=g) + 0.5)
    return model


def _swap_relu(model, slope=0.01):
    """Replace every nn.ReLU module by LeakyReLU(slope) (same inplace flag)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.ReLU:
                setattr(parent, name, nn.LeakyReLU(slope, inplace=child.inplace))
    return model


def _run(model, x, seed=0):
    """Output, input gradient and parameter gradients (by name) of one forward/backward."""
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # stochastic depth / dropout draw the same numbers
    out = model(x)
    out = out["out"] if isinstance(out, dict) else out
    dy = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
    (out * dy).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _assert_equivalent(ref_model, model, x, tol=1e-10, training=True):
    ref_model.train(training)
    model.train(training)
    y0, dx0, g0 = _run(ref_model, x)
    y1, dx1, g1 = _run(model, x)
    errs = {"y": rel_err(y1, y0), "dx": rel_err(dx1, dx0)}
    assert set(g0) == set(g1)
    # A conv bias before a training-mode BatchNorm has a zero gradient in exact
    # arithmetic (rounding noise only): compare against a floor, not its own norm.
    floor = 1e-3 * max(g.norm().item() for g in g0.values())
    errs.update({n: (g1[n] - g0[n]).norm().item() / max(g0[n].norm().item(), floor) for n in g0})
    b0, b1 = dict(ref_model.named_buffers()), dict(model.named_buffers())
    assert set(b0) == set(b1)
    errs.update({f"buffer {n}": rel_err(b1[n], b0[n]) for n in b0})
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst}: {errs[worst]:.3g}"
    return errs[worst]


# ---- weights -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_weight_mapping_reproduces_batchnorm_scale(dtype):
    eps = 1e-5
    g = torch.Generator().manual_seed(0)
    w = torch.cat([torch.randn(5000, generator=g, dtype=dtype), 1 + torch.randn(5000, generator=g, dtype=dtype) * 0.1,
                   torch.tensor([1.0, -1.0, 0.0, -0.0, eps / 2, -eps / 2, 2 * eps], dtype=dtype)])
    w2, exact = bn_weight_to_signed(w, eps)
    assert w2.dtype == dtype
    scale = torch.where(w2 < 0, -1.0, 1.0).to(dtype) * (w2.abs() + eps)  # what the kernels compute
    big = w.abs() > eps
    ulp = torch.finfo(dtype).eps * w.abs()
    assert torch.equal(scale == w, exact)
    assert bool(((scale - w).abs()[big] <= ulp[big]).all())  # never more than one ulp off
    assert exact[big].float().mean() > 0.99  # and exact almost everywhere (ties aside)
    near_one = (w - 1).abs() < 0.5
    assert bool(exact[near_one].all())  # weights near 1 (standard init) are exact
    small = ~big
    assert torch.equal(scale[small], torch.where(w[small] < 0, -1.0, 1.0).to(dtype) * eps)


# ---- equivalence -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet18_leaky():
    torch.manual_seed(0)
    return _randomize_bn(_swap_relu(torchvision.models.resnet18(num_classes=10))).double()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_resnet_with_leaky_relu_is_unchanged_float64(resnet18_leaky, training):
    ref = copy.deepcopy(resnet18_leaky)
    conv, report = convert_model(ref, return_report=True)
    counts = report.counts()
    assert counts == {"bn+add+act": 8, "bn+act": 9, "bn": 3, "left": 0}, counts
    x = torch.randn(2, 3, 48, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _assert_equivalent(ref, conv, x, training=training)


def test_relu_becomes_leaky_relu_only(resnet18_leaky):
    """A ReLU model converted with the default leaky_relu(0.01) equals the same
    model with every ReLU replaced by LeakyReLU(0.01)."""
    torch.manual_seed(0)
    relu_model = _randomize_bn(torchvision.models.resnet18(num_classes=10)).double()
    relu_model.load_state_dict(resnet18_leaky.state_dict())
    conv = convert_model(relu_model)
    assert not any(isinstance(m, (nn.ReLU, nn.BatchNorm2d)) for m in conv.modules())
    x = torch.randn(2, 3, 48, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _assert_equivalent(copy.deepcopy(resnet18_leaky), conv, x)


def test_silu_network_is_unchanged_float64():
    """EfficientNet-B0's first stages (SiLU, squeeze-excitation, stochastic depth,
    residuals, eps=1e-3), train and eval. (Cut at stride 16 so that every
    BatchNorm sees at least 8 values per channel: with 2 values per channel the
    float64 gradients are rounding noise amplified 1e10 times, in the stock
    model and the converted one alike.)"""
    torch.manual_seed(0)
    features = torchvision.models.efficientnet_b0().features[:5]
    ref = _randomize_bn(nn.Sequential(features, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(80, 10))).double()
    conv, report = convert_model(ref, return_report=True)
    assert report.counts() == {"bn+act": 16, "bn": 8, "left": 0}, report.counts()
    se_acts = [n for n, m in conv.named_modules() if isinstance(m, nn.SiLU)]
    assert len(se_acts) == 8  # the squeeze-excitation SiLUs (after a conv, no BN) stay
    assert all(n.endswith("activation") for n in se_acts)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _assert_equivalent(ref, conv, x, training=True)
    _assert_equivalent(ref, conv, x, training=False)


# ---- activation styles -------------------------------------------------------------------


class Styles(nn.Module):
    """Every way of writing the activation after a BatchNorm."""

    reference = False  # True: run _styles_reference instead (eager only)

    def __init__(self, C=6):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else C, C, 3, padding=1) for i in range(10))
        self.bns = nn.ModuleList(nn.BatchNorm2d(C) for _ in range(10))
        self.act = nn.ReLU(inplace=True)
        self.elu = nn.ELU(alpha=0.7)

    def forward(self, x):
        if self.reference:
            return _styles_reference(self, x)
        c, b = self.convs, self.bns
        x = self.act(b[0](c[0](x)))
        x = F.relu(b[1](c[1](x)))
        x = torch.relu(b[2](c[2](x)))
        x = b[3](c[3](x)).relu()
        x = F.silu(b[4](c[4](x)), inplace=True)
        x = F.leaky_relu(b[5](c[5](x)), 0.2)
        x = F.elu(b[6](c[6](x)), alpha=0.5)
        x = F.relu(x + b[7](c[7](x)))  # residual, shortcut first
        x = self.elu(b[8](c[8](x)))
        return torch.relu_(b[9](c[9](x)))


def _styles_reference(m, x):
    """Styles.forward with every ReLU replaced by leaky_relu(0.01)."""
    c, b = m.convs, m.bns
    r = lambda t: F.leaky_relu(t, 0.01)  # noqa: E731
    x = r(b[0](c[0](x)))
    x = r(b[1](c[1](x)))
    x = r(b[2](c[2](x)))
    x = r(b[3](c[3](x)))
    x = F.silu(b[4](c[4](x)))
    x = F.leaky_relu(b[5](c[5](x)), 0.2)
    x = F.elu(b[6](c[6](x)), alpha=0.5)
    x = r(x + b[7](c[7](x)))
    x = F.elu(b[8](c[8](x)), 0.7)
    return r(b[9](c[9](x)))


def test_module_function_and_method_activations():
    torch.manual_seed(0)
    model = _randomize_bn(Styles()).double()
    conv, report = convert_model(model, return_report=True)
    got = {c.name: (c.pattern, c.activation, c.activation_param) for c in report.converted}
    L = ("bn+act", "leaky_relu", 0.01)
    assert got == {
        "bns.0": L, "bns.1": L, "bns.2": L, "bns.3": L, "bns.4": ("bn+act", "silu", 0.0),
        "bns.5": ("bn+act", "leaky_relu", 0.2), "bns.6": ("bn+act", "elu", 0.5),
        "bns.7": ("bn+add+act", "leaky_relu", 0.01), "bns.8": ("bn+act", "elu", 0.7), "bns.9": L,
    }, got
    assert all(isinstance(conv.get_submodule(f"bns.{i}"), InPlaceABN) for i in range(10))
    assert "relu" not in conv.code and "silu" not in conv.code and "elu" not in conv.code
    ref = copy.deepcopy(model)
    ref.reference = True
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(ref, conv, x, training=training)


def test_custom_activation_choice():
    torch.manual_seed(0)
    model = Styles()
    conv, report = convert_model(model, activation="elu", activation_param=1.0, return_report=True)
    assert report.converted[0].activation == "elu" and report.converted[0].activation_param == 1.0
    conv, report = convert_model(model, activation="relu", activation_param=0.0, return_report=True)
    # relu is not invertible: those BatchNorms get no fused activation (the ReLUs stay).
    assert {c.name for c in report.converted if c.pattern == "bn+act"} == {"bns.4", "bns.5", "bns.6", "bns.8"}
    assert "not invertible" in str(report)


# ---- what is left, and why ---------------------------------------------------------------


class Awkward(nn.Module):
    def __init__(self, C=4):
        super().__init__()
        self.bn_on_input = nn.BatchNorm2d(3)
        self.conv1 = nn.Conv2d(3, C, 3, padding=1)
        self.bn_twice = nn.BatchNorm2d(C)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1)
        self.bn_gelu = nn.BatchNorm2d(C)
        self.conv3 = nn.Conv2d(C, C, 1)
        self.bn_input_reused = nn.BatchNorm2d(C)
        self.conv4 = nn.Conv2d(C, C, 1)
        self.bn_shared = nn.BatchNorm2d(C)
        self.conv5 = nn.Conv2d(C, C, 1)
        self.bn_modified_later = nn.BatchNorm2d(C)
        self.conv6 = nn.Conv2d(C, C, 1)
        self.bn_ok = nn.BatchNorm2d(C)
        self.fn_weight = nn.Parameter(torch.ones(C))

    def forward(self, x):
        x = self.bn_on_input(x)  # the caller's tensor: never overwritten
        a = self.conv1(x)
        y = self.bn_twice(a)
        y = F.leaky_relu(y, 0.1) + y  # output read twice: not fused
        z = F.gelu(self.bn_gelu(self.conv2(y)))  # GELU: not an invertible activation
        d = self.conv3(z)
        e = F.leaky_relu(self.bn_input_reused(d), 0.1) * d  # input read again: preserve_input
        f = self.bn_shared(self.conv4(e))
        f = self.bn_shared(F.leaky_relu(f, 0.1))  # one module called twice: left
        g = F.leaky_relu(self.bn_modified_later(self.conv5(f)), 0.1)
        g.add_(1.0)  # activation output modified in place: not fused
        h = F.batch_norm(self.conv6(g), None, None, self.fn_weight, None, True)  # functional: left
        return F.leaky_relu(self.bn_ok(h), 0.1)


def test_unconvertible_patterns_are_left_and_reported():
    torch.manual_seed(0)
    model = _randomize_bn(Awkward()).double()
    conv, report = convert_model(model, standalone=False, return_report=True)
    left = {x.name: x.reason for x in report.left}
    assert set(left) == {"bn_on_input", "bn_twice", "bn_gelu", "bn_shared", "bn_modified_later", "batch_norm"}, left
    # a model input followed by a conv: no activation to fuse, and no standalone layer beside a kept input
    assert "model input" in left["bn_on_input"] and "Conv2d" in left["bn_on_input"]
    assert "2 readers" in left["bn_twice"]
    assert "gelu" in left["bn_gelu"]
    assert "called 2 times" in left["bn_shared"]
    assert "in place" in left["bn_modified_later"]
    assert "functional" in left["batch_norm"]
    # its input is read again (by the product): converted with preserve_input
    reused, ok = report.converted
    assert (reused.name, reused.pattern, ok.name) == ("bn_input_reused", "bn+act", "bn_ok")
    assert reused.note.startswith("preserve_input: its input is also read by"), reused.note
    assert conv.get_submodule("bn_input_reused").preserve_input and not conv.get_submodule("bn_ok").preserve_input
    text = str(report)
    assert "converted 2 BatchNorm" in text and "left 6" in text and "bn_twice" in text
    for name in ("bn_on_input", "bn_twice", "bn_gelu", "bn_shared", "bn_modified_later"):
        assert type(conv.get_submodule(name)) is nn.BatchNorm2d
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


class _Placeholders(nn.Module):
    """nn.Identity placeholders (timm's drop_path / drop_block at rate 0) between a norm and the add
    or activation it fuses, one of them read twice."""

    def __init__(self, C=4):
        super().__init__()
        self.conv1, self.bn1, self.drop1, self.act1 = nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C), nn.Identity(), nn.ReLU()
        self.conv2, self.bn2, self.drop2 = nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C), nn.Identity()
        self.act2, self.head = nn.SiLU(), nn.Identity()
        self.conv3, self.bn3, self.attn, self.act3 = nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C), nn.Identity(), nn.ELU()

    def forward(self, x):
        h = self.act1(self.drop1(self.bn1(self.conv1(x))))
        d = self.drop2(self.bn2(self.conv2(h)))
        e = self.act3(self.attn(self.bn3(self.conv3(h)) + h))  # an identity between the add and its activation
        return self.head(self.act2(d + x) * d.mean() + e)  # d read twice: bn2 + add is not fused, bn2 stands alone


def test_identity_placeholders_do_not_block_fusion():
    torch.manual_seed(0)
    model = _randomize_bn(_Placeholders()).double()
    conv, report = convert_model(copy.deepcopy(model), return_report=True)
    assert [(c.name, c.pattern) for c in report.converted] == [("bn1", "bn+act"), ("bn2", "bn"),
                                                                ("bn3", "bn+add+act")], str(report)
    assert "head" in [n.target for n in conv.graph.nodes]  # an identity on no norm's output stays
    x, ref = torch.randn(2, 4, 6, 6, dtype=torch.float64), _swap_relu(model)
    for training in (True, False):
        _assert_equivalent(ref, conv, x, training=training)


def test_keep_modules_swaps_modules_in_the_model_itself():
    """keep_modules=True returns the model's own class with modules swapped (a deep copy). torchvision's
    BasicBlock calls one ReLU(inplace=True) twice and adds its shortcut in its code with ``out += identity``,
    in place (fx records it as ``out + identity``): those BatchNorms are left, the reasons given, and the
    result equals the stock model in float64 (with the in-place add overlooked, its backward raised)."""
    torch.manual_seed(0)
    model = _randomize_bn(_swap_relu(torchvision.models.resnet18(num_classes=10))).double()
    conv, report = convert_model(model, keep_modules=True, return_report=True)
    assert type(conv) is torchvision.models.ResNet and conv is not model
    assert report.counts() == {"bn+act": 1, "bn": 3, "left": 16}, str(report)
    assert isinstance(conv.bn1, InPlaceABN) and type(conv.relu) is nn.Identity  # stem: bn + its own activation
    block = conv.layer2[0]
    assert type(block.bn1) is nn.BatchNorm2d and type(block.bn2) is nn.BatchNorm2d
    assert isinstance(block.downsample[1], InPlaceABN)
    assert "bn+add not taken with keep_modules: the add is in the forward's code" in report.converted[1].note
    left = {x.name: x.reason for x in report.left}
    assert "the activation module layer1.0.relu is called 2 times" in left["layer1.0.bn1"]
    assert "modified in place by add (iadd)" in left["layer1.0.bn2"]
    assert conv.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(2, 3, 40, 40, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


class _Adds(nn.Module):
    """A BatchNorm output added to with ``+`` (a new tensor) and one with ``+=`` (in place in eager code)."""

    def __init__(self, C=4):
        super().__init__()
        self.conv1, self.bn1, self.conv2, self.bn2 = (nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C),
                                                      nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C))

    def forward(self, x):
        a = self.bn1(self.conv1(x))
        a = a + x
        b = self.bn2(self.conv2(a))
        b += a
        return b


@pytest.mark.parametrize("tracer", [None, "plain"], ids=["ours", "custom"])
def test_keep_modules_sees_augmented_assignments(tracer):
    """Under keep_modules the model's own code runs: ``b += a`` writes the BatchNorm output in place, so bn2
    stays (from the line that made the node); without recorded lines (a custom tracer) every such add counts
    as in place. With the graph (default) both become layers: its code adds out of place."""
    torch.manual_seed(0)
    model = _randomize_bn(_Adds()).double()
    tr = None if tracer is None else torch.fx.Tracer()
    conv, report = convert_model(model, keep_modules=True, tracer=tr, return_report=True)
    expected = ["bn1"] if tracer is None else []
    assert [c.name for c in report.converted] == expected, str(report)
    assert "modified in place by add_1 (iadd)" in {x.name: x.reason for x in report.left}["bn2"]
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)
    assert len(convert_model(model, return_report=True)[1].converted) == 2


def test_bn_output_used_twice_is_not_fused():
    """Standalone mode: the BatchNorm becomes an identity in-place layer, the
    activation stays separate, and both readers see BN(x)."""
    torch.manual_seed(0)
    model = _randomize_bn(Awkward()).double()
    conv, report = convert_model(model, return_report=True)
    by_name = {c.name: c for c in report.converted}
    assert by_name["bn_twice"].pattern == "bn" and by_name["bn_twice"].activation == "identity"
    assert "2 readers" in by_name["bn_twice"].note
    assert by_name["bn_gelu"].pattern == "bn"
    assert by_name["bn_modified_later"].pattern == "bn" and "in place" in by_name["bn_modified_later"].note
    assert by_name["bn_input_reused"].pattern == "bn+act" and "preserve_input" in by_name["bn_input_reused"].note
    left = {x.name for x in report.left}
    assert left == {"bn_on_input", "bn_shared", "batch_norm"}
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    _assert_equivalent(model, conv, x)


class PreActBlock(nn.Module):
    """x + conv2(act(bn2(conv1(act(bn1(x)))))): bn1's input is read again by the add."""

    def __init__(self, C=8):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(C), nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(C), nn.Conv2d(C, C, 3, padding=1, bias=False)

    def forward(self, x):
        h = self.conv1(F.leaky_relu(self.bn1(x), 0.1))
        return x + self.conv2(F.leaky_relu(self.bn2(h), 0.1))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["tables", "run"])
def test_pre_activation_blocks_convert_with_preserve_input(with_inputs):
    """bn1 (input read again by the shortcut add) becomes a layer with preserve_input, bn2
    an in-place one, with stock's results in float64. Stock saves six tensors per block:
    each BatchNorm's input, each leaky_relu's input (the BN output) and each conv's input;
    converted, the two layers' outputs (the convs' inputs). Leaving bn1 stock, as before
    preserve_input, kept x and bn1's output too."""
    torch.manual_seed(0)
    C, blocks = 8, 3
    model = _randomize_bn(nn.Sequential(nn.Conv2d(3, C, 3, padding=1), *[PreActBlock(C) for _ in range(blocks)]))
    x = torch.randn(2, 3, 12, 12)
    conv, report = convert_model(model.double(), example_inputs=(x.double(),) if with_inputs else None,
                                 return_report=True)
    assert report.counts() == {"bn+act": 2 * blocks, "left": 0}, report
    for k in range(1, blocks + 1):
        assert conv.get_submodule(f"{k}.bn1").preserve_input and not conv.get_submodule(f"{k}.bn2").preserve_input
    for training in (True, False):
        _assert_equivalent(model, conv, x.double(), training=training)
    model, conv = model.float(), conv.float()
    t = 2 * C * 12 * 12 * 4
    assert model_saved_bytes(model, x) - model_saved_bytes(conv, x) == pytest.approx(4 * t * blocks, abs=64 * C)


class Broadcast(nn.Module):
    def __init__(self, C=4):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.gate = nn.Conv2d(3, C, 1)

    def forward(self, x):
        s = self.gate(x).mean((2, 3), keepdim=True)  # (N, C, 1, 1): broadcasts
        return F.leaky_relu(self.bn(self.conv(x)) + s, 0.1)


def test_broadcasting_add_is_not_fused_with_example_inputs():
    torch.manual_seed(0)
    model = _randomize_bn(Broadcast()).double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    running = model.bn.running_mean.clone()
    conv, report = convert_model(model, example_inputs=(x,), return_report=True)
    assert torch.equal(model.bn.running_mean, running)  # the shape check does not train
    assert report.shapes_checked
    (c,) = report.converted
    assert c.pattern == "bn" and "shape" in c.note
    _assert_equivalent(model, conv, x)


class ModeDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = F.leaky_relu(self.bn(self.conv(x)), 0.1)
        return y * 2 if self.training else y  # a module with BatchNorm that reads self.training


def test_mode_dependent_graph_is_reported():
    """A forward reading self.training is not frozen into one mode's graph: it
    stays Python code, and the BatchNorm it calls is left (see
    test_fuse_convert_edges.py for models with convertible submodules)."""
    model = _randomize_bn(ModeDependent()).double()
    conv, report = convert_model(model, return_report=True)
    assert report.counts() == {"left": 1} and "self.training" in report.left[0].reason
    assert len(report.warnings) == 1 and "train/eval mode" in report.warnings[0]
    assert "warning:" in str(report)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)
    _, clean = convert_model(torchvision.models.efficientnet_b0(), return_report=True)
    assert not clean.warnings  # StochasticDepth is kept as a leaf, so it still follows train()/eval()


# ---- torchvision models, state dicts, training -------------------------------------------


def test_state_dict_names_kept_and_checkpoints_load(resnet18_leaky):
    model = copy.deepcopy(resnet18_leaky).float()
    conv = convert_model(model)
    sd_model, sd_conv = model.state_dict(), conv.state_dict()
    assert list(sd_model) == list(sd_conv) or set(sd_model) == set(sd_conv)
    assert isinstance(conv.get_submodule("layer1.0.bn1"), InPlaceABN)
    assert conv.get_submodule("layer1.0.bn1").weight_mode == "signed"
    x = torch.randn(2, 3, 32, 32)
    conv.eval()
    with torch.no_grad():
        expected = conv(x.clone())
    # the converted model's own checkpoint
    buf = io.BytesIO()
    torch.save(conv.state_dict(), buf)
    buf.seek(0)
    other = convert_model(copy.deepcopy(resnet18_leaky).float()).eval()
    other.load_state_dict(torch.load(buf))
    with torch.no_grad():
        assert torch.equal(other(x.clone()), expected)
    # a checkpoint of the original BatchNorm model
    fresh = convert_model(torchvision.models.resnet18(num_classes=10)).eval()
    load_batchnorm_state_dict(fresh, sd_model)
    with torch.no_grad():
        assert torch.equal(fresh(x.clone()), expected)
        model.eval()
        assert rel_err(expected, model(x)) < 1e-5
    # the whole module pickles
    buf = io.BytesIO()
    torch.save(conv, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(again(x.clone()), expected)


def test_inplace_conversion_keeps_parameter_objects():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    params = {id(p) for p in model.parameters()}
    model.layer1[0].bn1.weight.requires_grad_(False)  # a frozen BatchNorm stays frozen
    conv = convert_model(model, inplace=True)
    assert {id(p) for p in conv.parameters()} == params
    assert not conv.get_submodule("layer1.0.bn1").weight.requires_grad
    copy_conv = convert_model(torchvision.models.resnet18(num_classes=10))
    assert not ({id(p) for p in copy_conv.parameters()} & params)


def test_eval_mode_and_mixed_modes_are_kept():
    model = torchvision.models.resnet18(num_classes=10)
    model.eval()
    model.layer2.train()
    conv = convert_model(model)
    assert not conv.training and not conv.get_submodule("layer1.0.bn1").training
    assert conv.get_submodule("layer2.0.bn1").training
    assert conv.get_submodule("layer2").training


def test_sync_batchnorm_becomes_sync_layer():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4), nn.LeakyReLU(0.1)).eval()
    conv = convert_model(model)
    assert isinstance(conv.get_submodule("1"), InPlaceABNSync)
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        assert rel_err(conv(x), model(x)) < 1e-6


def test_converting_twice_changes_nothing():
    conv = convert_model(torchvision.models.resnet18(num_classes=10))
    again, report = convert_model(conv, return_report=True)
    assert not report.converted and not report.left
    assert sum(isinstance(m, InPlaceABN) for m in again.modules()) == 20


def test_converted_resnet18_trains_like_the_original():
    torch.manual_seed(0)
    original = torchvision.models.resnet18(num_classes=5)
    converted = convert_model(original)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 24, 24, generator=g)
    target = torch.randint(0, 5, (8,), generator=g)
    curves = []
    for model in (original, converted):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    orig, conv = curves
    assert orig[-1] < 0.2 * orig[0] and conv[-1] < 0.2 * conv[0], curves
    # ReLU became leaky_relu(0.01): close, not identical
    assert all(abs(a - b) <= 0.2 * max(a, b) + 0.1 for a, b in zip(orig, conv)), curves


# ---- memory targets (ratios measured at full size by benchmarks/bench_memory.py) ---------


@pytest.mark.parametrize("name,limit", [("resnet50", 0.56), ("deeplabv3_resnet50", 0.6), ("efficientnet_b0", 0.5)])
def test_saved_activation_memory_ratio(name, limit):
    torch.manual_seed(0)
    if name == "deeplabv3_resnet50":
        model = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None)
    else:
        model = getattr(torchvision.models, name)(weights=None)
    conv, report = convert_model(model, return_report=True)
    assert not report.left, str(report)
    x = torch.randn(2, 3, 48, 48)
    stock = model_saved_bytes(model, x)
    ours = model_saved_bytes(conv, x)
    assert ours <= limit * stock, f"{name}: {ours / stock:.3f} of stock ({ours} vs {stock} bytes)"


@pytest.mark.parametrize("zoo,families", [("timm", ["dla", "cspresnet"]), ("torchvision", ["resnet"])])
def test_zoo_script_converts_and_trains(zoo, families, capsys):
    """benchmarks/convert_zoo.py on a few families: each model converts and trains a step, exit status 0."""
    import importlib.util
    import os

    pytest.importorskip(zoo)
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "convert_zoo.py")
    spec = importlib.util.spec_from_file_location("convert_zoo", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--zoo", zoo, "--families", *families]) == 0
    out = capsys.readouterr().out
    n = {"timm": 2, "torchvision": 5}[zoo]
    assert f"{n} models with a BatchNorm or GroupNorm converted and trained a step" in out and "0 failed" in out


def test_memory_benchmark_quick(tmp_path, capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_memory.py")
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "memory.png"
    rows = bench.main(["--quick", "--no-cuda", "--models", "efficientnet_b0", "--out", str(out)])
    assert out.stat().st_size > 10000
    (row,) = rows
    assert row["ours"] <= 0.5 * row["stock"]
    text = capsys.readouterr().out
    assert "efficientnet_b0" in text and "ratio" in text
