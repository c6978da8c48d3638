"""torch.library.opcheck for every native operator: schema (including the
mutation annotation of forward_), fake kernels, and AOT dispatch, in
training and eval signatures, for every activation and both layouts."""
import os
import platform
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import inplace_abn
from inplace_abn import _activation, _pure

pytestmark = pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")


def _args(act, fmt, residual, dtype=torch.float32, training=True, shape=(3, 5, 4, 6)):
    g = torch.Generator().manual_seed(act)
    x = torch.randn(shape, generator=g, dtype=dtype).contiguous(memory_format=fmt)
    C = shape[1]
    w = torch.rand(C, generator=g) + 0.5
    b = torch.randn(C, generator=g)
    r = torch.randn(shape, generator=g, dtype=dtype).contiguous(memory_format=fmt) if residual else None
    mean, var = torch.ops.inplace_abn.batch_stats(x)
    if not training:
        mean, var = torch.randn(C, generator=g) * 0.1, torch.rand(C, generator=g) + 0.5
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 1.0}.get(act, 0.0)
    return x, mean, var, w, b, r, p


class OpCalls(TorchDispatchMode):
    """The operator calls that reach the dispatcher below autograd: (name, args, kwargs)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def names(self):
        return [name for name, _, _ in self.calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.name(), args, kwargs or {}))
        return func(*args, **(kwargs or {}))


ACTS = [_activation.IDENTITY, _activation.LEAKY_RELU, _activation.ELU, _activation.SILU]
FORMATS = [torch.contiguous_format, torch.channels_last]


def _fused_forward(x, act):
    """Whether bn_forward_ runs its one-pass CPU kernel (src/ops/bn_forward.cpp, bn_forward_fits): a contiguous x
    whose planes hold at least 32 elements (SiLU: a multiple of 32) and whose channels at most 2^16."""
    N, C = x.shape[:2]
    P = x.numel() // (N * C)
    return (x.is_contiguous() and x.dim() >= 3 and P >= 32 and N * P <= 1 << 16
            and (act != _activation.SILU or P % 32 == 0))


# contiguous, planes of 64 / 42 (SiLU: two operators) / 4096 / 16 (batch_stats walks rows: two operators), channels
# of 2^16 (the largest fused) and beyond, channels-last
FORWARD_CASES = [((4, 6, 8, 8), torch.contiguous_format), ((3, 5, 6, 7), torch.contiguous_format),
                 ((8, 3, 64, 64), torch.contiguous_format), ((16, 2, 64, 64), torch.contiguous_format),
                 ((17, 2, 64, 64), torch.contiguous_format), ((8, 16, 4, 4), torch.contiguous_format),
                 ((4, 6, 8, 8), torch.channels_last)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,fmt", FORWARD_CASES,
                         ids=["p64", "p42", "p4096", "largest", "beyond", "rows", "channels_last"])
@pytest.mark.parametrize("act", ACTS + ["relu"])
def test_bn_forward_is_the_separate_operators(act, shape, fmt, dtype):
    """bn_forward_ (the local layer's training forward in one call) gives batch_stats' statistics and running
    statistics and forward_'s y, z (ReLU) and SiLU mask to the bit, in place and out of place (source), with a
    residual, whichever path serves x; the profiler range says which did."""
    ops = torch.ops.inplace_abn
    relu = act == "relu"
    act = _activation.IDENTITY if relu else act
    g = torch.Generator().manual_seed(act + 7 * len(shape))
    x = (torch.randn(shape, generator=g) * 3 + 2).to(dtype).contiguous(memory_format=fmt)
    C = shape[1]
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
    r = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt)
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 0.8}.get(act, 0.0)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    running = (torch.randn(C, generator=g), torch.rand(C, generator=g) + 0.5)
    fused = _fused_forward(x, act)
    for out_of_place in (False, True):
        def fresh():
            xin = x.clone(memory_format=torch.preserve_format)
            out = torch.empty_like(xin) if out_of_place else xin
            z = torch.empty_like(xin, dtype=acc) if relu else None
            return xin, out, z, [t.clone() for t in running]

        x1, y1, z1, (rm1, rv1) = fresh()
        mean1, var1 = ops.batch_stats(x1, rm1, rv1, 0.1)
        mask1 = ops.forward_(y1, mean1, var1, w, b, r, 1e-5, act, p, False, z1, 0, x1 if out_of_place else None)
        x2, y2, z2, (rm2, rv2) = fresh()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            mask2, mean2, var2 = ops.bn_forward_(y2, w, b, rm2, rv2, r, 0.1, 1e-5, act, p, False, z2,
                                                 x2 if out_of_place else None)
        ranges = {e.name for e in prof.events() if e.name.startswith("inplace_abn::bn_forward_ (")}
        assert (ranges == {"inplace_abn::bn_forward_ (one pass)"}) == fused, ranges
        for name, a, b_ in (("y", y1, y2), ("mean", mean1, mean2), ("var", var1, var2), ("mask", mask1, mask2),
                            ("running_mean", rm1, rm2), ("running_var", rv1, rv2), ("x", x1, x2), ("z", z1, z2)):
            assert (a is None and b_ is None) or torch.equal(a, b_), name
    if dtype == torch.float32 and fmt == torch.contiguous_format and shape == (4, 6, 8, 8):
        z = torch.empty_like(x, dtype=acc) if relu else None
        torch.library.opcheck(ops.bn_forward_.default,
                              (x.clone(), w, b, *[t.clone() for t in running], r, 0.1, 1e-5, act, p, False, z))


def _in_layout(t, layout):
    """t in one of the layouts the functional forwards meet: contiguous, channels-last, or strided (every other
    element of a wider tensor, which the kernels cannot walk)."""
    if layout == "strided":
        return t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])[..., ::2].copy_(t)
    return t.contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("act", ACTS + ["relu"])
def test_functional_forwards_are_the_mutating_ones(act, layout):
    """forward and bn_forward (the compiled layer's operators) give forward_'s / bn_forward_'s y, z (ReLU), mask and
    statistics to the bit, leave x as it was, and return y (and z) in x's layout, or contiguous where the kernels
    cannot walk x's (strided); with a residual in another layout; opcheck on both, in each layout."""
    ops = torch.ops.inplace_abn
    relu = act == "relu"
    act = _activation.IDENTITY if relu else act
    g = torch.Generator().manual_seed(act + 11)
    shape = (4, 6, 8, 8)
    x = _in_layout(torch.randn(shape, generator=g) * 3 + 2, layout)
    r = torch.randn(shape, generator=g)  # contiguous whatever x's layout
    C = shape[1]
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 0.8}.get(act, 0.0)
    x0 = x.clone()
    walk = x if layout != "strided" else x.contiguous()  # what the mutating operators are given
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format

    def mutating(fn, *args):
        y = torch.empty_like(walk)
        z = torch.empty_like(walk) if relu else None
        return y, z, fn(y, *args, z, walk)

    y1, z1, (mask1, mean1, var1) = mutating(lambda y, z, src: ops.bn_forward_(
        y, w, b, None, None, r, 0.0, 1e-5, act, p, False, z, src))
    y2, z2, mask2, mean2, var2 = ops.bn_forward(x, w, b, r, 1e-5, act, p, False, relu)
    stats = torch.randn(C, generator=g) * 0.1, torch.rand(C, generator=g) + 0.5
    y3, z3, mask3 = mutating(lambda y, z, src: ops.forward_(y, *stats, w, b, r, 1e-5, act, p, False, z, 0, src))
    y4, z4, mask4 = ops.forward(x, *stats, w, b, r, 1e-5, act, p, False, relu)
    for name, a, b_ in (("y", y1, y2), ("mask", mask1, mask2), ("mean", mean1, mean2), ("var", var1, var2),
                        ("eval y", y3, y4), ("eval mask", mask3, mask4)):
        assert torch.equal(a, b_), name
    for z, z_ in ((z1, z2), (z3, z4)):
        assert torch.equal(z, z_) if relu else z_.numel() == 0
    for t in (y2, y4) + ((z2, z4) if relu else ()):
        assert t.is_contiguous(memory_format=fmt) and t.stride() == walk.stride()
    assert torch.equal(x, x0)
    torch.library.opcheck(ops.bn_forward.default, (x, w, b, r, 1e-5, act, p, False, relu))
    torch.library.opcheck(ops.forward.default, (x, *stats, w, b, r, 1e-5, act, p, False, relu))


def test_functional_forwards_refuse_keep_z_without_identity():
    x, w, b = torch.randn(4, 6, 8, 8), torch.ones(6), torch.zeros(6)
    with pytest.raises(RuntimeError, match="keep_z is the ReLU path and needs activation 0"):
        torch.ops.inplace_abn.bn_forward(x, w, b, None, 1e-5, _activation.LEAKY_RELU, 0.1, False, True)
    with pytest.raises(RuntimeError, match="keep_z is the ReLU path and needs activation 0"):
        torch.ops.inplace_abn.forward(x, torch.zeros(6), torch.ones(6), w, b, None, 1e-5, _activation.SILU, 0.0,
                                      False, True)


def test_bn_forward_refuses_what_batch_stats_and_forward_refuse():
    """bn_forward_'s one-pass path checks what the two operators check, with their messages."""
    ops = torch.ops.inplace_abn
    x = torch.randn(4, 6, 8, 8)
    w, b, rm, rv = torch.ones(6), torch.zeros(6), torch.zeros(6), torch.ones(6)
    assert _fused_forward(x, _activation.LEAKY_RELU)
    with pytest.raises(RuntimeError, match=r"weight must have shape \(6,\)"):
        ops.bn_forward_(x, w[:5], b, rm, rv, None, 0.1, 1e-5, _activation.LEAKY_RELU, 0.1, False)
    with pytest.raises(RuntimeError, match=r"running_var must have shape \(6,\)"):
        ops.bn_forward_(x, w, b, rm, rv[:5], None, 0.1, 1e-5, _activation.LEAKY_RELU, 0.1, False)
    with pytest.raises(RuntimeError, match="residual must have the input's shape"):
        ops.bn_forward_(x, w, b, rm, rv, x[:2], 0.1, 1e-5, _activation.LEAKY_RELU, 0.1, False)
    with pytest.raises(RuntimeError, match="z_out is the ReLU path"):
        ops.bn_forward_(x, w, b, rm, rv, None, 0.1, 1e-5, _activation.LEAKY_RELU, 0.1, False, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="source must have x's shape"):
        ops.bn_forward_(x, w, b, rm, rv, None, 0.1, 1e-5, _activation.LEAKY_RELU, 0.1, False, None, x[:2])
    with pytest.raises(RuntimeError, match="must be float32, float64"):
        ops.bn_forward_(x.int(), w, b, rm, rv, None, 0.1, 1e-5, _activation.LEAKY_RELU, 0.1, False)
    with pytest.raises(RuntimeError, match="more than 1 value per channel"):
        ops.bn_forward_(torch.randn(1, 6, 1), w, b, rm, rv, None, 0.1, 1e-5, _activation.LEAKY_RELU, 0.1, False)
    assert torch.equal(rm, torch.zeros(6)) and torch.equal(rv, torch.ones(6))  # nothing moved by a refused call


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", ACTS)
def test_opcheck_all_operators(act, fmt, training, residual):
    opcheck_operators(_args(act, fmt, residual, training=training), act, training, residual)


def opcheck_operators(args, act, training, residual):
    """opcheck of batch_stats, forward_, bn_forward_ (training), backward_reduce and backward_input
    on _args' tensors (on the CPU here, on CUDA in test_cuda.py); returns y, dy and the mask."""
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, p = args
    torch.library.opcheck(ops.batch_stats.default, (x,))
    if training:
        C = x.shape[1]
        running = (torch.zeros(C, device=x.device), torch.ones(C, device=x.device))
        torch.library.opcheck(ops.bn_forward_.default, (x.clone(), w, b, *running, r, 0.1, 1e-5, act, p, False))
    torch.library.opcheck(ops.forward_.default, (x.clone(), mean, var, w, b, r, 1e-5, act, p, True))
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, p, False)
    dy = torch.randn_like(y)
    torch.library.opcheck(ops.backward_reduce.default, (y, dy, mask, w, b, r, 1e-5, act, p, False))
    s_g, s_gx = ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, False)
    n = x.numel() // x.shape[1]
    mg, mgx = (s_g / n, s_gx / n) if training else (torch.zeros_like(s_g), torch.zeros_like(s_gx))
    torch.library.opcheck(ops.backward_input.default,
                          (y, dy, mask, var, w, b, r, mg, mgx, 1e-5, act, p, False, residual))
    return y, dy, mask


