"""Module API, drop-in compatibility, errors, memory and the in-place contract."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import inplace_abn
from inplace_abn import ABN, InPlaceABN, InPlaceABNSync, _activation
from inplace_abn.functions import inplace_abn as iabn
from inplace_abn.memory import model_saved_bytes
from reference import rel_err, stock


def _x(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


# ---- in-place contract ---------------------------------------------------------

@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_output_shares_input_storage(backend, fmt):
    x = _x(4, 8, 5, 5).contiguous(memory_format=fmt)
    ptr = x.data_ptr()
    y = InPlaceABN(8)(x)
    assert y.data_ptr() == ptr and y is x
    assert y.is_contiguous(memory_format=fmt)


def test_silu_mask_is_one_bit_per_element(backend):
    ops = inplace_abn._backend.ops_for(torch.empty(0))
    for numel_shape in [(4, 3, 5, 7), (3, 5), (2, 3, 33)]:
        x = _x(*numel_shape)
        C = x.shape[1]
        mask = ops.forward_(x, torch.zeros(C), torch.ones(C), None, None, None, 1e-5, _activation.SILU, 0.0, False)
        assert mask.dtype == torch.int32
        assert mask.numel() == (x.numel() + 31) // 32  # 32 elements per 4-byte word
        empty = ops.forward_(_x(*numel_shape), torch.zeros(C), torch.ones(C), None, None, None, 1e-5,
                             _activation.LEAKY_RELU, 0.1, False)
        assert empty.numel() == 0


def test_silu_mask_bits_in_memory_order(backend):
    # Same values in both layouts must give the same bits at the same storage positions.
    x = _x(2, 3, 4, 5) * 3 - 1
    ops = inplace_abn._backend.ops_for(x)
    z = x.clone()
    C = 3
    m1 = ops.forward_(x.clone(), torch.zeros(C), torch.ones(C) - 1e-5, None, None, None, 1e-5, 3, 0.0, False)
    expected_bits = (z < -1.2784645427610738).reshape(-1)
    words = [(m1[i // 32].item() >> (i % 32)) & 1 for i in range(z.numel())]
    assert words == expected_bits.int().tolist()
    xc = x.clone().contiguous(memory_format=torch.channels_last)
    m2 = ops.forward_(xc, torch.zeros(C), torch.ones(C) - 1e-5, None, None, None, 1e-5, 3, 0.0, False)
    zc = z.permute(0, 2, 3, 1).reshape(-1)  # memory order of channels-last
    words = [(m2[i // 32].item() >> (i % 32)) & 1 for i in range(zc.numel())]
    assert words == (zc < -1.2784645427610738).int().tolist()


def test_bitwise_reproducible(backend):
    outs = []
    for _ in range(2):
        x = _x(8, 16, 9, 9, seed=3)
        layer = InPlaceABN(16, activation="silu")
        xin = x.clone().requires_grad_()
        y = layer(xin.clone())
        y.backward(_x(8, 16, 9, 9, seed=4))
        outs.append((y.detach(), xin.grad, layer.weight.grad, layer.running_var.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native kernels only")
@pytest.mark.parametrize("shape,fmt", [
    ((8, 16, 40, 40), torch.contiguous_format),  # planar path, several tasks per thread
    ((8, 24, 17, 17), torch.channels_last),      # rows path, odd channel count
    ((16, 96, 7, 7), torch.contiguous_format),   # small planes: rows path for SiLU, planes for leaky_relu
    ((64, 96, 3, 3), torch.contiguous_format),   # planes under 16 elements: rows path for every activation
    ((8, 512, 4, 4), torch.contiguous_format),   # planes of 16: element-wise kernels on planes for leaky_relu
    ((3000, 37), torch.contiguous_format),       # N x C, mask words straddling tasks
    ((4, 16, 14, 14), torch.contiguous_format),  # small: split in tasks for SiLU only (kCost)
])
@pytest.mark.parametrize("activation", ["leaky_relu", "silu"])
def test_native_result_independent_of_thread_count(shape, fmt, activation):
    """The kernels split work by shape, not by thread: 1, 2 and 3 threads agree bitwise.

    The shapes are large enough for at::parallel_for to split them (that the
    build really runs it on several threads is test_native_kernels_built_with_openmp).
    """
    x0 = _x(*shape, seed=5).contiguous(memory_format=fmt)
    dy = _x(*shape, seed=6).contiguous(memory_format=fmt)
    outs = []
    with inplace_abn.use_backend("native"):
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            layer = InPlaceABN(shape[1], activation=activation)
            xin = x0.clone().requires_grad_()
            y = layer(xin.clone())
            y.backward(dy)
            outs.append((y.detach(), xin.grad, layer.weight.grad, layer.bias.grad, layer.running_mean.clone(),
                         layer.running_var.clone()))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native kernels only")
@pytest.mark.skipif(not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info(),
                    reason="the Linux build uses torch's OpenMP pool")
def test_native_kernels_built_with_openmp():
    """The extension's at::parallel_for really is OpenMP code.

    It is a header template: compiled without -fopenmp (the pool torch uses on
    Linux) it runs every loop on the calling thread, whatever
    torch.get_num_threads() says; an earlier build did, at half the speed.
    With -fopenmp the compiled loops call GOMP_parallel, which the library
    then imports (and the link records the OpenMP runtime it needs); that the
    threads agree bitwise is test_native_result_independent_of_thread_count.
    """
    from inplace_abn import _C

    with open(_C.__file__, "rb") as f:
        image = f.read()
    assert b"GOMP_parallel" in image, "inplace_abn._C was compiled without -fopenmp"
    # the library's own dependency (its NEEDED entry and symbol versions name it in .dynstr);
    # /proc/self/maps would not tell, as torch itself loads libgomp
    assert b"libgomp.so" in image, "inplace_abn._C does not link the OpenMP runtime"


def test_non_contiguous_input(backend):
    leaf = _x(4, 6, 8, 10, dtype=torch.float64).requires_grad_()
    strided = leaf.clone()[:, :, :, ::2]  # neither contiguous nor channels-last
    ref_in = leaf.detach()[:, :, :, ::2].clone().requires_grad_()
    w, b = torch.rand(6, dtype=torch.float64) + 0.5, torch.randn(6, dtype=torch.float64)
    y = iabn(strided, w, b, None, None, True, 0.1, 1e-5, "elu", 1.0)
    assert y is strided
    y_ref = stock(ref_in, w, b, None, None, True, 0.1, 1e-5, "elu", 1.0)
    assert rel_err(y, y_ref) < 1e-12
    g = _x(4, 6, 8, 5, dtype=torch.float64)
    (gl,) = torch.autograd.grad(y, leaf, g)
    (gr,) = torch.autograd.grad(y_ref, ref_in, g)
    assert rel_err(gl[:, :, :, ::2], gr) < 1e-10
    assert gl[:, :, :, 1::2].abs().max() == 0


# ---- errors ----------------------------------------------------------------------

def test_unknown_activation():
    with pytest.raises(ValueError, match="Unknown activation 'gelu'"):
        InPlaceABN(4, activation="gelu")
    with pytest.raises(ValueError, match="Unknown activation"):
        iabn(_x(4, 4), None, None, None, None, True, 0.1, 1e-5, "tanh", 0.0)


def test_negative_slope_and_alpha():
    with pytest.raises(ValueError, match="non-negative slope"):
        InPlaceABN(4, activation="leaky_relu", activation_param=-0.1)
    with pytest.raises(ValueError, match="alpha > 0"):
        iabn(_x(4, 4), None, None, None, None, True, 0.1, 1e-5, "elu", 0.0)


def test_integer_dtype():
    with pytest.raises(TypeError, match="floating point input, got torch.int64"):
        InPlaceABN(4)(torch.ones(4, 4, dtype=torch.long))


def test_wrong_channel_count():
    with pytest.raises(ValueError, match="input has 3 channels but weight has shape \\[4\\]"):
        InPlaceABN(4)(_x(2, 3, 5, 5))


@pytest.mark.parametrize("records_backward", [True, False])  # the C++ layer checks / Python does
@pytest.mark.parametrize("preserve_input", [False, True])
@pytest.mark.parametrize("name", ["weight", "bias", "running_mean", "running_var"])
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_per_channel_refusal_is_worded_alike_and_writes_nothing(backend, records_backward, preserve_input, name, bad):
    # With a backward to record, the native layers check the (C,) tensors in C++ and Python
    # words the refusal (functions._apply): the same error as on the Python path, raised
    # before x or the running statistics change.
    x = _x(6, 4, 3)
    t = dict(weight=torch.rand(4) + 0.5, bias=torch.randn(4), running_mean=torch.zeros(4), running_var=torch.ones(4))
    t[name] = torch.ones(5) if bad == "shape" else torch.ones(4, dtype=torch.int64)
    for k in ("weight", "bias"):
        t[k].requires_grad_(records_backward and t[k].is_floating_point())
    x_before, t_before = x.clone(), {k: v.detach().clone() for k, v in t.items()}
    err, msg = ((ValueError, f"input has 4 channels but {name} has shape \\[5\\] \\(expected \\[4\\]\\)")
                if bad == "shape" else (TypeError, f"inplace_abn: {name} must be floating point, got torch.int64"))
    with pytest.raises(err, match=msg):
        iabn(x, t["weight"], t["bias"], t["running_mean"], t["running_var"], True, 0.1, 1e-5, "leaky_relu", 0.01,
             preserve_input=preserve_input)
    assert torch.equal(x, x_before)
    for k, v in t.items():
        assert torch.equal(v.detach(), t_before[k]), k


def test_wrong_rank():
    with pytest.raises(ValueError, match="shape \\(N, C, ...\\)"):
        InPlaceABN(4)(_x(4))


def test_one_value_per_channel_in_training(backend):
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        InPlaceABN(4)(_x(1, 4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        InPlaceABN(4)(_x(1, 4, 1, 1))
    layer = InPlaceABN(4).eval()  # eval mode uses running stats: fine
    assert torch.isfinite(layer(_x(1, 4, 1, 1))).all()


def test_leaf_requiring_grad_is_refused():
    x = _x(4, 4, 3, 3).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        InPlaceABN(4)(x)


def test_input_needed_by_another_op_raises(backend):
    # x is saved by x * x for its backward; overwriting it must not give a wrong gradient.
    leaf = _x(4, 4, 3, 3).requires_grad_()
    x = leaf * 1.0
    other = x * x
    y = InPlaceABN(4)(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + other.sum()).backward()


def test_eval_needs_running_stats():
    with pytest.raises(ValueError, match="needs running_mean and running_var"):
        iabn(_x(4, 4), None, None, None, None, False)


def test_residual_shape_checked():
    with pytest.raises(ValueError, match="residual must have the input's shape"):
        InPlaceABN(4)(_x(2, 4, 3, 3), residual=_x(2, 4, 3, 2))


# ---- non-invertible activations -------------------------------------------------

@pytest.mark.parametrize("activation,param", [("relu", 0.0), ("leaky_relu", 0.0)])
def test_relu_is_correct_and_warns_once(backend, activation, param, monkeypatch):
    monkeypatch.setattr(_activation, "_warned_not_invertible", False)
    x = _x(8, 5, 4, 4, dtype=torch.float64)
    w = (torch.rand(5, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(5, dtype=torch.float64).requires_grad_()
    xin = x.clone().requires_grad_()
    with pytest.warns(RuntimeWarning, match="not invertible.*saves no memory.*slope > 0"):
        y = iabn(xin.clone(), w, b, None, None, True, 0.1, 1e-5, activation, param)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iabn(x.clone(), w.detach(), b.detach(), None, None, True, 0.1, 1e-5, activation, param)  # no second warning
    xr = x.clone().requires_grad_()
    yr = F.relu(F.batch_norm(xr, None, None, w.abs() + 1e-5, b, True, 0.1, 1e-5))
    g = _x(8, 5, 4, 4, dtype=torch.float64, seed=1)
    ours = torch.autograd.grad(y, [xin, w, b], g)
    ref = torch.autograd.grad(yr, [xr, w, b], g)
    assert rel_err(y, yr) < 1e-12
    for a, r in zip(ours, ref):
        assert rel_err(a, r) < 1e-10


# ---- modules: drop-in compatibility ----------------------------------------------

def test_state_dict_keys_match_original():
    keys = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    for cls in (ABN, InPlaceABN, InPlaceABNSync):
        assert list(cls(8).state_dict()) == keys
    assert list(InPlaceABN(8, affine=False, track_running_stats=False).state_dict()) == []


def test_old_checkpoint_without_num_batches_tracked_loads():
    sd = InPlaceABN(8).state_dict()
    del sd["num_batches_tracked"]
    sd._metadata = {"": {"version": 1}}
    layer = InPlaceABN(8)
    layer.load_state_dict(sd)  # strict: must not complain
    assert layer.num_batches_tracked.item() == 0


def test_batchnorm_weights_load_in_signed_mode(backend):
    bn = nn.BatchNorm2d(6).double()
    with torch.no_grad():
        bn.weight.copy_(torch.randn(6))
        bn.bias.copy_(torch.randn(6))
        bn.running_mean.copy_(torch.randn(6))
        bn.running_var.copy_(torch.rand(6) + 0.5)
    layer = InPlaceABN(6, activation="identity", weight_mode="signed").double()
    layer.load_state_dict(bn.state_dict())
    bn.eval(), layer.eval()
    x = _x(3, 6, 4, 4, dtype=torch.float64)
    # signed mode: sign(w)(|w| + eps) differs from w by eps only
    assert rel_err(layer(x.clone()), bn(x)) < 1e-4
    with torch.no_grad():
        layer.weight.copy_(bn.weight.sign() * (bn.weight.abs() - layer.eps))
    assert rel_err(layer(x.clone()), bn(x)) < 1e-12


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("cls", [ABN, InPlaceABN])
def test_running_stats_follow_batchnorm(backend, cls, momentum):
    bn = nn.BatchNorm2d(5, momentum=momentum).double()
    layer = cls(5, momentum=momentum, activation="identity").double()
    for step in range(4):
        x = _x(4, 5, 3, 3, dtype=torch.float64, seed=step) * 2 + 1
        bn.train(step != 1), layer.train(step != 1)  # an eval step neither counts nor updates
        y_bn, y = bn(x.clone()), layer(x.clone())
        assert rel_err(y, y_bn) < 1e-4  # (|w| + eps scale)
    assert layer.num_batches_tracked.item() == bn.num_batches_tracked.item() == 3
    assert rel_err(layer.running_mean, bn.running_mean) < 1e-12
    assert rel_err(layer.running_var, bn.running_var) < 1e-12


def test_track_running_stats_false_uses_batch_stats_in_eval(backend):
    layer = InPlaceABN(4, track_running_stats=False, activation="identity").double().eval()
    x = _x(6, 4, 3, 3, dtype=torch.float64) * 3 + 2
    y = layer(x.clone())
    ref = F.batch_norm(x, None, None, torch.ones(4, dtype=torch.float64) + 1e-5, torch.zeros(4, dtype=torch.float64),
                       True, 0.1, 1e-5)
    assert rel_err(y, ref) < 1e-12


@pytest.mark.parametrize("shape", [(16, 4), (4, 4, 7), (2, 4, 3, 5), (2, 4, 2, 3, 3)])
def test_abn_matches_stock(shape):
    layer = ABN(4, activation="elu", activation_param=0.5).double()
    x = _x(*shape, dtype=torch.float64)
    y = layer(x.clone())
    ref = F.elu(F.batch_norm(x, None, None, layer.weight, layer.bias, True, 0.1, 1e-5), 0.5)
    assert rel_err(y, ref) < 1e-14


def test_sync_without_process_group_falls_back(backend):
    layer = InPlaceABNSync(4, activation="identity").double()
    x = _x(6, 4, 3, 3, dtype=torch.float64)
    import inplace_abn.functions as fn
    fn._warned_no_dist = False
    with pytest.warns(RuntimeWarning, match="not initialized"):
        y = layer(x.clone())
    assert rel_err(y, InPlaceABN(4, activation="identity").double()(x.clone())) < 1e-14


def test_extra_repr():
    assert "leaky_relu[0.01]" in repr(InPlaceABN(4))
    assert "weight_mode=signed" in repr(InPlaceABN(4, weight_mode="signed"))


# ---- memory ------------------------------------------------------------------------

def _stack(norm_act, width=32, depth=8):
    layers = [nn.Conv2d(3, width, 3, padding=1, bias=False)]
    for i in range(depth):
        layers.append(norm_act(width))
        if i < depth - 1:
            layers.append(nn.Conv2d(width, width, 3, padding=1, bias=False))
    return nn.Sequential(*layers)


def test_memory_saved_for_backward(backend):
    torch.manual_seed(0)
    x = _x(4, 3, 32, 32)
    stock_net = _stack(lambda c: nn.Sequential(nn.BatchNorm2d(c), nn.LeakyReLU(0.01, inplace=True)))
    ours_net = _stack(lambda c: InPlaceABN(c))
    b_stock = model_saved_bytes(stock_net, x)
    b_ours = model_saved_bytes(ours_net, x)
    ratio = b_ours / b_stock
    assert ratio <= 0.55, f"saved bytes ratio {ratio:.3f} ({b_ours} vs {b_stock})"


def test_relu_layer_says_it_saves_nothing_and_stays_correct(backend, monkeypatch):
    """ReLU is not invertible: the layer warns that it saves no memory, keeps z (more saved
    bytes than an invertible activation), and computes stock BatchNorm + ReLU's results
    (float64 here; tests/test_accuracy.py bounds every dtype and layout)."""
    monkeypatch.setattr(inplace_abn._activation, "_warned_not_invertible", False)
    x = _x(4, 3, 16, 16)
    with pytest.warns(RuntimeWarning, match="relu is not invertible.*saves no memory"):
        InPlaceABN(3, activation="relu")(x.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        relu_net = _stack(lambda c: InPlaceABN(c, activation="relu"), depth=2)
        leaky_net = _stack(lambda c: InPlaceABN(c), depth=2)
        assert model_saved_bytes(relu_net, x) > model_saved_bytes(leaky_net, x)
        ours, stock = InPlaceABN(3, activation="relu").double(), nn.BatchNorm2d(3).double()
    with torch.no_grad():
        stock.weight.copy_(ours.weight.abs() + ours.eps)  # the default abs mode scales by |w| + eps
    x64, dy = _x(4, 3, 5, 6, dtype=torch.float64, seed=1), _x(4, 3, 5, 6, dtype=torch.float64, seed=2)
    grads = []
    for layer, act in ((ours, nn.Identity()), (stock, nn.ReLU())):
        leaf = x64.clone().requires_grad_()
        y = act(layer(leaf.clone()))
        grads.append((y.detach(),) + torch.autograd.grad(y, (leaf, layer.weight, layer.bias), dy))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- build ---------------------------------------------------------------------------

@pytest.mark.skipif(not os.environ.get("INPLACE_ABN_REQUIRE_NATIVE"), reason="native build not required here")
def test_native_extension_is_built():
    assert inplace_abn.HAS_NATIVE, f"the native extension failed to load: {inplace_abn._backend._native_error}"
    for op in inplace_abn._backend.OP_NAMES + inplace_abn._backend.CPU_OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"inplace_abn::{op}", "CPU"), op


# (inputs from Python's random: torch.randn's own kernels differ between the capabilities)
_ISA_PROBE = """
import hashlib, math, random, torch, inplace_abn
rng = random.Random(0)
def randn(*shape):
    return torch.tensor([rng.gauss(0.0, 1.0) for _ in range(math.prod(shape))], dtype=torch.float32).view(shape)
