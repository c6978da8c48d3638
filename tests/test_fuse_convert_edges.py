"""Edge cases of `fuse_for_inference` and `convert_model` that used to be
silently wrong or to raise where stock PyTorch works (issue 11, items 5, 6, 9).

References are stock ``torch.nn`` models (or stock batch_norm + activation)
evaluated in float64."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from inplace_abn import ABN, FoldedABN, InPlaceABN, fuse_for_inference
from reference import effective_weight, rel_err
from test_compile import _randomise

# ---- fuse_for_inference on a model torch.fx cannot trace (item 5) -------------------------


def _randomise_abn(model):
    return _randomise(model).eval()


def _stock_abn(layer, h):
    """Stock eval-mode BatchNorm + activation of an ABN (weight used as it is) or InPlaceABN (its g~)."""
    w = effective_weight(layer.weight, layer.eps, layer.weight_mode) if isinstance(layer, InPlaceABN) else layer.weight
    z = F.batch_norm(h, layer.running_mean, layer.running_var, w, layer.bias, False, 0.0, layer.eps)
    return F.leaky_relu(z, layer.activation_param)


class _Untraceable(nn.Module):
    """A conv + ABN pair inside an nn.Sequential, data-dependent control flow
    (torch.fx cannot trace it), and the conv used outside the Sequential too."""

    def __init__(self, use, layer=ABN):
        super().__init__()
        self.use = use
        self.seq = nn.Sequential(nn.Conv2d(3, 4, 1), layer(4, activation="leaky_relu", activation_param=0.1))

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent: torch.fx cannot trace this
            x = x * 1.0
        if self.use == "read_twice":  # the conv's output read by the layer and by the add
            h = self.seq[0](x)
            return self.seq[1](h) + h
        if self.use == "conv_alone":  # the conv called through the Sequential and alone
            return self.seq(x) + self.seq[0](x)
        return self.seq(x)  # the Sequential alone: the fold is valid

    def reference(self, x):
        conv, abn = self.seq
        h = conv(x)
        y = _stock_abn(abn, h)
        if self.use == "read_twice":  # an in-place layer overwrote h with y
            return y + (y if isinstance(abn, InPlaceABN) else h)
        return y + h if self.use == "conv_alone" else y


@pytest.mark.parametrize("layer", [ABN, InPlaceABN])
@pytest.mark.parametrize("use", ["read_twice", "conv_alone"])
def test_fuse_untraceable_conv_used_outside_sequential_refuses(use, layer):
    """Before: the conv was folded (the Sequential 'proved' it) and the output
    was off by 2.2 (relative; 34 with InPlaceABN), silently. Now the folded
    pair refuses to run outside its Sequential; without conv folding the
    result is exact (an in-place layer's input is overwritten, as before)."""
    model = _randomise_abn(_Untraceable(use, layer)).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = model.reference(x)
        fused = fuse_for_inference(model)
        assert fused.seq[1].scale is None  # folded, guarded
        with pytest.raises(RuntimeError, match="fold_conv=False"):
            fused(x)
        plain = fuse_for_inference(model, fold_conv=False)
        assert rel_err(plain(x), ref) < 1e-12


def test_fuse_untraceable_guarded_fold_is_exact_and_survives_copies():
    model = _randomise_abn(_Untraceable("sequential")).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = model.reference(x)
        fused = fuse_for_inference(model)
        assert fused.seq[1].scale is None
        assert rel_err(fused(x), ref) < 1e-12
        for again in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
            assert rel_err(again(x), ref) < 1e-12
            with pytest.raises(RuntimeError, match="outside that Sequential"):
                again.seq[0](x)  # the guard travels with the model
        buf = io.BytesIO()
        torch.save(fused, buf)
        buf.seek(0)
        with pytest.raises(RuntimeError, match="outside that Sequential"):
            torch.load(buf, weights_only=False).seq[0](x)


def test_fuse_untraceable_shared_conv_or_custom_sequential_not_folded():
    """A conv registered under a second name, or a Sequential with its own
    forward, proves nothing: scale/shift folding only, exact."""

    class Shared(_Untraceable):
        def __init__(self):
            super().__init__("sequential")
            self.alias = self.seq[0]

        def forward(self, x):
            return super().forward(x) + self.alias(x)

        def reference(self, x):
            return super().reference(x) + self.seq[0](x)

    class Reordered(nn.Sequential):
        def forward(self, x):
            h = self[0](x)
            return self[1](h) + h

    custom = _Untraceable("sequential")
    custom.seq = Reordered(*custom.seq)
    custom.reference = lambda x: (lambda h: _stock_abn(custom.seq[1], h) + h)(custom.seq[0](x))
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for model in (_randomise_abn(Shared()).double(), _randomise_abn(custom).double()):
        with torch.no_grad():
            ref = model.reference(x)
            fused = fuse_for_inference(model)
            assert fused.seq[1].scale is not None
            assert rel_err(fused(x), ref) < 1e-12


@pytest.mark.parametrize("fold_conv", [True, False])
def test_fuse_traced_inplace_layer_input_read_again(fold_conv):
    """fx path: an InPlaceABN whose input (a conv output) is read again after
    it: that reader saw the layer's output. Before: the folded layer left the
    input alone (1.26 relative off). Now it writes its input, as the layer did;
    where nothing reads the input again, nothing is written."""

    class ReadAgain(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.conv2 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)
            self.abn = InPlaceABN(4, activation="leaky_relu", activation_param=0.1)
            self.abn2 = InPlaceABN(4, activation="leaky_relu", activation_param=0.1)

        def forward(self, x):
            h = self.conv(x)
            y = self.abn(h) + h  # h is y here
            return self.abn2(self.conv2(y))

    model = _randomise_abn(ReadAgain()).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        y = _stock_abn(model.abn, model.conv(x))
        ref = _stock_abn(model.abn2, model.conv2(y + y))
        fused = fuse_for_inference(model, fold_conv=fold_conv)
        assert fused.abn.write_input and not fused.abn2.write_input
        assert (fused.abn2.scale is None) == fold_conv
        assert rel_err(fused(x), ref) < 1e-12


@pytest.mark.parametrize("fold_conv", [True, False])
def test_fuse_preserve_input_layer_leaves_its_input(fold_conv):
    """An InPlaceABN with preserve_input never wrote its input, which is read again:
    the folded layer returns a new tensor (write_input off), and the reader sees the input."""

    class Shortcut(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.abn = InPlaceABN(4, activation="leaky_relu", activation_param=0.1, preserve_input=True)

        def forward(self, x):
            h = self.conv(x)
            return self.abn(h) + h

    model = _randomise_abn(Shortcut()).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        h = model.conv(x)
        ref = _stock_abn(model.abn, h) + h
        assert rel_err(model.eval()(x), ref) < 1e-12  # the layer itself
        fused = fuse_for_inference(model, fold_conv=fold_conv)
        assert not fused.abn.write_input
        assert rel_err(fused(x), ref) < 1e-12


def test_fuse_traced_conv_weight_read_directly_not_folded():
    """fx path: a forward that also reads the conv's weight (F.conv2d(x, self.conv.weight))."""

    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1, bias=False)
            self.abn = InPlaceABN(4, activation="leaky_relu", activation_param=0.1)

        def forward(self, x):
            return self.abn(self.conv(x)) + F.conv2d(x, self.conv.weight)

    model = _randomise_abn(Direct()).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        fused = fuse_for_inference(model)
        assert isinstance(fused.abn, FoldedABN) and fused.abn.scale is not None
        assert rel_err(fused(x), ref) < 1e-12


# ---- convert_model: what may be overwritten, from what autograd saves (item 9) -----------

torchvision = pytest.importorskip("torchvision")

from inplace_abn import _convert_analysis as analysis  # noqa: E402
from inplace_abn.convert import convert_model  # noqa: E402
from test_convert import Awkward, ModeDependent, _assert_equivalent, _randomize_bn  # noqa: E402


def _saves_or_aliases(fn, *args, module=None, frozen=()):
    """(output aliases an input or parameter, output saved for backward, output has
    overlapping elements) for one call of ``fn``, found by running it: float
    inputs (but those at ``frozen``) and parameters require grad, saved-tensor
    hooks record what autograd keeps."""
    args = [a.detach().clone().requires_grad_(a.is_floating_point() and i not in frozen)
            if isinstance(a, torch.Tensor) else [b.detach().clone().requires_grad_() for b in a]
            if isinstance(a, list) else a for i, a in enumerate(args)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args)
    keys = analysis._keys
    aliased = bool(keys(out) & (keys(args) | keys(list(module.parameters()) if module is not None else [])))
    overlap = torch._debug_has_internal_overlap(out) != 0
    return aliased, bool(keys(out) & keys(saved)), overlap


def _fresh_function_samples():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    a, b = r(2, 3, 4), r(2, 3, 4)
    x1, x2, x3 = r(2, 3, 8), r(2, 3, 6, 6), r(2, 3, 4, 4, 4)
    ops = __import__("operator")
    return {
        ops.add: (a, b), ops.sub: (a, b), ops.mul: (a, b), ops.truediv: (a, b), ops.matmul: (a, r(4, 5)),
        ops.neg: (a,), torch.add: (a, b), torch.sub: (a, b), torch.mul: (a, b), torch.div: (a, b),
        torch.matmul: (a, r(4, 5)), torch.bmm: (a, r(2, 4, 5)), torch.cat: ([a, b],), torch.concat: ([a, b],),
        torch.stack: ([a, b],), F.conv1d: (x1, r(4, 3, 3)), F.conv2d: (x2, r(4, 3, 3, 3)),
        F.conv3d: (x3, r(4, 3, 1, 1, 1)), F.conv_transpose1d: (x1, r(3, 4, 3)),
        F.conv_transpose2d: (x2, r(3, 4, 3, 3)), F.conv_transpose3d: (x3, r(3, 4, 1, 1, 1)),
        F.linear: (a, r(5, 4)), F.interpolate: (x2, None, 2), F.avg_pool1d: (x1, 2), F.avg_pool2d: (x2, 2),
        F.avg_pool3d: (x3, 2), F.adaptive_avg_pool1d: (x1, 8), F.adaptive_avg_pool2d: (x2, 6),
        F.adaptive_avg_pool3d: (x3, 4), F.layer_norm: (a, (4,)), F.group_norm: (r(2, 4, 5), 2),
        F.batch_norm: (a, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)),
        F.instance_norm: (a,), F.gelu: (a,), F.silu: (a,), F.hardswish: (a,), F.leaky_relu: (a,), F.mish: (a,),
        torch.mean: (a,), torch.sum: (a,),
    }


