"""use_backend is per thread (a contextvars.ContextVar): two threads that interleave their
blocks each see their own choice, and neither leaves it set for anyone after."""
import threading

import pytest
import torch

import inplace_abn
from inplace_abn import _backend, _pure
from reference import rel_err, stock


def _interleaved(first, second):
    """Thread A enters use_backend(first), then B enters use_backend(second), then A leaves,
    then B leaves (not nested: the order that left a process-wide choice stuck)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def thread(tag, choice, enter_after, entered, leave_after, left):
        try:
            enter_after.wait(10)
            with inplace_abn.use_backend(choice):
                entered.set()
                leave_after.wait(10)
                seen[tag + "_inside"] = _backend.current()
                seen[tag + "_ops"] = _backend.ops_for(torch.zeros(1))
            seen[tag + "_after"] = _backend.current()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            entered.set(), left.set()

    start = threading.Event()
    start.set()
    a = lambda: thread("a", first, start, a_in, b_in, a_out)  # noqa: E731
    b = lambda: thread("b", second, a_in, b_in, a_out, threading.Event())  # noqa: E731
    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    return seen


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="needs both backends")
def test_use_backend_is_per_thread():
    default = _backend.current()
    seen = _interleaved("python", "native")
    assert seen["a_inside"] == "python" and seen["a_ops"] is _pure
    assert seen["b_inside"] == "native" and seen["b_ops"] is _backend.NATIVE
    assert seen["a_after"] == default and seen["b_after"] == default
    assert _backend.current() == default  # nothing left behind in this thread either


def test_choice_holds_through_backward_and_other_threads_keep_the_default():
    """A thread that never called use_backend gets the environment's default; the block's
    choice reaches the layer's backward; the results match stock float64 BatchNorm."""
    default = _backend.current()
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("choice", _backend.current()))
    with inplace_abn.use_backend("python"):
        t.start()
        t.join(10)
        torch.manual_seed(0)
        x0 = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
        layer = inplace_abn.InPlaceABN(3, activation="elu", activation_param=0.5).double()
        calls = []
        orig = _pure.backward_reduce

        def spy(*a, **k):
            calls.append(_backend.current())
            return orig(*a, **k)

        _pure.backward_reduce = spy
        try:
            y = layer(x0.clone())
            dy = torch.randn_like(y)
            dx, = torch.autograd.grad(y, x0, dy)
        finally:
            _pure.backward_reduce = orig
    assert other["choice"] == default
    assert calls == ["python"]
    xr = x0.detach().clone().requires_grad_()
    yr = stock(xr, layer.weight, layer.bias, None, None, True, activation="elu", activation_param=0.5)
    assert rel_err(y, yr) < 1e-12
    assert rel_err(dx, torch.autograd.grad(yr, xr, dy)[0]) < 1e-12


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="needs the native extension to differ from the pure one")
def test_backward_uses_the_backend_of_its_forward(monkeypatch):
    """A forward run under use_backend("python") runs its backward on the pure operators
    too, even when the backward starts outside the block (or in another thread)."""
    calls = []
    real = _pure.backward_reduce
    monkeypatch.setattr(_pure, "backward_reduce", lambda *a: calls.append(1) or real(*a))
    layer = inplace_abn.InPlaceABN(4, activation="leaky_relu", activation_param=0.1).double()
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    with inplace_abn.use_backend("python"):
        y = layer(x.clone())
    y.sum().backward()
    assert calls == [1]
    calls.clear()
    y = layer(x.clone())  # default (native) forward: native backward
    y.sum().backward()
    assert calls == []
