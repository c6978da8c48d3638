"""torch.library.opcheck for every native operator: schema (including the
mutation annotation of forward_), fake kernels, and AOT dispatch, in
training and eval signatures, for every activation and both layouts."""
import pytest
import torch

import inplace_abn
from inplace_abn import _activation, _pure

pytestmark = pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")


def _args(act, fmt, residual, dtype=torch.float32, training=True):
    g = torch.Generator().manual_seed(act)
    shape = (3, 5, 4, 6)
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


ACTS = [_activation.IDENTITY, _activation.LEAKY_RELU, _activation.ELU, _activation.SILU]
FORMATS = [torch.contiguous_format, torch.channels_last]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", ACTS)
def test_opcheck_all_operators(act, fmt, training, residual):
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, p = _args(act, fmt, residual, training=training)
    torch.library.opcheck(ops.batch_stats.default, (x,))
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
    args = (dy, var, w, b, r, (s_g / n).to(var.dtype), (s_gx / n).to(var.dtype), 1e-5, act, p, True, residual)
    torch.library.opcheck(ops.backward_input_from_z_.default, (z.clone(),) + args)
    dx_ref, dr_ref = ops.backward_input(y, dy, mask, var, w, b, r, *args[5:])
    dr = ops.backward_input_from_z_(z, *args)
    tol = 8 * torch.finfo(dtype).eps
    torch.testing.assert_close(z, dx_ref, rtol=0, atol=tol * dx_ref.abs().max().item())
    assert z.stride() == y.stride()
    if residual:
        torch.testing.assert_close(dr, dr_ref, rtol=0, atol=tol * dr_ref.abs().max().item())


def test_z_path_refuses_what_it_cannot_do():
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, _, _ = _args(_activation.SILU, torch.contiguous_format, False, dtype=torch.bfloat16)
    mask = ops.forward_(x, mean, var, w, b, None, 1e-5, 3, 0.0, False)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        ops.backward_reduce(x, torch.randn_like(x), mask, w, b, None, 1e-5, 3, 0.0, False, torch.empty_like(x))
    y = x.float()
    with pytest.raises(RuntimeError, match="SiLU backward only"):
        ops.backward_reduce(y, torch.randn_like(y), mask, w, b, None, 1e-5, 1, 0.1, False, torch.empty_like(y))
    with pytest.raises(RuntimeError, match="shape, strides and dtype"):
        ops.backward_reduce(y, torch.randn_like(y), mask, w, b, None, 1e-5, 3, 0.0, False, torch.empty(3))


@pytest.mark.parametrize("dtype,kept", [(torch.float32, True), (torch.float64, True), (torch.bfloat16, False)],
                         ids=str)
def test_layers_take_the_z_path_for_silu_on_the_cpu(dtype, kept):
    """InPlaceABN with SiLU calls backward_input_from_z_ in float32/float64 on the CPU
    (and the inverting backward_input otherwise) from its C++ autograd. InPlaceAGN's
    backward is one operator, gn_backward, which keeps z in its two-pass path the same way
    (src/ops/gn_backward.cpp: silu_keeps_z)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    x0 = torch.randn(2, 8, 4, 4, dtype=dtype, requires_grad=True)
    for layer, fmt in [(inplace_abn.InPlaceABN(8, activation="silu"), torch.contiguous_format),
                       (inplace_abn.InPlaceAGN(4, 8, activation="silu"), torch.contiguous_format),
                       (inplace_abn.InPlaceAGN(4, 8, activation="silu"), torch.channels_last)]:
        layer = layer.to(dtype)
        x0 = x0.detach().contiguous(memory_format=fmt).requires_grad_()
        with Calls() as calls:
            layer(x0 * 1).sum().backward()
        if isinstance(layer, inplace_abn.InPlaceAGN):
            assert "inplace_abn::gn_backward" in calls.names and "inplace_abn::backward_reduce" not in calls.names
            continue
        assert ("inplace_abn::backward_input_from_z_" in calls.names) == kept, calls.names
        assert ("inplace_abn::backward_input" in calls.names) == (not kept), calls.names


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
