"""The C++ autograd path (``torch.ops.inplace_abn.inplace_abn_``, src/ops/autograd.cpp)
against the Python one (``_InPlaceABNFunction``): eager calls on the native backend take
the former, torch.compile and the synchronised layer the latter; both run the same
kernels, so every output, gradient and running statistic must agree bit for bit.
The accuracy against stock PyTorch is tested (through the C++ path) in test_accuracy.py.
"""
import pytest
import torch

import inplace_abn
from inplace_abn import InPlaceABN, functions, groupnorm
from cases import make_case

pytestmark = pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")


def _run(module, layer, case, fmt, residual, needs, python_path, monkeypatch):
    """(y, grads of the tensors named in ``needs``, the autograd node's name) of
    ``layer(x, w, b, r)``, through the C++ path or (``python_path``) the Python one."""
    with monkeypatch.context() as m:
        if python_path:
            m.setattr(module, "_native_autograd", lambda x, differentiable: False)
        x0 = case["x"].clone().contiguous(memory_format=fmt).requires_grad_("x" in needs)
        w = case["w"].clone().requires_grad_("w" in needs)
        b = case["b"].clone().requires_grad_("b" in needs)
        r = (case["residual"].clone().contiguous(memory_format=fmt).requires_grad_("r" in needs)
             if residual else None)
        y = layer(x0.clone(memory_format=torch.preserve_format), w, b, r)
        node = str(y.grad_fn.name())
        leaves = {"x": x0, "w": w, "b": b, "r": r}
        # dy reaches the layer as MulBackward's new tensor (ones * dy: dy's values), which nothing else holds:
        # the C++ path writes dx over it (dy_is_free, src/ops/autograd.cpp), the Python path into a new tensor
        (y * case["dy"].contiguous(memory_format=fmt)).sum().backward()
        return y.detach().clone(), {k: leaves[k].grad for k in needs}, node