def _separate_backward(y, dy, mask, var, w, b, r, act, p, signed, training, need, relu=False):
    """bn_backward's four outputs from the operators it fuses, called as the layer's
    backward called them before it (the z path for SiLU on the CPU, docs/DESIGN.md 7.2)."""
    ops = torch.ops.inplace_abn
    need_x, need_w, need_b, need_r = need
    reduce = need_w or need_b or (training and (need_x or need_r))
    keep_z = reduce and need_x and act == _activation.SILU and y.dtype in (torch.float32, torch.float64)
    z = torch.empty_like(y) if keep_z else None
    s_g = s_gx = None
    if reduce:
        s_g, s_gx = ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, signed, z, 0, relu)
    n = y.numel() // y.shape[1]
    scale = 1.0 / n if training else 0.0
    g1, g2 = (s_g, s_gx) if training else (var, var)
    dx = dr = None
    if need_x or need_r:
        if keep_z:
            dx, dr = z, ops.backward_input_from_z_(z, y, dy, var, w, b, r, g1, g2, 1e-5, act, p, signed, need_r, scale)
        else:
            dx, dr = ops.backward_input(y, dy, mask, var, w, b, r, g1, g2, 1e-5, act, p, signed, need_r, scale, 0,
                                        relu)
    dw = (s_gx.to(w.dtype) if signed else ops.weight_grad(s_gx, w, False)) if need_w else None
    db = s_g.to(b.dtype) if need_b else None
    return [t if k else None for t, k in zip((dx, dw, db, dr), need)]