def _fresh_module_samples():
    r = lambda *s: torch.randn(*s, dtype=torch.float64)  # noqa: E731
    x = r(2, 3, 6, 6)
    mods = [(nn.Conv2d(3, 4, 3), x), (nn.ConvTranspose2d(3, 4, 3), x), (nn.Linear(6, 5), x),
            (nn.Embedding(10, 4), torch.tensor([[1, 2], [3, 1]])), (nn.AvgPool2d(2), x),
            (nn.AdaptiveAvgPool2d(6), x), (nn.AdaptiveAvgPool2d(1), x), (nn.Upsample(scale_factor=1), x),
            (nn.Upsample(scale_factor=2), x), (nn.LayerNorm(6), x), (nn.GroupNorm(1, 3), x),
            (nn.InstanceNorm2d(3, affine=True), x), (nn.BatchNorm2d(3), x), (nn.GELU(), x), (nn.SiLU(), x),
            (nn.Hardswish(), x), (nn.LeakyReLU(0.1), x), (nn.Mish(), x), (nn.MaxPool2d(2), x),
            (nn.AdaptiveMaxPool2d(3), x)]
    bil = nn.Bilinear(6, 6, 4).double()
    mods.append((lambda p, q: bil(p, q), (r(2, 6), r(2, 6)), bil))
    return mods


