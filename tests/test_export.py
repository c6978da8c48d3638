"""torch.export, ONNX and inference folding (`inplace_abn.fuse_for_inference`).

Under torch.export (and torch.jit.trace, the legacy ONNX path) the layers are
expressed with stock operators (batch_norm + activation), so exported programs
and ONNX files hold no ``inplace_abn::`` operator. `fuse_for_inference` folds
eval-mode layers into scale/shift + activation, or into the preceding
convolution.
"""
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

from inplace_abn import ABN, FoldedABN, InPlaceABN, InPlaceABNSync, fuse_for_inference
from reference import rel_err
from test_compile import _randomise, resnet18_iabn


class Net(nn.Module):
    """Every layer type and activation, weight modes, residual, no-affine, a conv output with two users."""

    def __init__(self, C=6):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1, bias=False)
        self.a0 = InPlaceABN(C, activation="leaky_relu", activation_param=0.1)
        self.body = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), InPlaceABN(C, activation="elu", activation_param=0.8,
                                                                            weight_mode="signed"))
        self.c2 = nn.Conv2d(C, C, 1)
        self.a2 = InPlaceABNSync(C, activation="silu")
        self.c3 = nn.Conv2d(C, C, 1)
        self.a3 = ABN(C, activation="relu")
        self.c4 = nn.Conv2d(C, C, 1)
        self.a4 = InPlaceABN(C, activation="identity", affine=False)

    def forward(self, x):
        h = self.a0(self.stem(x))
        h = self.body(h)
        h = self.a2(self.c2(h), residual=h)
        t = self.c3(h)
        h = self.a3(t) + t  # t has two users: a3 is not folded into c3
        return self.a4(self.c4(h))


def _model(seed=0):
    torch.manual_seed(seed)
    m = _randomise(Net(), seed)
    with torch.no_grad():
        m.body[1].weight[:2] *= -1  # negative weights in signed mode
    return m.eval()


def _op_names(graph):
    return {str(n.target) for n in graph.nodes if n.op == "call_function"}


def _assert_standard(ops):
    assert not any("inplace_abn" in op for op in ops), ops
    assert all(op.startswith("aten.") or op.startswith("<built-in") for op in ops), ops


def _close(a, b, rtol=1e-5):
    err = rel_err(a, b)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}"


def test_export_eval_standard_ops():
    model = _model()
    x = torch.randn(2, 3, 7, 5)
    ref = model(x.clone())
    ep = torch.export.export(model, (x,))
    ops = _op_names(ep.graph)
    _assert_standard(ops)
    assert "aten.batch_norm.default" in ops or any("batch_norm" in op for op in ops)
    x_in = x.clone()
    _close(ep.module()(x_in), ref)
    assert torch.equal(x_in, x)  # the exported program does not overwrite its input