x = randn(4, 8, 9, 9).requires_grad_()
layer = inplace_abn.InPlaceABN(8, activation="silu")
y = layer(x.clone())
dx, = torch.autograd.grad(y, x, randn(4, 8, 9, 9))
print(hashlib.sha1(y.detach().numpy().tobytes() + dx.numpy().tobytes()).hexdigest())
"""


@pytest.mark.skipif(not os.environ.get("INPLACE_ABN_REQUIRE_NATIVE"), reason="native build not required here")
def test_each_cpu_isa_runs_its_own_kernels():
    """ATEN_CPU_CAPABILITY picks our kernels as it picks PyTorch's: each instruction set up to
    this run's gives other SiLU bits (the AVX2/AVX512 fitted inverse, the default Halley step),
    so a build that silently lost its AVX2 or AVX512 kernels (the dispatch would fall back to
    the next lower ones) fails here. INPLACE_ABN_NO_AVX=1 (the CI's default-only build): every
    setting runs the default kernels, so all agree."""
    isas = {"DEFAULT": ["default"], "AVX2": ["default", "avx2"], "AVX512": ["default", "avx2", "avx512"]}
    levels = isas.get(torch.backends.cpu.get_cpu_capability(), ["default"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    got = {}
    for isa in levels:
        env["ATEN_CPU_CAPABILITY"] = isa
        out = subprocess.run([sys.executable, "-c", _ISA_PROBE], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got[isa] = out.stdout.split()[-1]
    if os.environ.get("INPLACE_ABN_NO_AVX"):
        assert len(set(got.values())) == 1, got
    else:
        assert len(set(got.values())) == len(levels), f"two instruction sets ran the same kernels: {got}"


@pytest.mark.skipif(not os.environ.get("INPLACE_ABN_REQUIRE_CUDA_BUILD"), reason="CUDA build not required here")
def test_cuda_kernels_are_registered():
    for op in inplace_abn._backend.OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"inplace_abn::{op}", "CUDA"), op


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("make", [lambda: InPlaceABN(4, activation="elu", activation_param=1.0).double(),
                                  lambda: inplace_abn.InPlaceAGN(2, 4, activation="elu", activation_param=1.0).double()],
                         ids=["InPlaceABN", "InPlaceAGN"])
def test_parametrized_weight_is_used(backend, make):
    """The modules read weight and bias from _parameters for speed; a parametrized weight
    (torch.nn.utils.parametrize) is not there and must still be what the layer applies,
    with the gradient reaching the original parameter."""
    from torch.nn.utils import parametrize
    plain, param = make(), make()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        param.weight.copy_(plain.weight / 2)
        plain.bias.uniform_(-1, 1)
        param.bias.copy_(plain.bias)
    parametrize.register_parametrization(param, "weight", _Doubled())
    x = _x(3, 4, 5, dtype=torch.float64).requires_grad_()
    dy = _x(3, 4, 5, dtype=torch.float64, seed=1)
    y_plain, y_param = plain(x * 1), param(x * 1)
    assert rel_err(y_param, y_plain) < 1e-12
    (g_plain,) = torch.autograd.grad(y_plain, plain.weight, dy)
    (g_param,) = torch.autograd.grad(y_param, param.parametrizations.weight.original, dy)
    assert rel_err(g_param, 2 * g_plain) < 1e-12


_WITHOUT_EXTENSION = r'''
import importlib.abc, sys, warnings

class _NoExtension(importlib.abc.MetaPathFinder):
    """As on a machine where src/ was never built: inplace_abn._C cannot be imported."""
    def find_spec(self, name, path=None, target=None):
        if name == "inplace_abn._C":
            raise ImportError("inplace_abn._C blocked by the test (extension not built)")
        return None

sys.meta_path.insert(0, _NoExtension())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import inplace_abn
import torch
from reference import rel_err, stock, stock_gn

assert not inplace_abn.HAS_NATIVE
assert any("pure-PyTorch backend" in str(w.message) for w in caught), [str(w.message) for w in caught]
g = torch.Generator().manual_seed(0)
for act, p in [("leaky_relu", 0.1), ("elu", 1.0), ("silu", 0.0), ("identity", 0.0)]:
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(4, 8, 5, 5, generator=g, dtype=torch.float64).contiguous(memory_format=fmt)
        dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
        for layer in (inplace_abn.InPlaceABN(8, activation=act, activation_param=p).double(),
                      inplace_abn.InPlaceAGN(4, 8, activation=act, activation_param=p).double()):
            with torch.no_grad():
                layer.weight.copy_(torch.rand(8, generator=g) + 0.5)
                layer.bias.copy_(torch.randn(8, generator=g))
            xin = x.clone().requires_grad_()
            y = layer(xin.clone())
            y.backward(dy)
            ref_x = x.clone().requires_grad_()
            w = layer.weight.detach().clone().requires_grad_()
            b = layer.bias.detach().clone().requires_grad_()
            if isinstance(layer, inplace_abn.InPlaceABN):
                ref = stock(ref_x, w, b, None, None, activation=act, activation_param=p,
                            weight_mode=layer.weight_mode)
            else:
                ref = stock_gn(ref_x, 4, w, b, activation=act, activation_param=p, weight_mode=layer.weight_mode)
            ref.backward(dy)
            name = f"{type(layer).__name__} {act} {fmt}"
            assert rel_err(y, ref) < 1e-10, name
            for got, want in ((xin.grad, ref_x.grad), (layer.weight.grad, w.grad), (layer.bias.grad, b.grad)):
                assert rel_err(got, want) < 1e-8, (name, rel_err(got, want))
print("ok")
'''


def test_imports_and_trains_without_the_native_extension():
    """On a machine where the extension was never built, `import inplace_abn` warns and the
    pure backend runs both layers, forward and backward, against stock float64 (a fresh
    process in which inplace_abn._C cannot be imported)."""
    import subprocess
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, tests, os.environ.get("PYTHONPATH", "")]))
    env.pop("INPLACE_ABN_BACKEND", None)
    r = subprocess.run([sys.executable, "-c", _WITHOUT_EXTENSION], capture_output=True, text=True, env=env,
                       cwd=tests, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]