@pytest.mark.filterwarnings("ignore:In-place ABN with relu is not invertible")
@pytest.mark.parametrize("activation,p", [("identity", 0.0), ("leaky_relu", 0.1), ("elu", 0.8), ("silu", 0.0),
                                          ("relu", 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("needs,residual,weight_mode", [
    ("xwb", False, "abs"), ("xwbr", True, "signed"), ("x", False, "abs"), ("wb", False, "abs"),
    ("r", True, "abs"), ("w", False, "signed")])
def test_cpp_path_matches_python_path(activation, p, dtype, fmt, training, needs, residual, weight_mode,
                                      monkeypatch):
    case = make_case((4, 6, 5, 7), dtype, seed=3)
    stats = {}

    def layer(x, w, b, r):  # fresh running statistics per path, kept for the comparison
        rm, rv = stats[len(stats)] = (case["rm"].clone(), case["rv"].clone())
        return functions.inplace_abn(x, w, b, rm, rv, training, 0.1, 1e-5, activation, p, residual=r,
                                     weight_mode=weight_mode)

    ours = _run(functions, layer, case, fmt, residual, needs, False, monkeypatch)
    ref = _run(functions, layer, case, fmt, residual, needs, True, monkeypatch)
    assert "InPlaceABNFunction" in ours[2] and "CppNode" in ours[2], ours[2]
    assert "CppNode" not in ref[2], ref[2]
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    for k in needs:
        assert ours[1][k] is not None and ref[1][k] is not None, k
        assert ours[1][k].dtype == ref[1][k].dtype, k
        torch.testing.assert_close(ours[1][k], ref[1][k], rtol=0, atol=0, msg=f"gradient of {k}")
    for a, b in zip(stats[0], stats[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bn_backward_bytes(fn):
    """Bytes that bn_backward's calls allocated while fn ran (the profiler's memory events; a dispatch mode would
    hold dy and so change what it observes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.key == "inplace_abn::bn_backward")


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", ["leaky_relu", "silu"])
def test_backward_writes_dx_into_dy_only_when_free(activation, fmt):
    """The C++ backward writes dx over dy only when nothing else holds dy (a downstream op's new gradient; a
    retained grad is a copy), never over a dy that the caller or another consumer of the same gradient (an add)
    still reads, and never through SiLU's channels-last z path (its kept z needs a tensor of its own); y's retained
    gradient, the other consumer's and x's are the same bits either way."""
    g = torch.Generator().manual_seed(0)
    layer = InPlaceABN(8, activation=activation)
    x0 = torch.randn(4, 8, 6, 6, generator=g).contiguous(memory_format=fmt)
    dy = torch.randn(x0.shape, generator=g).contiguous(memory_format=fmt)
    other = torch.randn(x0.shape, generator=g, requires_grad=True)
    free = fmt == torch.contiguous_format or activation != "silu"

    def run(how):
        x = x0.clone().requires_grad_()
        y = layer(x * 1)

        def backward():
            if how == "free":  # MulBackward's new tensor
                (y * dy).sum().backward()
            elif how == "caller":  # the caller's dy
                y.backward(dy)
            elif how == "retained":
                y.retain_grad()
                (y * dy).sum().backward()
            else:  # AddBackward passes one gradient to both inputs
                (y + other).backward(dy * 1)

        into_dy = _bn_backward_bytes(backward) < dy.numel() * dy.element_size()
        if how == "retained":
            assert torch.equal(y.grad, dy)
        if how == "shared":
            assert torch.equal(other.grad, dy)
            other.grad = None
        return x.grad, into_dy

    want, into_dy = run("caller")
    assert not into_dy
    for how in ("free", "retained", "shared"):
        got, into_dy = run(how)
        assert into_dy == (free and how != "shared"), how
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=how)


def test_cpp_path_refuses_double_backward():
    layer = InPlaceABN(4)
    x = torch.randn(3, 4, 5, requires_grad=True)
    y = layer(x * 1)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_cpp_path_empty_batch_and_count_one():
    layer = InPlaceABN(4)
    x = torch.randn(0, 4, 5, requires_grad=True)
    y = layer(x * 1)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.running_mean, torch.zeros(4))
    assert torch.equal(layer.weight.grad, torch.zeros(4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.randn(1, 4, requires_grad=True) * 1)


def test_cpp_path_version_counter():
    """mark_dirty in C++: x's version moves, and a tensor saved by another node before the
    in-place write is detected as modified."""
    x0 = torch.randn(4, 3, 5, requires_grad=True)
    h = x0 * 1
    z = h.sigmoid()  # saves its output, not h: unaffected
    s = h * h  # saves h
    v = h._version
    InPlaceABN(3)(h)
    assert h._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()
    z.sum().backward()


@pytest.mark.parametrize("activation,p", [("identity", 0.0), ("leaky_relu", 0.1), ("elu", 0.8), ("silu", 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,groups,fmt", [
    ((4, 6, 5, 7), 3, torch.contiguous_format), ((3, 8), 2, torch.contiguous_format),
    ((2, 4, 3, 5, 2), 4, torch.contiguous_format), ((4, 6, 5, 7), 3, torch.channels_last),
    ((3, 8, 4, 4), 4, torch.channels_last), ((2, 4, 2, 4, 2), 2, torch.channels_last_3d)], ids=str)
@pytest.mark.parametrize("needs,residual,weight_mode", [
    ("xwb", False, "abs"), ("xwbr", True, "signed"), ("x", False, "abs"), ("wb", False, "signed"), ("r", True, "abs")])
def test_groupnorm_cpp_path_matches_python_path(activation, p, dtype, shape, groups, fmt, needs, residual,
                                                weight_mode, monkeypatch):
    """inplace_agn_ (GroupNorm with its autograd in C++; channels-last one sample at a time)
    against _InPlaceAGNFunction, bit for bit."""
    case = make_case(shape, dtype, seed=5)

    def layer(x, w, b, r):
        return groupnorm.inplace_agn(x, groups, w, b, 1e-5, activation, p, residual=r, weight_mode=weight_mode)

    ours = _run(groupnorm, layer, case, fmt, residual, needs, False, monkeypatch)
    ref = _run(groupnorm, layer, case, fmt, residual, needs, True, monkeypatch)
    # channels-last SiLU needs whole mask words per sample for the native operators
    # (inplace_abn/_groupnorm_ops.py _native_ok); other shapes stay in Python
    native = not (fmt != torch.contiguous_format and activation == "silu" and (ours[0][0].numel() % 32))
    assert ("CppNode" in ours[2] and "InPlaceAGNFunction" in ours[2]) == native, ours[2]
    assert "CppNode" not in ref[2], ref[2]
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    for k in needs:
        assert ours[1][k] is not None and ours[1][k].dtype == ref[1][k].dtype, k
        torch.testing.assert_close(ours[1][k], ref[1][k], rtol=0, atol=0, msg=f"gradient of {k}")


def test_groupnorm_cpp_path_refuses_double_backward():
    x = torch.randn(2, 4, 3, requires_grad=True)
    y = groupnorm.inplace_agn(x * 1, 2, torch.ones(4, requires_grad=True), torch.zeros(4))
    with pytest.raises(RuntimeError, match="inplace_agn does not support double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


@pytest.mark.parametrize("weight,bias,stats", [(True, False, False), (False, True, False), (False, False, True)])
def test_cpp_path_with_absent_optional_tensors(weight, bias, stats, monkeypatch):
    """The C++ Function finds each input's gradient slot by counting the tensors present
    (absent optionals have no autograd edge): with weight, bias or the running statistics
    missing, the residual's and the parameters' gradients still match the Python path."""
    case = make_case((4, 6, 5), torch.float64, seed=7)
    needs = "x" + ("w" if weight else "") + ("b" if bias else "") + "r"

    def layer(x, w, b, r):
        rm, rv = (case["rm"].clone(), case["rv"].clone()) if stats else (None, None)
        return functions.inplace_abn(x, w if weight else None, b if bias else None, rm, rv, True, 0.1, 1e-5,
                                     "elu", 0.7, residual=r)

    ours = _run(functions, layer, case, torch.contiguous_format, True, needs, False, monkeypatch)
    ref = _run(functions, layer, case, torch.contiguous_format, True, needs, True, monkeypatch)
    assert "CppNode" in ours[2] and "CppNode" not in ref[2]
    for k in needs:
        assert ours[1][k] is not None, k
        torch.testing.assert_close(ours[1][k], ref[1][k], rtol=0, atol=0, msg=f"gradient of {k}")


def test_operators_refuse_inputs_that_require_grad():
    """The operators have no derivative (src/ops/autograd.cpp, NoGrad): the layers call them
    with grad mode off. A direct call that autograd would record (an input requiring grad, or
    a forward-mode tangent) raises instead of returning outputs whose gradients would silently
    be missing; under no_grad it runs and gives what the same call on detached inputs gives."""
    ops = torch.ops.inplace_abn
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    mean, var = ops.batch_stats(x)
    calls = {
        "batch_stats": lambda x, w: ops.batch_stats(x),
        "forward_": lambda x, w: ops.forward_(x.clone(), mean, var, w, None, None, 1e-5, 1, 0.1, False),
        "weight_grad": lambda x, w: ops.weight_grad(x[0, :, 0], w, False),
    }
    for name, call in calls.items():
        xg = x.clone().requires_grad_(name == "batch_stats")
        with pytest.raises(RuntimeError, match=f"inplace_abn::{name} has no derivative, and an input requires grad"):
            call(xg, w)
        with torch.no_grad():
            got = call(xg, w)
        want = call(x, w.detach())
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # forward AD: a tangent would be dropped as silently
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.clone(), torch.ones_like(x))
        with pytest.raises(RuntimeError, match="inplace_abn::batch_stats has no derivative.*forward-mode tangent"):
            ops.batch_stats(dual)
    # every operator but the two layers has this kernel (PyTorch's boxed fallback would
    # only warn, and only once a backward reaches the outputs)
    for name in ("batch_stats", "forward_", "bn_forward_", "forward", "bn_forward", "backward_reduce",
                 "backward_input", "backward_input_from_z_", "weight_grad", "gn_backward", "bn_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"inplace_abn::{name}", "Autograd"), name