def test_export_training_mode_standard_ops():
    """A training-mode model exports too (stock batch_norm updates the running stats)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), InPlaceABN(4, activation="leaky_relu", activation_param=0.1),
                          nn.Conv2d(4, 2, 1))
    eager = copy.deepcopy(model)
    x = torch.randn(3, 3, 6, 6)
    ep = torch.export.export(model.train(), (x,))
    _assert_standard(_op_names(ep.graph))
    exported = ep.module()
    y = exported(x)
    _close(y, eager.train()(x))
    _close(exported.get_buffer("1.running_var"), eager[1].running_var)


def test_fuse_matches_eval_and_folds():
    model = _model()
    x = torch.randn(2, 3, 7, 5)
    ref = model(x.clone())
    fused = fuse_for_inference(model)
    assert fused is not model and isinstance(model.a0, InPlaceABN)  # a deep copy by default
    assert not any(isinstance(m, ABN) for m in fused.modules())
    # conv outputs used only by the layer: folded into the conv (traced with torch.fx)
    for name in ("a0", "a2", "a4"):
        assert getattr(fused, name).scale is None, name
    assert fused.body[1].scale is None
    assert fused.a3.scale is not None  # c3's output has a second user
    assert not torch.equal(fused.stem.weight, model.stem.weight)
    assert torch.equal(fused.c3.weight, model.c3.weight)
    _close(fused(x.clone()), ref)
    # no conv folding: every layer a scale/shift FoldedABN
    plain = fuse_for_inference(model, fold_conv=False)
    assert all(m.scale is not None for m in plain.modules() if isinstance(m, FoldedABN))
    _close(plain(x.clone()), ref)
    ep = torch.export.export(fused, (x,))
    _assert_standard(_op_names(ep.graph))
    assert not any("batch_norm" in op for op in _op_names(ep.graph))


def test_fuse_resnet18():
    model = _randomise(resnet18_iabn(), seed=4).eval()
    x = torch.randn(2, 3, 32, 32)
    ref = model(x.clone())
    fused = fuse_for_inference(model)
    folded = [m for m in fused.modules() if isinstance(m, FoldedABN)]
    assert len(folded) == 20 and all(m.scale is None for m in folded)  # every layer went into its conv
    _close(fused(x.clone()), ref)


def test_fuse_untraceable_model_falls_back_to_sequential():
    class Dynamic(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Conv2d(3, 4, 1), InPlaceABN(4, activation="elu", activation_param=1.0))
            self.conv, self.abn = nn.Conv2d(4, 4, 1), InPlaceABN(4)

        def forward(self, x):
            h = self.seq(x)
            if h.sum() > 0:  # data-dependent: torch.fx cannot trace this
                h = h * 2
            return self.abn(self.conv(h))

    model = _randomise(Dynamic(), seed=5).eval()
    x = torch.randn(2, 3, 4, 4)
    ref = model(x.clone())
    fused = fuse_for_inference(model)
    assert fused.seq[1].scale is None  # folded: proven by the Sequential
    assert fused.abn.scale is not None  # not proven without a trace: scale/shift
    _close(fused(x.clone()), ref)


def test_fuse_rules():
    layer = _randomise(InPlaceABN(4, activation="silu"))
    with pytest.raises(ValueError, match="training mode"):
        fuse_for_inference(layer)
    folded = fuse_for_inference(layer.eval())
    assert isinstance(folded, FoldedABN)
    x = torch.randn(3, 4, 5)
    _close(folded(x), layer(x.clone()))
    # batch statistics in eval mode: nothing to fold, left as it is
    free = InPlaceABN(4, track_running_stats=False).eval()
    assert isinstance(fuse_for_inference(free), InPlaceABN)
    # inplace=True modifies the model itself
    model = nn.Sequential(nn.Conv2d(2, 4, 1), InPlaceABN(4)).eval()
    assert fuse_for_inference(model, inplace=True) is model and isinstance(model[1], FoldedABN)


# ---- ONNX --------------------------------------------------------------------------------


def _onnx_runtime():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    return onnx, ort


def _check_onnx(proto_bytes, x, ref, ort, onnx):
    proto = onnx.load_from_string(proto_bytes)
    domains = {n.domain for n in proto.graph.node}
    assert domains <= {"", "ai.onnx"}, domains  # standard operators only
    assert not any("inplace_abn" in n.op_type.lower() or "inplace_abn" in n.domain for n in proto.graph.node)
    sess = ort.InferenceSession(proto_bytes, providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    _close(torch.from_numpy(out), ref)


@pytest.mark.parametrize("fused", [False, True], ids=["layers", "fused"])
def test_onnx_dynamo_export_runs_in_onnxruntime(fused):
    onnx, ort = _onnx_runtime()
    pytest.importorskip("onnxscript")
    model = _model()
    x = torch.randn(2, 3, 7, 5)
    ref = model(x.clone())
    if fused:
        model = fuse_for_inference(model)
    program = torch.onnx.export(model, (x,), dynamo=True)
    _check_onnx(program.model_proto.SerializeToString(), x, ref, ort, onnx)


def test_onnx_legacy_export_runs_in_onnxruntime():
    """The TorchScript-based exporter (dynamo=False) goes through torch.jit.trace."""
    onnx, ort = _onnx_runtime()
    pytest.importorskip("onnxscript")  # torch.onnx may need it on either path
    model = _model()
    x = torch.randn(2, 3, 7, 5)
    ref = model(x.clone())
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings of the argument checks, deprecation notice
        torch.onnx.export(model, (x,), f, dynamo=False)
    _check_onnx(f.getvalue(), x, ref, ort, onnx)


def test_jit_trace_records_stock_operators():
    """torch.jit.trace: the traced graph holds no inplace_abn operator, gives the eager outputs in eval, and in
    training the eager outputs, gradients and running statistics (x not overwritten by the traced program)."""
    model = _model()
    x = torch.randn(2, 3, 7, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings of the argument checks
        traced = torch.jit.trace(model, x.clone())
    assert "inplace_abn::" not in str(traced.inlined_graph)  # (module types are named inplace_abn.abn...)
    assert rel_err(traced(x.clone()), model(x.clone())) < 1e-6

    train, eager = _model().train(), _model().train()
    train.a2 = InPlaceABN(6, activation="silu")  # the sync layer refuses to trace in training without a group
    eager.a2 = copy.deepcopy(train.a2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(copy.deepcopy(train), x.clone(), check_trace=False)
    with torch.no_grad():
        eager(x.clone())  # as tracing did: it ran the model once, in training
    xt, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yt, ye = traced(xt * 1), eager(xe * 1)
    g = torch.randn_like(ye)
    yt.backward(g)
    ye.backward(g)
    assert rel_err(yt, ye) < 1e-5 and rel_err(xt.grad, xe.grad) < 1e-4
    state, ref = traced.state_dict(), eager.state_dict()
    assert ref.keys() == state.keys()
    assert rel_err(state["body.1.running_var"], ref["body.1.running_var"]) < 1e-6
    assert int(state["a0.num_batches_tracked"]) == int(ref["a0.num_batches_tracked"]) == 2


@pytest.mark.parametrize("layer", ["ABN", "InPlaceABN", "InPlaceABNSync", "ABNSync", "AGN", "InPlaceAGN"])
def test_jit_script_refuses_with_a_clear_error(layer):
    """torch.jit.script (deprecated by PyTorch) cannot compile the layers: it raises naming the layer and the
    alternatives, before it changes the model (it replaces submodules by their __prepare_scriptable__ result)."""
    import inplace_abn
    from inplace_abn.sync import ABNSync
    make = {"ABN": lambda: ABN(4), "InPlaceABN": lambda: InPlaceABN(4), "InPlaceABNSync": lambda: InPlaceABNSync(4),
            "ABNSync": lambda: ABNSync(4), "AGN": lambda: inplace_abn.AGN(2, 4),
            "InPlaceAGN": lambda: inplace_abn.InPlaceAGN(2, 4)}[layer]
    norm = make()
    model = nn.Sequential(nn.Conv2d(3, 4, 1), norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notice
        with pytest.raises(RuntimeError, match=f"{layer} cannot be compiled by torch.jit.script.*torch.jit.trace"):
            torch.jit.script(model)
    assert model[1] is norm
