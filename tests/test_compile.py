"""torch.compile: compiled vs eager, outputs, gradients and running statistics.

InPlaceABN compiles with fullgraph=True in training and eval mode, for every
activation, with and without residual: the operators' fake kernels and the
mutation annotation of ``forward_`` (or, on the pure backend, the stock ops it
is written with) let Dynamo and AOTAutograd trace the autograd.Function, its
backward included. InPlaceABNSync in training is one graph break per layer
(``inplace_abn.functions._apply_synced``); in eval mode it compiles whole.

Compile time dominates: few, small graphs, mostly with ``aot_eager`` (Dynamo +
AOTAutograd, the parts that could break), one real inductor run.
"""
import copy
import os
import socket
import sys

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch._dynamo.utils import counters

import inplace_abn
from inplace_abn import InPlaceABN, InPlaceABNSync
from inplace_abn.memory import model_saved_bytes
from reference import rel_err

PARAM = {"identity": 0.0, "leaky_relu": 0.1, "elu": 0.8, "silu": 0.0}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class AllActivations(nn.Module):
    """conv -> InPlaceABN for every activation, each without and with residual (8 layers)."""

    def __init__(self, C=6):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        cfg = [(a, res) for a in PARAM for res in (False, True)]
        self.res = [res for _, res in cfg]
        self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1, bias=False) for _ in cfg)
        self.abns = nn.ModuleList(
            InPlaceABN(C, activation=a, activation_param=PARAM[a], weight_mode="signed" if i % 3 == 1 else "abs",
                       momentum=None if i == 2 else 0.1)
            for i, (a, _) in enumerate(cfg))
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        h = self.stem(x)
        for conv, abn, res in zip(self.convs, self.abns, self.res):
            h = abn(conv(h), residual=h) if res else abn(conv(h))
        return self.head(h)


def _randomise(model, seed=0):
    """Non-trivial affine parameters and running statistics."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, inplace_abn.ABN):
                continue
            if m.affine:
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5 + 1)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.2)
            if m.track_running_stats:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def _step(model, x, mode):
    """One step: "train" (forward + backward), "eval" (forward + backward through the
    eval-mode layer) or "infer" (eval under no_grad). Returns the output, x's grad
    and the parameter grads."""
    model.train(mode == "train")
    if mode == "infer":
        with torch.no_grad():
            return model(x.clone()), None, []
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), x.grad, grads


def _close(actual, expected, rtol):
    """Norm-wise relative error: robust for gradients of parameters summed over a batch.

    (Convolutions feeding a layer have no bias: its gradient is 0 up to rounding.)"""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = rel_err(actual, expected)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}"


def _assert_same(eager, compiled, x, modes=("train", "infer"), rtol=1e-5):
    for mode in modes:
        ye, gxe, ge = _step(eager, x, mode)
        yc, gxc, gc = _step(compiled, x, mode)
        _close(yc, ye, rtol)
        if mode != "infer":
            _close(gxc, gxe, rtol)
            for a, b in zip(gc, ge):
                _close(a, b, rtol)
    for a, b in zip(compiled.buffers(), eager.buffers()):
        if a.is_floating_point():
            _close(a, b, rtol)
        else:
            assert torch.equal(a, b)


def test_all_activations_fullgraph_train_and_eval(backend):
    torch.manual_seed(0)
    eager = _randomise(AllActivations())
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 3, 5, 6)
    # train, inference, train again: the inference graph sees the updated running stats
    _assert_same(eager, compiled, x, modes=("train", "infer", "train"))
    assert model.abns[2].num_batches_tracked.item() == 2


def test_inductor_train_step():
    """One real inductor run (kept small: codegen is slow): training forward + backward,
    leaky_relu without and with residual."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.a1 = InPlaceABN(8, activation="leaky_relu", activation_param=0.1)
            self.a2 = InPlaceABN(8, activation="leaky_relu", activation_param=0.01)

        def forward(self, x):
            h = self.a1(self.c1(x))
            return self.a2(self.c2(h), residual=h)

    torch.manual_seed(1)
    eager = _randomise(Net(), seed=1)
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
    x = torch.randn(4, 3, 6, 6)
    _assert_same(eager, compiled, x, modes=("train",), rtol=1e-4)
    # The memory saving survives compilation: the compiled graph saves no more activations
    # for backward (inductor may save re-laid-out copies of the conv weights: parameter-sized).
    param_bytes = sum(p.numel() * p.element_size() for p in eager.parameters())
    assert model_saved_bytes(compiled, x) <= model_saved_bytes(eager, x) + param_bytes