def test_fresh_operator_tables_agree_with_autograd():
    """Every operation the converter's static rules (no example_inputs) call
    "fresh" returns new memory that its own backward does not save, in
    training and in eval mode: derived here from autograd, for every entry."""
    samples = _fresh_function_samples()
    assert set(samples) == analysis._FRESH_FUNCS
    for fn, args in samples.items():
        frozen = (1, 2) if fn is F.batch_norm else ()  # the running statistics take no gradient
        assert _saves_or_aliases(fn, *args, frozen=frozen) == (False, False, False), fn
    for method in analysis._FRESH_METHODS:
        a, b = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
        other = () if method in ("clone", "mean", "sum", "var") else (b.transpose(1, 2),) if method == "matmul" \
            else (b,)
        assert _saves_or_aliases(lambda t, *o: getattr(t, method)(*o), a, *other) == (False, False, False), method
    covered = set()
    for entry in _fresh_module_samples():
        m, x, owner = (entry + (None,))[:3]
        owner = owner if owner is not None else m
        covered |= {t for t in analysis._FRESH_MODULES + analysis._POOL_MAX_MODULES if isinstance(owner, t)}
        if isinstance(m, nn.Module):
            m.double()
        for training in (True, False):
            owner.train(training)
            args = x if isinstance(x, tuple) else (x,)
            assert _saves_or_aliases(m, *args, module=owner) == (False, False, False), (owner, training)
    assert covered == set(analysis._FRESH_MODULES + analysis._POOL_MAX_MODULES)
    # and the ones left out of the tables do save their output (the converted backward raised)
    for method in ("amax", "amin", "norm", "std", "exp", "sigmoid"):
        a = torch.randn(2, 3, 4, dtype=torch.float64)
        assert _saves_or_aliases(lambda t: getattr(t, method)(), a)[1], method