def _one_pass(y, training, need):
    """Whether bn_backward runs its one-pass CPU kernel (src/ops/bn_backward.cpp, bn_backward_fits):
    both passes wanted, a contiguous y with planes of at least 16 elements and at most 2^16 per channel."""
    need_x, need_w, need_b, need_r = need
    reduce = need_w or need_b or (training and (need_x or need_r))
    N, C = y.shape[:2]
    P = y.numel() // (N * C)
    return reduce and (need_x or need_r) and y.is_contiguous() and y.dim() >= 3 and P >= 16 and N * P <= 1 << 16


def _assert_matches(got, want, one_pass, name):
    """bn_backward's output against the separate operators': bitwise where it runs them (the two-pass path), within
    a few ulp where the one-pass kernel serves y (its sums in another order, its input row from the sums in double)."""
    assert got.dtype == want.dtype and got.stride() == want.stride(), name
    if not one_pass:
        assert torch.equal(got, want), name
        return
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=8 * eps * want.abs().max().item(), msg=name)


NEEDS = [(True, True, True, True), (True, False, False, False), (False, True, True, False),
         (False, False, False, True), (True, True, False, False)]


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("need", NEEDS, ids=["all", "dx", "params", "dres", "dx_dw"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fmt,shape", [(torch.contiguous_format, (3, 5, 4, 6)), (torch.channels_last, (3, 5, 4, 6)),
                                        (torch.contiguous_format, (3, 5, 2, 3))],
                         ids=["contiguous", "channels_last", "contiguous_small_planes"])
@pytest.mark.parametrize("act", ACTS)
def test_bn_backward_is_the_separate_operators(act, fmt, shape, training, need, signed):
    """bn_backward (the local layer's backward in one call) gives what the separate
    operators give, for each set of wanted outputs (the others: empty tensors):
    bitwise where it runs them (channels-last, planes under 16 elements, one pass
    only), within a few ulp where its one-pass kernel serves y; and passes opcheck."""
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, p = _args(act, fmt, True, training=training, shape=shape)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, p, signed)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).contiguous(memory_format=fmt)
    args = (y, dy, mask, var, w, b, r, 1e-5, act, p, signed, training, list(need))
    got = ops.bn_backward(*args)
    want = _separate_backward(y, dy, mask, var, w, b, r, act, p, signed, training, need)
    one_pass = _one_pass(y, training, need)
    assert one_pass == (fmt == torch.contiguous_format and shape[2] * shape[3] >= 16 and (need[0] or need[3])
                        and (training or need[1] or need[2]))
    for name, g, wt in zip(("dx", "dweight", "dbias", "dresidual"), got, want):
        if wt is None:
            assert g.numel() == 0, name
        else:
            _assert_matches(g, wt, one_pass, name)
    torch.library.opcheck(ops.bn_backward.default, args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 5, 4, 6), (3, 5, 2, 3)], ids=["one_pass", "two_pass"])
def test_bn_backward_relu_and_dtypes(dtype, shape):
    """The ReLU flag (y holds z in the accumulation dtype, derivative applied as dy is
    read) and the reduced-precision and float64 inputs: the separate operators' results
    (bitwise on the two-pass path, within a few ulp on the one-pass kernel)."""
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, p = _args(_activation.IDENTITY, torch.contiguous_format, True, dtype=dtype, shape=shape)
    one_pass = _one_pass(x, True, (True,) * 4)
    assert one_pass == (shape[2] * shape[3] >= 16)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    z = torch.empty_like(x, dtype=acc)
    mask = ops.forward_(x.clone(), mean, var, w, b, r, 1e-5, 0, 0.0, False, z)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    need = (True, True, True, True)
    got = ops.bn_backward(z, dy, mask, var, w, b, r, 1e-5, 0, 0.0, False, True, list(need), True)
    want = _separate_backward(z, dy, mask, var, w, b, r, 0, 0.0, False, True, need, relu=True)
    for name, g, wt in zip(("dx", "dweight", "dbias", "dresidual"), got, want):
        _assert_matches(g, wt, one_pass, name)
    # and plain (non-ReLU) reduced-precision y, SiLU: no z path there
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, _activation.SILU, 0.0, False)
    got = ops.bn_backward(y, dy, mask, var, w, b, r, 1e-5, _activation.SILU, 0.0, False, True, list(need))
    want = _separate_backward(y, dy, mask, var, w, b, r, _activation.SILU, 0.0, False, True, need)
    for name, g, wt in zip(("dx", "dweight", "dbias", "dresidual"), got, want):
        _assert_matches(g, wt, one_pass, name)


@pytest.mark.parametrize("fmt,shape", [(torch.contiguous_format, (3, 5, 4, 6)), (torch.channels_last, (3, 5, 4, 6)),
                                        (torch.contiguous_format, (3, 5, 2, 3))],
                         ids=["one_pass", "channels_last", "two_pass"])