def test_dynamic_batch_and_channels_last():
    """A second batch size reuses the graph (dynamic shapes); channels-last inputs compile too."""
    torch.manual_seed(2)
    eager = _randomise(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), InPlaceABN(4, activation="elu",
                                                                                  activation_param=0.8),
                                      nn.Conv2d(4, 2, 1)), seed=2).to(memory_format=torch.channels_last)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, dynamic=True, backend=counting)
    seen = []
    for n in (2, 5):
        x = torch.randn(n, 3, 5, 5).contiguous(memory_format=torch.channels_last)
        _assert_same(eager, compiled, x, modes=("train",))
        seen.append(len(graphs))
    assert seen[0] >= 1 and seen[1] == seen[0]  # no recompilation for the new batch size
    # eval mode with gradients (frozen statistics, e.g. fine-tuning): its own backward
    _assert_same(eager, compiled, x, modes=("eval",))


# ---- ResNet-18 with InPlaceABN(leaky_relu) ----------------------------------------------


def resnet18_iabn(num_classes=10):
    """torchvision's ResNet-18 with every BN + ReLU pair replaced by InPlaceABN(leaky_relu).

    The stem and each block's first BN+ReLU become InPlaceABN(leaky_relu); a
    block's second BN, residual add and ReLU become one fused
    InPlaceABN(leaky_relu)(x, residual=identity); downsample BNs become
    InPlaceABN(identity).
    """
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.resnet import BasicBlock

    def iabn(bn, activation="leaky_relu"):
        return InPlaceABN(bn.num_features, activation=activation, activation_param=0.01)

    class Block(nn.Module):
        def __init__(self, b: BasicBlock):
            super().__init__()
            self.conv1, self.abn1, self.conv2, self.abn2 = b.conv1, iabn(b.bn1), b.conv2, iabn(b.bn2)
            self.downsample = None
            if b.downsample is not None:
                self.downsample = nn.Sequential(b.downsample[0], iabn(b.downsample[1], "identity"))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            return self.abn2(self.conv2(self.abn1(self.conv1(x))), residual=identity)

    net = torchvision.models.resnet18(num_classes=num_classes)
    net.bn1, net.relu = iabn(net.bn1), nn.Identity()
    for name in ("layer1", "layer2", "layer3", "layer4"):
        layer = getattr(net, name)
        for i, b in enumerate(layer):
            layer[i] = Block(b)
    return net


def test_resnet18_fullgraph_train_and_eval():
    torch.manual_seed(3)
    eager = _randomise(resnet18_iabn(), seed=3)
    assert sum(isinstance(m, InPlaceABN) for m in eager.modules()) == 20
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, backend="aot_eager")
    _assert_same(eager, compiled, torch.randn(2, 3, 32, 32), rtol=1e-4)


# ---- InPlaceABNSync under compile, 2 gloo ranks ------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _SyncNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.abn = InPlaceABNSync(4, activation="leaky_relu", activation_param=0.1)
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.conv2(self.abn(self.conv1(x)))