class _Expanded(ModeDependent):  # its conv and bn
    def forward(self, x):
        return F.leaky_relu(self.bn(self.conv(x).expand(3, 4, 5, 5)), 0.1)


class _Reduced(nn.Module):
    """BatchNorm1d on a reduction of a linear layer's output."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return F.leaky_relu(self.bn(getattr(self.lin(x), self.op)(dim=1)), 0.1)


_EDGE_MODELS = [("expand", _Expanded, (1, 3, 5, 5))] + [
    (op, lambda op=op: _Reduced(op), (6, 7, 5)) for op in ("amax", "amin", "norm", "std", "var", "mean", "sum")]


@pytest.mark.parametrize("with_inputs", [False, True], ids=["tables", "run"])
@pytest.mark.parametrize("name,make,shape", _EDGE_MODELS, ids=[m[0] for m in _EDGE_MODELS])
def test_convert_expanded_or_output_saving_input_trains_like_stock(name, make, shape, with_inputs):
    """Before: an expanded input raised in the converted model (train and eval),
    and after amax/amin/norm/std the training backward raised (their output,
    saved for their backward, was overwritten). Now such BatchNorms become
    layers with preserve_input (x is not written), the rest in-place layers,
    and the model equals stock in float64."""
    torch.manual_seed(0)
    model = _randomize_bn(make()).double()
    x = torch.randn(*shape, dtype=torch.float64)
    conv, report = convert_model(model, example_inputs=(x,) if with_inputs else None, return_report=True)
    assert report.counts() == {"bn+act": 1, "left": 0}
    (layer,) = report.converted
    if name in ("expand", "amax", "amin", "norm", "std"):
        assert layer.note.startswith("preserve_input: ") and (
            "expanded" if name == "expand" else "saved for backward" if with_inputs else "not known") \
            in layer.note, layer.note
        assert conv.get_submodule("bn").preserve_input
    else:
        assert not layer.note and not conv.get_submodule("bn").preserve_input
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


class _Unlisted(nn.Module):
    """Operations no table lists: abs returns fresh memory it does not save,
    exp and sigmoid save their output."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 3, 1) for _ in range(3))
        self.bns = nn.ModuleList(nn.BatchNorm2d(3) for _ in range(3))

    def forward(self, x):
        x = F.leaky_relu(self.bns[0](torch.abs(self.convs[0](x))), 0.1)
        x = F.leaky_relu(self.bns[1](torch.exp(self.convs[1](x) * 0.1)), 0.1)
        return F.leaky_relu(self.bns[2](torch.sigmoid(self.convs[2](x))), 0.1)


def test_convert_with_example_inputs_derives_safety_from_autograd():
    torch.manual_seed(0)
    model = _randomize_bn(_Unlisted()).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    conv, report = convert_model(model, example_inputs=(x,), return_report=True)
    # bns.1 and bns.2 read outputs that exp and sigmoid save: preserve_input
    notes = {c.name: c.note for c in report.converted}
    assert list(notes) == ["bns.0", "bns.1", "bns.2"] and not report.left and not notes["bns.0"]
    assert "preserve_input: its input's memory is saved for backward by exp" in notes["bns.1"], notes
    assert "preserve_input: its input's memory is saved for backward by sigmoid" in notes["bns.2"], notes
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)
    _, static = convert_model(model, return_report=True)
    # the tables know none of the three: all with preserve_input
    assert all(c.note.startswith("preserve_input: ") for c in static.converted) and len(static.converted) == 3


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_run_safety_agrees_with_tables_on_known_models(training):
    """resnet18, EfficientNet-B0 and the awkward patterns of test_convert: the
    run-based judgement converts exactly what the tables do, and the result
    equals stock."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    for model in (torchvision.models.resnet18(num_classes=10), torchvision.models.efficientnet_b0().features[:3]):
        _, by_table = convert_model(model.train(training), return_report=True)
        _, by_run = convert_model(model, example_inputs=(x,), return_report=True)
        assert [(c.name, c.pattern) for c in by_run.converted] == [(c.name, c.pattern) for c in by_table.converted]
        assert not by_run.left
    model = _randomize_bn(Awkward()).double().train(training)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    _, by_table = convert_model(model, return_report=True)
    conv, by_run = convert_model(model, example_inputs=(x,), return_report=True)
    assert [(c.name, c.pattern) for c in by_run.converted] == [(c.name, c.pattern) for c in by_table.converted]
    assert {x.name for x in by_run.left} == {x.name for x in by_table.left}
    _assert_equivalent(model, conv, x, training=training)


# ---- convert_model on forwards that read self.training (item 6) ---------------------------


class _ModeRoot(nn.Module):
    """The model's own forward reads self.training."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.1))
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = F.leaky_relu(self.bn(self.conv(self.stem(x))), 0.1)
        return y * 2 if self.training else y