@pytest.mark.parametrize("act", ACTS)
def test_bn_backward_dx_out_may_be_dy(act, fmt, shape):
    """dx_out = dy (the C++ layer's backward where nothing else holds dy): dy ends up holding the dx that bn_backward
    returns without dx_out, bit for bit, on the one-pass path, the two-pass path and SiLU's z path (through its own
    z and a copy); the dx output is then empty, the other gradients unchanged."""
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, p = _args(act, fmt, True, shape=shape)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, p, False)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).contiguous(memory_format=fmt)
    args = (y, dy, mask, var, w, b, r, 1e-5, act, p, False, True, [True, True, True, True])
    want = ops.bn_backward(*args)
    inout = dy.clone(memory_format=torch.preserve_format)
    got = ops.bn_backward(y, inout, *args[2:], False, inout)
    assert got[0].numel() == 0
    torch.testing.assert_close(inout, want[0], rtol=0, atol=0)
    for g, wt in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, wt, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="dx_out must have y's shape, strides"):
        ops.bn_backward(*args, False, y.new_empty(y.shape[::-1]))


def test_bn_backward_refuses_what_it_lacks():
    """An output asked for without its input, a var of the wrong length, a non-invertible
    slope: refused with a message that names it, before anything is computed."""
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, p = _args(_activation.LEAKY_RELU, torch.contiguous_format, False)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, None, 1e-5, _activation.LEAKY_RELU, 0.1, False)
    dy = torch.randn_like(y)
    base = (y, dy, mask, var, w, b, None, 1e-5, _activation.LEAKY_RELU, 0.1, False, True)
    with pytest.raises(RuntimeError, match="dweight without a weight"):
        ops.bn_backward(y, dy, mask, var, None, b, None, 1e-5, _activation.LEAKY_RELU, 0.1, False, True,
                        [True, True, False, False])
    with pytest.raises(RuntimeError, match="dbias without a bias"):
        ops.bn_backward(y, dy, mask, var, w, None, None, 1e-5, _activation.LEAKY_RELU, 0.1, False, True,
                        [True, False, True, False])
    with pytest.raises(RuntimeError, match="dresidual without a residual"):
        ops.bn_backward(*base, [False, False, False, True])
    with pytest.raises(RuntimeError, match=r"var must have shape \(5,\)"):
        ops.bn_backward(y, dy, mask, var[:4], w, b, None, 1e-5, _activation.LEAKY_RELU, 0.1, False, True,
                        [True, True, True, False])
    with pytest.raises(RuntimeError, match="slope > 0"):
        ops.bn_backward(y, dy, mask, var, w, b, None, 1e-5, _activation.LEAKY_RELU, 0.0, False, True,
                        [True, True, True, False])
    with pytest.raises(RuntimeError, match="dy must have the input's shape"):
        ops.bn_backward(y, dy[:2], mask, var, w, b, None, 1e-5, _activation.LEAKY_RELU, 0.1, False, True,
                        [True, True, True, False])


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", ACTS)
def test_opcheck_composite_layer(act, fmt, training):
    """inplace_abn_ (the layer with its autograd in C++, docs/DESIGN.md section 7.3): schema
    (mutation of x, the running statistics and num_batches_tracked), autograd registration
    and fake tensors.
    Not AOT dispatch: torch.compile traces the Python autograd Function instead, and the
    C++ Function reads concrete sizes."""
    x, _, _, w, b, r, p = _args(act, fmt, True, training=training)
    w, b, r = w.requires_grad_(), b.requires_grad_(), r.requires_grad_()
    C = x.shape[1]
    args = (x.clone(), w, b, torch.zeros(C), torch.ones(C), r, training, 0.1, 1e-5, act, p, False, False,
            torch.zeros((), dtype=torch.long))
    for util in ("test_schema", "test_autograd_registration", "test_faketensor"):
        torch.library.opcheck(torch.ops.inplace_abn.inplace_abn_.default, args, test_utils=util)
        # out of place (preserve_input): x is not mutated, the running statistics are
        torch.library.opcheck(torch.ops.inplace_abn.inplace_abn.default, args, test_utils=util)


@pytest.mark.parametrize("act", ACTS)
def test_opcheck_composite_groupnorm_layer(act):
    """inplace_agn_ (the contiguous GroupNorm layer with its autograd in C++), as above."""
    x, _, _, w, b, r, p = _args(act, torch.contiguous_format, True)
    args = (x.clone(), w.requires_grad_(), b.requires_grad_(), r.requires_grad_(), 5, 1e-5, act, p, False)
    for util in ("test_schema", "test_autograd_registration", "test_faketensor"):
        torch.library.opcheck(torch.ops.inplace_abn.inplace_agn_.default, args, test_utils=util)
        torch.library.opcheck(torch.ops.inplace_abn.inplace_agn.default, args, test_utils=util)