def _sync_worker(rank, world, port, outdir):
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        eager = _randomise(_SyncNet())
        model = copy.deepcopy(eager)
        graphs = []

        def counting(gm, example_inputs):
            graphs.append(gm)
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        # uneven batches across ranks
        x = torch.randn(2 + rank, 3, 5, 5, generator=torch.Generator().manual_seed(10 + rank))
        compiled = torch.compile(model, backend=counting)
        _assert_same(eager, compiled, x, modes=("train", "train"))
        convs = sum(n.target is torch.conv2d for g in graphs for n in g.graph.nodes)
        breaks = dict(counters["graph_break"])
        # eval: no collective, one whole graph
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        _assert_same(eager, compiled, x, modes=("eval", "infer"))
        torch.save({"compiled_convs": convs, "breaks": breaks}, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sync_compiled_matches_eager_two_ranks(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    mp.spawn(_sync_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        report = torch.load(tmp_path / f"rank{rank}.pt")
        # The synchronised layer is the only graph break (torch.compiler.disable around
        # the call with collectives); both convolutions, before and after it, are compiled.
        assert report["compiled_convs"] == 2, report
        assert report["breaks"] and all("InPlaceABNSync" in reason for reason in report["breaks"]), report


@pytest.mark.filterwarnings("ignore:In-place ABN with relu is not invertible")
@pytest.mark.parametrize("layer_kind,activation", [("abn", "leaky_relu"), ("abn", "relu"), ("abn", "silu"),
                                                   ("agn", "leaky_relu"), ("agn", "silu")])
def test_compiled_layer_on_a_graph_input_that_requires_grad(layer_kind, activation):
    """The layer compiled on its own, its input a graph input that requires grad (the output
    of an earlier, uncompiled part): the input gradient equals stock BatchNorm / GroupNorm +
    activation in float64. With the write into x, AOTAutograd returned a wrong input
    gradient here (relative error ~1); compiled layers now run out of place."""
    torch.manual_seed(0)
    x0 = torch.randn(4, 8, 5, 6, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 8, 5, 6, dtype=torch.float64)
    layer = (InPlaceABN(8, activation=activation, activation_param=0.1) if layer_kind == "abn" else
             inplace_abn.InPlaceAGN(2, 8, activation=activation, activation_param=0.1)).double()
    with torch.no_grad():
        layer.weight.copy_(torch.rand(8, dtype=torch.float64) + 0.5)
        layer.bias.copy_(torch.randn(8, dtype=torch.float64))
    compiled = torch.compile(layer, backend="aot_eager")
    got = torch.autograd.grad(compiled(x0 * 1.0), [x0, layer.weight, layer.bias], dy)  # x0 * 1: a graph input
    xr = x0.detach().clone().requires_grad_()
    w = layer.weight.detach().abs() + layer.eps
    wr, br = w.clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    z = (nn.functional.batch_norm(xr, None, None, wr, br, True, 0.1, layer.eps) if layer_kind == "abn" else
         nn.functional.group_norm(xr, 2, wr, br, layer.eps))
    f = {"leaky_relu": lambda t: nn.functional.leaky_relu(t, 0.1), "relu": torch.relu, "silu": nn.functional.silu}
    ref = torch.autograd.grad(f[activation](z), [xr, wr, br], dy)
    assert rel_err(got[0], ref[0]) < 1e-10, rel_err(got[0], ref[0])
    assert rel_err(got[1], ref[1]) < 1e-10 and rel_err(got[2], ref[2]) < 1e-10


@pytest.mark.filterwarnings("ignore:In-place ABN with relu is not invertible")
def test_inductor_hands_the_layers_its_own_layout():
    """Inductor lays its CPU convolutions out channels-last. A compiled layer calls the
    functional forward / bn_forward (InPlaceAGN: gn_stats, gn_forward), which take the
    convolution's output as it is and give y in its layout, and bn_backward (gn_backward)
    gets that y (and gives dx like it): no copy to the traced (contiguous) strides before each
    layer and back after its backward, as through the mutating forward_ / bn_forward_ into an
    empty_like(x) or, for operators without the flexible_layout tag, inductor's copies to the
    strides seen while tracing. Results as eager, every activation kind, with residuals,
    training, eval with a backward and inference."""

    class Net(nn.Module):
        CFG = [("leaky_relu", False), ("silu", True), ("relu", False), ("elu", True), ("identity", False)]

        def __init__(self, C=8):
            super().__init__()
            self.stem = nn.Conv2d(3, C, 3, padding=1, bias=False)
            self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1, bias=False) for _ in self.CFG)
            self.abns = nn.ModuleList(InPlaceABN(C, activation=a, activation_param=PARAM.get(a, 0.0))
                                      for a, _ in self.CFG)
            self.gn_conv = nn.Conv2d(C, C, 3, padding=1, bias=False)
            self.agn = inplace_abn.InPlaceAGN(2, C, activation="silu")
            self.head = nn.Conv2d(C, 2, 1)

        def forward(self, x):
            h = self.stem(x)
            for conv, abn, (_, res) in zip(self.convs, self.abns, self.CFG):
                h = abn(conv(h), residual=h) if res else abn(conv(h))
            return self.head(self.agn(self.gn_conv(h), residual=h))

    def layouts(prof, names=("inplace_abn::bn_forward", "inplace_abn::forward", "inplace_abn::bn_backward",
                             "inplace_abn::gn_stats", "inplace_abn::gn_forward", "inplace_abn::gn_backward",
                             "inplace_abn::bn_forward_", "inplace_abn::gn_forward_")):
        """{operator: [whether each call's first tensor (x, or y for the backwards) is channels-last]}, from the
        strides the profiler recorded (the compiled code calls the operators through the dispatcher). The last
        two are the mutating forwards that compiled layers called before (forward_ is left out: gn_forward's
        native kernel calls it on its new y)."""
        import json
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        seen = {}
        for e in events:
            if e.get("name") in names:
                dims, strides = e["args"]["Input Dims"][0], e["args"]["Input Strides"][0]
                seen.setdefault(e["name"], []).append(
                    inplace_abn._pure.is_channels_last(torch.empty_strided(dims, strides, device="meta")))
        return seen

    torch.manual_seed(3)
    eager = _randomise(Net(), seed=3)
    x = torch.randn(4, 3, 6, 6)
    # (no FX graph cache: its key leaves out the operators' layout tags, and a graph cached
    # before a change of them would be reused)
    with torch._inductor.config.patch(force_layout_optimization=True, force_disable_caches=True):
        compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
        _step(compiled, x, "train")  # (compiles the graphs first: the profiler then sees their calls alone)
        _step(compiled, x, "eval")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            _step(compiled, x, "train")
            _step(compiled, x, "eval")
        compiled._orig_mod.load_state_dict(eager.state_dict())  # (the steps above moved the running statistics)
        _assert_same(eager, compiled, x, modes=("train", "eval", "infer"), rtol=1e-4)
    n = len(Net.CFG)
    seen = layouts(prof)
    assert seen == {"inplace_abn::bn_forward": [True] * n, "inplace_abn::forward": [True] * n,
                    "inplace_abn::bn_backward": [True] * 2 * n, "inplace_abn::gn_stats": [True] * 2,
                    "inplace_abn::gn_forward": [True] * 2, "inplace_abn::gn_backward": [True] * 2}, seen