class _ModeBlock(nn.Module):
    """A block whose forward reads self.training, holding BatchNorms (one in a
    Sequential, one called by the block's forward itself)."""

    def __init__(self, C=4):
        super().__init__()
        self.unit = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C), nn.LeakyReLU(0.1))
        self.convs = nn.ModuleList([nn.Conv2d(C, C, 1)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(C)])

    def forward(self, x):
        y = self.bns[0](self.convs[0](self.unit(x)))
        return y + (0.5 * x if self.training else x)


class _ModeNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.block = _ModeBlock()
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.block(F.elu(self.bn(self.stem(x)))))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["tables", "run"])
@pytest.mark.parametrize("make", [_ModeRoot, _ModeNested], ids=["root", "nested"])
def test_convert_forward_reading_training_is_correct_in_both_modes(make, with_inputs):
    """Before: the graph traced in one mode was kept for both (eval output 1.0
    relative off for _ModeRoot, 0.5 for _ModeNested's block). Now a forward
    that reads self.training stays Python code, its submodules are converted
    one by one, and the BatchNorms it calls itself are left and reported."""
    torch.manual_seed(0)
    model = _randomize_bn(make()).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    conv, report = convert_model(model, example_inputs=(x,) if with_inputs else None, return_report=True)
    if make is _ModeRoot:
        assert [c.name for c in report.converted] == ["stem.1"]
        assert [x.name for x in report.left] == ["bn"] and "self.training" in report.left[0].reason
        assert type(conv) is _ModeRoot and isinstance(conv.stem.get_submodule("1"), InPlaceABN)
    else:
        assert [c.name for c in report.converted] == ["bn", "block.unit.1"]
        assert [x.name for x in report.left] == ["block.bns.0"]
        assert "block (_ModeBlock)" in report.left[0].reason
        assert type(conv.block) is _ModeBlock and isinstance(conv.block.unit.get_submodule("1"), InPlaceABN)
    assert any("self.training" in w for w in report.warnings)
    assert set(conv.state_dict()) == set(model.state_dict())
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


class _WritesChildOutput(nn.Module):
    """Kept as Python code (it reads self.training); writes what its children return in place: with +=,
    and through a ReLU(inplace=True) module. ``scale`` is written in place but holds no child's output."""

    def __init__(self, C=4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C))  # a standalone BatchNorm
        self.body2 = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        scale = x.new_ones(())
        scale += 1
        out = self.body(x)
        if not self.training:
            out = out * 1.0
        out += x
        return out * self.act(self.body2(x)) * scale


class _ReturnsChildOutput(nn.Module):
    """Kept as Python code (it reads self.training); returns what its child returns."""

    def __init__(self, C=4):
        super().__init__()
        self.unit = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C), nn.SiLU())
        self.body = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C))

    def forward(self, x):
        return self.body(self.unit(x) if self.training else self.unit(x))