def test_opcheck_optional_affine_and_half():
    ops = torch.ops.inplace_abn
    x, mean, var, _, _, _, _ = _args(_activation.SILU, torch.contiguous_format, False, dtype=torch.bfloat16)
    torch.library.opcheck(ops.batch_stats.default, (x,))
    torch.library.opcheck(ops.forward_.default, (x.clone(), mean, var, None, None, None, 1e-5, 3, 0.0, False))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck_silu_backward_from_z(dtype, fmt, residual):
    """backward_reduce keeping z, and backward_input_from_z_ writing dx over it:
    schemas (z_out and z mutated), fakes, and the same dx and dresidual as
    backward_input to within the difference of f'(z) from z or from the
    inversion's last Halley step (a few ulp)."""
    ops, act = torch.ops.inplace_abn, _activation.SILU
    x, mean, var, w, b, r, p = _args(act, fmt, residual, dtype=dtype)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, p, True)
    dy = torch.randn_like(y)
    z = torch.empty_like(y)
    torch.library.opcheck(ops.backward_reduce.default, (y, dy, mask, w, b, r, 1e-5, act, p, True, z))
    s_g, s_gx = ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, True, z)
    for got, want in zip((s_g, s_gx), ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, True)):
        assert torch.equal(got, want)  # keeping z changes nothing in the sums
    n = x.numel() // x.shape[1]
    args = (y, dy, var, w, b, r, (s_g / n).to(var.dtype), (s_gx / n).to(var.dtype), 1e-5, act, p, True, residual)
    torch.library.opcheck(ops.backward_input_from_z_.default, (z.clone(),) + args)
    dx_ref, dr_ref = ops.backward_input(y, dy, mask, var, w, b, r, *args[6:])
    dr = ops.backward_input_from_z_(z, *args)
    tol = 8 * torch.finfo(dtype).eps
    torch.testing.assert_close(z, dx_ref, rtol=0, atol=tol * dx_ref.abs().max().item())
    assert z.stride() == y.stride()
    if residual:
        torch.testing.assert_close(dr, dr_ref, rtol=0, atol=tol * dr_ref.abs().max().item())


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_opcheck_half_precision_silu_backward_from_z(dtype, fmt, residual):
    """The same operators for a 16-bit y, as the synchronised layer runs them: backward_reduce
    keeps the inverse in a float32 z_out (the sums bitwise those without it), and
    backward_input_from_z_ reads it and writes dx into dx_out (y's dtype), leaving z as it
    was; dx and dresidual within one half-precision rounding of the inverting backward_input's
    (docs/DESIGN.md section 7.2). Schemas and fakes by opcheck, dx_out mutated."""
    ops, act = torch.ops.inplace_abn, _activation.SILU
    x, mean, var, w, b, r, p = _args(act, fmt, residual, dtype=dtype)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, p, True)
    dy = torch.randn_like(y)
    z = torch.empty_like(y, dtype=torch.float32)
    torch.library.opcheck(ops.backward_reduce.default, (y, dy, mask, w, b, r, 1e-5, act, p, True, z))
    s_g, s_gx = ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, True, z)
    for got, want in zip((s_g, s_gx), ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, True)):
        assert torch.equal(got, want)
    n = x.numel() // x.shape[1]
    args = (y, dy, var, w, b, r, s_g / n, s_gx / n, 1e-5, act, p, True, residual)
    torch.library.opcheck(ops.backward_input_from_z_.default, (z.clone(),) + args,
                          {"dx_out": torch.empty_like(y)})
    dx_ref, dr_ref = ops.backward_input(y, dy, mask, var, w, b, r, *args[6:])
    kept, dx = z.clone(), torch.empty_like(y)
    dr = ops.backward_input_from_z_(z, *args, dx_out=dx)
    assert torch.equal(z, kept)  # read only
    _assert_within_one_rounding(dx, dx_ref, dr if residual else None, dr_ref, y)
    other = torch.empty_like(y)  # and dx comes from z, not from inverting y again
    ops.backward_input_from_z_(torch.full_like(z, 2.0), *args, dx_out=other)
    assert not torch.equal(other, dx)


@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_silu_backward_from_z_across_the_range(dtype, fmt):
    """What backward_reduce keeps for backward_input_from_z_ (docs/DESIGN.md section 7.2) over
    the whole range of z: the left tail down to the clamp at -87 and the right branch above
    y = 8, which the AVX2/AVX512 float32 kernels keep coded (-z, z / 1024) rather than as
    h = z / y, z* and +-0: dx as backward_input's to a few ulp, and bitwise where the fit
    applies on those kernels (both passes then take z and f'(z) from the same h)."""
    ops, act = torch.ops.inplace_abn, _activation.SILU
    z_star = -1.2784645427610738
    values = torch.cat([torch.linspace(-95.0, -3.0, 101), torch.linspace(-3.0, 0.0, 97),
                        torch.tensor([z_star, 0.0, -0.0]), torch.linspace(0.0, 8.0, 61),
                        torch.linspace(8.0, 40.0, 53), torch.tensor([60.0, 100.0])])
    shape = (2, 4, 8, 8)
    n = shape[0] * shape[2] * shape[3]
    g = torch.Generator().manual_seed(5)
    z = values[torch.arange(n * shape[1]) % values.numel()].view(shape[1], shape[0], shape[2], shape[3])
    x = z.transpose(0, 1).to(dtype).contiguous(memory_format=fmt)
    C = shape[1]
    # identity normalisation (mean 0, var 1 - eps, weight 1, bias 0): the kernels see z = x
    mean, var = torch.zeros(C, dtype=x.dtype), torch.full((C,), 1 - 1e-5, dtype=x.dtype)
    w, b = torch.ones(C), torch.zeros(C)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, None, 1e-5, act, 0.0, False)
    dy = torch.randn(shape, generator=g, dtype=dtype).contiguous(memory_format=fmt)
    kept = torch.empty_like(y)
    s_g, s_gx = ops.backward_reduce(y, dy, mask, w, b, None, 1e-5, act, 0.0, False, kept)
    for got, want in zip((s_g, s_gx), ops.backward_reduce(y, dy, mask, w, b, None, 1e-5, act, 0.0, False)):
        assert torch.equal(got, want)
    mg, mgx = (s_g / n).to(var.dtype), (s_gx / n).to(var.dtype)
    dx_ref, _ = ops.backward_input(y, dy, mask, var, w, b, None, mg, mgx, 1e-5, act, 0.0, False, False)
    ops.backward_input_from_z_(kept, y, dy, var, w, b, None, mg, mgx, 1e-5, act, 0.0, False, False)
    assert torch.isfinite(kept).all()
    tol = 8 * torch.finfo(dtype).eps
    torch.testing.assert_close(kept, dx_ref, rtol=0, atol=tol * dx_ref.abs().max().item())
    # the builds with AVX2/AVX512 kernels (setup.py: x86-64, not Windows, not INPLACE_ABN_NO_AVX)
    table = (dtype == torch.float32 and not os.environ.get("INPLACE_ABN_NO_AVX") and sys.platform != "win32"
             and platform.machine().lower() in ("x86_64", "amd64")
             and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
    if table:
        fitted = (y <= 8) & ~((x < z_star) & (y > -0.1))
        assert 0 < fitted.sum() < y.numel()
        assert torch.equal(kept[fitted], dx_ref[fitted])


def test_z_path_refuses_what_it_cannot_do():
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, _, _ = _args(_activation.SILU, torch.contiguous_format, False, dtype=torch.bfloat16)
    mask = ops.forward_(x, mean, var, w, b, None, 1e-5, 3, 0.0, False)
    with pytest.raises(RuntimeError, match=r"compute type \(Float for a BFloat16 y\)"):
        ops.backward_reduce(x, torch.randn_like(x), mask, w, b, None, 1e-5, 3, 0.0, False, torch.empty_like(x))
    g = torch.zeros(x.shape[1])
    z16 = torch.empty_like(x, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="pass dx_out"):
        ops.backward_input_from_z_(z16, x, torch.randn_like(x), var.float(), w, b, None, g, g, 1e-5, 3, 0.0, False,
                                   False)
    with pytest.raises(RuntimeError, match="dx_out must have y's shape, strides, dtype"):
        ops.backward_input_from_z_(z16, x, torch.randn_like(x), var.float(), w, b, None, g, g, 1e-5, 3, 0.0, False,
                                   False, dx_out=torch.empty_like(z16))
    dy16 = torch.randn_like(x)
    with pytest.raises(RuntimeError, match="must not share memory with y, z or dy"):
        ops.backward_input_from_z_(z16, x, dy16, var.float(), w, b, None, g, g, 1e-5, 3, 0.0, False, False,
                                   dx_out=dy16)
    y = x.float()
    with pytest.raises(RuntimeError, match="SiLU backward only"):
        ops.backward_reduce(y, torch.randn_like(y), mask, w, b, None, 1e-5, 1, 0.1, False, torch.empty_like(y))
    with pytest.raises(RuntimeError, match="shape and strides and y's compute type"):
        ops.backward_reduce(y, torch.randn_like(y), mask, w, b, None, 1e-5, 3, 0.0, False, torch.empty(3))
    for dx_out in (None, torch.empty_like(y)):  # z must hold what backward_reduce kept, not y
        with pytest.raises(RuntimeError, match="must not share y's memory"):
            ops.backward_input_from_z_(y, y, torch.randn_like(y), var.float(), w, b, None, g, g, 1e-5, 3, 0.0, False,
                                       False, dx_out=dx_out)
    with pytest.raises(RuntimeError, match="shape and strides and y's compute type"):
        ops.backward_input_from_z_(torch.empty_like(y).double(), y, torch.randn_like(y), var.float(), w, b, None, g,
                                   g, 1e-5, 3, 0.0, False, False)


def _silu_z_range():
    """z from -95 to 100 through both SiLU branches, the minimum z* and signed zeros."""
    return torch.cat([torch.linspace(-95.0, -3.0, 101), torch.linspace(-3.0, 0.0, 97),
                      torch.tensor([-1.2784645427610738, 0.0, -0.0]), torch.linspace(0.0, 8.0, 61),
                      torch.linspace(8.0, 40.0, 53), torch.tensor([60.0, 100.0])])


def _assert_within_one_rounding(dx, dx_ref, dr, dr_ref, y):
    """dx (and dr, unless None) in y's dtype and strides, finite, and within one rounding of
    that dtype of the references (scaled by their largest magnitude)."""
    assert dx.dtype == y.dtype and dx.stride() == y.stride() and torch.isfinite(dx).all()
    tol = torch.finfo(y.dtype).eps
    for got, ref in ((dx, dx_ref), (dr, dr_ref)):
        if got is not None:
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_silu_backward_keeps_its_inverse_in_float32(dtype, residual):
    """bn_backward's two-pass path in half precision (channels-last) keeps the inverse in a
    float32 buffer between its passes (docs/DESIGN.md section 7.2), over the whole range of
    z: the same sums as backward_reduce without it (bitwise: the reduce pass's arithmetic
    is unchanged), and dx and dresidual as the inverting backward_input's (the float32 dx
    differs by a few float32 ulp, so the half-precision results by at most one rounding)."""
    ops, act = torch.ops.inplace_abn, _activation.SILU
    values = _silu_z_range()
    shape, C = (2, 4, 8, 8), 4
    n = shape[0] * shape[2] * shape[3]
    g = torch.Generator().manual_seed(11)
    z = values[torch.arange(n * C) % values.numel()].view(C, shape[0], shape[2], shape[3])
    x = z.transpose(0, 1).to(dtype).contiguous(memory_format=torch.channels_last)
    mean, var = torch.zeros(C), torch.full((C,), 1 - 1e-5)
    w, b = torch.ones(C, dtype=dtype), torch.zeros(C, dtype=dtype)
    r = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=torch.channels_last) if residual else None
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, 0.0, False)
    dy = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dx, dw, db, dr = ops.bn_backward(y, dy, mask, var, w, b, r, 1e-5, act, 0.0, False, True,
                                         [True, True, True, residual])
    assert "inplace_abn::bn_backward (input pass from z)" in {e.name for e in prof.events()}
    s_g, s_gx = ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, 0.0, False)
    assert torch.equal(db, s_g.to(dtype)) and torch.equal(dw, s_gx.to(dtype))
    dx_ref, dr_ref = ops.backward_input(y, dy, mask, var, w, b, r, s_g / n, s_gx / n, 1e-5, act, 0.0, False,
                                        residual)
    _assert_within_one_rounding(dx, dx_ref, dr if residual else None, dr_ref, y)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_groupnorm_silu_backward_keeps_its_inverse_in_float32(dtype, residual):
    """gn_backward's two-pass path in half precision (channels-last, C < 16) keeps the inverse
    in a float32 buffer between its passes, as bn_backward's (above): over the whole range of
    z, the sums bitwise those of the inverting operators (gn_backward_reduce: the reduce pass's
    arithmetic is unchanged), dx and dresidual as gn_backward_input's from the same group
    means within one half-precision rounding."""
    ops, act, G, eps = torch.ops.inplace_abn, _activation.SILU, 2, 1e-5
    values = _silu_z_range()
    shape = (2, 4, 8, 8)
    N, C = shape[:2]
    g = torch.Generator().manual_seed(12)
    x = values[torch.arange(x_n := torch.Size(shape).numel()) % values.numel()][torch.randperm(x_n, generator=g)]
    x = x.view(shape).to(dtype).contiguous(memory_format=torch.channels_last)
    mean, var = torch.zeros(N, G), torch.full((N, G), 1 - eps)
    w, b = torch.rand(C, generator=g).add(0.5).to(dtype), torch.zeros(C, dtype=dtype)
    r = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=torch.channels_last) if residual else None
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, eps, act, 0.0, False, None, G)
    dy = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dx, dr, s_g, s_gx = ops.gn_backward(y, dy, mask, var, w, b, r, G, eps, act, 0.0, False, residual)
    assert "inplace_abn::gn_backward (input pass from z)" in {e.name for e in prof.events()}
    r_g, r_gx = ops.gn_backward_reduce(y, dy, mask, w, b, r, eps, act, 0.0, False)
    assert torch.equal(s_g, r_g.sum(0)) and torch.equal(s_gx, r_gx.sum(0))
    gain = _activation.effective_weight(w.to(r_g.dtype), eps, False)
    m = y.numel() // (N * G)
    mean_ggz = (r_g * gain).view(N, G, C // G).sum(2) / m
    mean_ggzx = (r_gx * gain).view(N, G, C // G).sum(2) / m
    dx_ref, dr_ref = ops.gn_backward_input(y, dy, mask, var, w, b, r, mean_ggz, mean_ggzx, eps, act, 0.0, False,
                                           residual)
    _assert_within_one_rounding(dx, dx_ref, dr if residual else None, dr_ref, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_layers_take_the_z_path_for_silu_on_the_cpu(dtype):
    """InPlaceABN with SiLU runs bn_backward's input pass from z on the CPU where its
    one-pass kernel does not serve y (channels-last here), in every dtype: float32 and
    float64 keep the inverse in dx's buffer, half precision in a float32 buffer of its own
    (until 2026-12-05 it inverted twice); its profiler ranges say which pass ran.
    InPlaceAGN's backward is one operator, gn_backward, whose two-pass path (channels-last
    with C < 16 here) keeps the inverse likewise (half precision: until 2026-12-06 it
    inverted twice); its one-pass kernel keeps gz and zc per block."""
    x0 = torch.randn(2, 8, 4, 4, dtype=dtype, requires_grad=True)
    for layer, fmt in [(inplace_abn.InPlaceABN(8, activation="silu"), torch.contiguous_format),
                       (inplace_abn.InPlaceABN(8, activation="silu"), torch.channels_last),
                       (inplace_abn.InPlaceAGN(4, 8, activation="silu"), torch.contiguous_format),
                       (inplace_abn.InPlaceAGN(4, 8, activation="silu"), torch.channels_last)]:
        layer = layer.to(dtype)
        x0 = x0.detach().contiguous(memory_format=fmt).requires_grad_()
        with OpCalls() as calls, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            layer(x0 * 1).sum().backward()
        op = "gn_backward" if isinstance(layer, inplace_abn.InPlaceAGN) else "bn_backward"
        assert f"inplace_abn::{op}" in calls.names and "inplace_abn::backward_reduce" not in calls.names, calls.names
        ranges = {e.name for e in prof.events() if e.name.startswith(f"inplace_abn::{op} (")}
        if fmt == torch.contiguous_format:  # the one-pass kernel: gz and zc kept in a buffer, no z tensor
            assert ranges == {f"inplace_abn::{op} (one pass)"}, ranges
            continue
        assert ranges == {f"inplace_abn::{op} (reduce pass)", f"inplace_abn::{op} (input pass from z)"}, ranges


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_synchronised_layer_keeps_the_silu_inverse(dtype, world_of_one):
    """InPlaceABNSync with SiLU on the CPU (a gloo group of one process) runs backward_reduce
    with z_out, its all-reduce, then backward_input_from_z_, in every dtype: a 16-bit y keeps
    z in float32 and gets dx through dx_out (until 2026-12-06 it inverted twice); the same
    input gradient as the local layer (which runs bn_backward) within one rounding of the
    dtype, since the two paths scale the sums at different points."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 6, 5, 5, generator=g, dtype=dtype).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(x0.shape, generator=g, dtype=dtype).contiguous(memory_format=torch.channels_last)

    def run(cls):
        layer = cls(6, activation="silu").to(dtype)
        x = x0.clone().requires_grad_()
        with OpCalls() as seen:
            layer(x * 1).backward(dy)
        return x.grad, seen.calls

    dx_sync, calls = run(inplace_abn.InPlaceABNSync)
    dx_local, _ = run(inplace_abn.InPlaceABN)
    names = [n for n, _, _ in calls]
    assert "inplace_abn::backward_input_from_z_" in names and "inplace_abn::backward_input" not in names, names
    args, kwargs = next((a, k) for n, a, k in calls if n == "inplace_abn::backward_reduce")
    z = args[10] if len(args) > 10 else kwargs["z_out"]
    assert z.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 8 * torch.finfo(dtype).eps if dtype in (torch.float32, torch.float64) else torch.finfo(dtype).eps
    torch.testing.assert_close(dx_sync.float(), dx_local.float(), rtol=tol, atol=tol * dx_local.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_folded_arguments(fmt, dtype):
    """The optional arguments that fold per-channel work into the operators: batch_stats
    updating running statistics (mutated, declared Tensor(a!)?), forward_ writing z to
    z_out (the ReLU path, declared Tensor(b!)?), backward_input's sums_scale, and weight_grad."""
    ops = torch.ops.inplace_abn
    x, _, _, w, b, r, _ = _args(_activation.IDENTITY, fmt, True, dtype=dtype)
    rm, rv = torch.randn(x.shape[1]), torch.rand(x.shape[1]) + 0.5
    torch.library.opcheck(ops.batch_stats.default, (x, rm, rv, 0.1))
    torch.library.opcheck(ops.batch_stats.default, (x, None, rv.double(), 0.3))
    mean, var = ops.batch_stats(x)
    z = torch.empty_like(x, dtype=_activation.acc_dtype(dtype))
    torch.library.opcheck(ops.forward_.default, (x.clone(), mean, var, w, b, r, 1e-5, 0, 0.0, False, z))
    y = x.clone()
    ops.forward_(y, mean, var, w, b, r, 1e-5, 0, 0.0, False, z)
    dy = torch.randn_like(z)
    mask = torch.empty(0, dtype=torch.int32)
    s_g, s_gx = ops.backward_reduce(z, dy, mask, w, b, r.float(), 1e-5, 0, 0.0, False)
    for k in (1.0 / 7, 0.0):
        torch.library.opcheck(ops.backward_input.default,
                              (z, dy, mask, var, w, b, r.float(), s_g, s_gx, 1e-5, 0, 0.0, False, True, k))
    for signed in (False, True):
        torch.library.opcheck(ops.weight_grad.default, (s_gx, w.double(), signed))


@pytest.mark.parametrize("backend", ["native", "python"])
def test_folded_arguments_compute_what_they_replace(backend):
    """batch_stats' running update = torch.nn.BatchNorm's; z_out = the identity forward and
    x = relu(z); sums_scale k = passing k * sums; weight_grad = S_gx sign(w); against float64
    references computed with plain torch, for both backends."""
    ops = torch.ops.inplace_abn if backend == "native" else _pure
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, 4, 3, generator=g, dtype=torch.float64) * 2 + 1
    rm, rv = torch.randn(5, generator=g, dtype=torch.float64), torch.rand(5, generator=g, dtype=torch.float64) + .5
    rm0, rv0 = rm.clone(), rv.clone()
    mean, var = ops.batch_stats(x, rm, rv, 0.3)
    n = x.numel() // 5
    ref_var, ref_mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    assert torch.allclose(rm, 0.7 * rm0 + 0.3 * ref_mean, rtol=1e-14, atol=1e-14)
    assert torch.allclose(rv, 0.7 * rv0 + 0.3 * ref_var * n / (n - 1), rtol=1e-14, atol=1e-14)
    with pytest.raises(RuntimeError, match="more than 1 value per channel"):
        ops.batch_stats(x[:1, :, :1, :1].contiguous(), rm, rv, 0.1)
    empty = x[:0]
    before = rm.clone()
    ops.batch_stats(empty, rm, rv, 0.1)
    assert torch.equal(rm, before)

    w, b = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    w[1] = 0.0
    z, y, y_id = torch.empty_like(x), x.clone(), x.clone()
    ops.forward_(y, mean, var, w, b, None, 1e-5, 0, 0.0, False, z)
    ops.forward_(y_id, mean, var, w, b, None, 1e-5, 0, 0.0, False)
    assert torch.equal(z, y_id) and torch.equal(y, torch.relu(y_id))
    with pytest.raises(RuntimeError, match="z_out is the ReLU path"):
        ops.forward_(x.clone(), mean, var, w, b, None, 1e-5, 1, 0.1, False, z)

    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    mask = torch.empty(0, dtype=torch.int32)
    s_g, s_gx = ops.backward_reduce(y_id, dy, mask, w, b, None, 1e-5, 0, 0.0, False)
    dx_k, _ = ops.backward_input(y_id, dy, mask, var, w, b, None, s_g, s_gx, 1e-5, 0, 0.0, False, False, 1.0 / n)
    dx_m, _ = ops.backward_input(y_id, dy, mask, var, w, b, None, s_g / n, s_gx / n, 1e-5, 0, 0.0, False, False)
    assert torch.allclose(dx_k, dx_m, rtol=1e-13, atol=1e-15)
    inf = torch.full_like(s_g, float("inf"))  # k = 0 ignores the sums, whatever they hold
    dx_0, _ = ops.backward_input(y_id, dy, mask, var, w, b, None, inf, inf, 1e-5, 0, 0.0, False, False, 0.0)
    dx_z, _ = ops.backward_input(y_id, dy, mask, var, w, b, None, s_g * 0, s_g * 0, 1e-5, 0, 0.0, False, False)
    assert torch.equal(dx_0, dx_z)
    assert torch.equal(ops.weight_grad(s_gx, w, False), s_gx * torch.sign(w))
    assert torch.equal(ops.weight_grad(s_gx, w.float(), True), s_gx.float())


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_relu_flag_of_backward_operators(dtype, fmt, residual):
    """relu=True (the ReLU layer's backward, y holding z): backward_reduce and backward_input
    give bitwise what threshold_backward(dy, z, 0) followed by relu=False gives, zeros and NaNs
    of z included (NaN keeps dy, as torch.relu's backward); opcheck with the flag; and the
    flag refused for an activation other than identity."""
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, _ = _args(_activation.IDENTITY, fmt, residual, dtype=dtype)
    z = x.clone()
    ops.forward_(z, mean, var, w, b, r, 1e-5, _activation.IDENTITY, 0.0, False)
    k = torch.arange(z.numel()).reshape(z.shape)
    z.masked_fill_(k % 7 == 0, 0.0)  # z = 0: ReLU's derivative is 0 there
    z.masked_fill_(k % 29 == 3, float("nan"))
    dy = torch.randn_like(z)
    gz = torch.ops.aten.threshold_backward(dy, z, 0)
    assert (gz == 0).any() and (gz != dy).any()  # the flag has something to do
    want = ops.backward_reduce(z, gz, torch.empty(0, dtype=torch.int32), w, b, r, 1e-5, 0, 0.0, False)
    got = ops.backward_reduce(z, dy, torch.empty(0, dtype=torch.int32), w, b, r, 1e-5, 0, 0.0, False, None, 0, True)
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, rtol=0, atol=0, equal_nan=True)
    n = x.numel() // x.shape[1]
    mg, mgx = want[0] / n, want[1] / n
    m0 = torch.empty(0, dtype=torch.int32)
    want_dx = ops.backward_input(z, gz, m0, var, w, b, r, mg, mgx, 1e-5, 0, 0.0, False, residual)
    got_dx = ops.backward_input(z, dy, m0, var, w, b, r, mg, mgx, 1e-5, 0, 0.0, False, residual, 1.0, 0, True)
    for g, wt in zip(got_dx, want_dx):
        torch.testing.assert_close(g, wt, rtol=0, atol=0, equal_nan=True)
    if dtype == torch.float32:
        zf = z.nan_to_num()  # (opcheck compares outputs with NaN-unaware checks)
        torch.library.opcheck(ops.backward_reduce.default, (zf, dy, m0, w, b, r, 1e-5, 0, 0.0, False),
                              {"relu": True})
        sf = ops.backward_reduce(zf, dy, m0, w, b, r, 1e-5, 0, 0.0, False, relu=True)  # (mg holds NaNs)
        torch.library.opcheck(ops.backward_input.default, (zf, dy, m0, var, w, b, r, sf[0] / n, sf[1] / n, 1e-5, 0,
                                                           0.0, False, residual), {"relu": True})
    with pytest.raises(RuntimeError, match="relu=True needs activation 0"):
        ops.backward_reduce(z, dy, m0, w, b, r, 1e-5, _activation.LEAKY_RELU, 0.1, False, None, 0, True)
    with pytest.raises(RuntimeError, match="relu=True needs activation 0"):
        ops.backward_input(z, dy, m0, var, w, b, r, mg, mgx, 1e-5, _activation.ELU, 1.0, False, residual, 1.0, 0,
                           True)