class _WritesLeafOutput(nn.Module):
    """Traced; a leaf (it reads self.training) whose output the graph writes in place (relu_)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.block = _ReturnsChildOutput()
        self.wrapped = _WritesChildOutput()

    def forward(self, x):
        return self.wrapped(F.relu(self.block(self.conv(x)), inplace=True))


@pytest.mark.parametrize("keep_modules", [False, True], ids=["graph", "keep_modules"])
def test_convert_child_output_written_in_place_by_caller_code(keep_modules):
    """A submodule converted on its own returns a layer's output; code that then writes it in place (the
    kept forward's ``out += x``, the parent graph's ``relu(inplace=True)`` on a leaf's output) would change
    what the layer saved (backward raised). Such a layer is not made; the report names the writer."""
    torch.manual_seed(0)
    model = _randomize_bn(_WritesLeafOutput()).double()
    conv, report = convert_model(model, keep_modules=keep_modules, return_report=True)
    left = {x.name: x.reason for x in report.left}
    assert "modified in place by the caller, to which it is returned (_WritesChildOutput.forward writes out " \
           "with an augmented assignment)" in left["wrapped.body.1"], str(report)
    assert "(_WritesChildOutput.forward writes self.body2(x) in place (inplace=True))" in left["wrapped.body2.1"], \
        str(report)
    assert "modified in place by the caller, to which it is returned (by relu" in left["block.body.1"], str(report)
    assert [c.name for c in report.converted] == ["block.unit.1"]  # inside the leaf, not returned
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


class _LeafThenLayer(nn.Module):
    """A leaf (_ReturnsChildOutput reads self.training) whose result a BatchNorm + SiLU takes."""

    def __init__(self):
        super().__init__()
        self.conv, self.leaf, self.bn, self.act = nn.Conv2d(3, 4, 1), _ReturnsChildOutput(), nn.BatchNorm2d(4), nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.leaf(self.conv(x))))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["tables", "run"])
def test_convert_leaf_output_taken_by_an_in_place_layer(with_inputs):
    """The parent graph is converted before its leaves. Judged from a run, bn may overwrite the leaf's
    result (stock, nothing saves it); the leaf converted next returned its own layer's output there, which
    that layer saves (backward raised). The leaf now returns none; from the tables, bn keeps its input."""
    torch.manual_seed(0)
    model = _randomize_bn(_LeafThenLayer()).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    conv, report = convert_model(model, example_inputs=(x,) if with_inputs else None, return_report=True)
    left = {x.name: x.reason for x in report.left}
    if with_inputs:
        assert "returned (by bn (InPlaceABN, which overwrites its input))" in left["leaf.body.1"], str(report)
    else:
        assert conv.get_submodule("bn").preserve_input and "leaf.body.1" not in left, str(report)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


def test_convert_batchnorm_inside_a_leaf_called_directly_is_left():
    """A forward that calls a mode-dependent block and also a BatchNorm inside
    it: the block's own forward calls that BatchNorm too, so converting it
    (fused with the outer activation) would change the block."""

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = _ModeBlock()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = self.block(x)
            return F.leaky_relu(self.block.unit[1](self.conv(y)), 0.1)

    torch.manual_seed(0)
    model = _randomize_bn(Outer()).double()
    conv, report = convert_model(model, return_report=True)
    left = {x.name: x.reason for x in report.left}
    assert "belongs to block" in left["block.unit.1"], left
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


def test_convert_python_forward_reaching_into_a_submodule_keeps_it():
    """A forward kept as Python code (it reads self.training) that calls a
    BatchNorm inside its child as well as the child: the child is not
    converted on its own (its BatchNorm would become a fused in-place layer
    under the forward's direct call)."""

    class ReachIn(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(0.1))
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = self.block(x)
            y = self.block[1](self.conv(y))  # the block's BatchNorm, called directly
            return y * 2 if self.training else y

    torch.manual_seed(0)
    model = _randomize_bn(ReachIn()).double()
    conv, report = convert_model(model, return_report=True)
    assert not report.converted
    assert [x.name for x in report.left] == ["block.1"] and "directly" in report.left[0].reason
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)


def test_convert_example_input_without_memory_leaves_the_layers():
    """Example inputs with an empty batch: the run sees no memory behind any norm's
    input, so nothing can be judged (not even for preserve_input): every norm is left,
    with the reason; the same model without example inputs converts."""
    torch.manual_seed(0)
    model = _randomize_bn(_Unlisted()).double()
    empty = torch.randn(0, 3, 4, 4, dtype=torch.float64)
    conv, report = convert_model(model, example_inputs=(empty,), return_report=True)
    left = {x.name: x.reason for x in report.left}
    assert not report.converted and list(left) == ["bns.0", "bns.1", "bns.2"], left
    assert all(r.startswith("its input holds no tensor memory (in ") for r in left.values()), left
    _, static = convert_model(model, return_report=True)
    assert len(static.converted) == 3 and not static.left
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for training in (True, False):
        _assert_equivalent(model, conv, x, training=training)
