"""Backend selection: the native extension (``inplace_abn._C``) when it is
built and has kernels for the input's device, else the pure-PyTorch backend.

``INPLACE_ABN_BACKEND`` = ``auto`` (default) | ``native`` | ``python`` picks
the backend at import; `use_backend` switches it for a block of code, in the
current thread (or asyncio task) only: the choice is a `contextvars.ContextVar`.
"""
import contextlib
import contextvars
import os
import warnings
from typing import Optional

import torch

from . import _activation, _pure

_native_error = None
try:
    from . import _C  # noqa: F401  (loading it registers torch.ops.inplace_abn)
except ImportError as e:  # extension not built: pure backend
    _native_error = e

HAS_NATIVE = _native_error is None
OP_NAMES = ("batch_stats", "forward_", "bn_forward_", "forward", "bn_forward", "backward_reduce", "backward_input",
            "weight_grad", "bn_backward", "gn_backward")  # CPU, CUDA
CPU_OP_NAMES = ("backward_input_from_z_",)  # the SiLU z path (docs/DESIGN.md section 7.2)


class _NativeOps:
    """The torch.ops.inplace_abn operators, under the same names as `_pure`: their
    default overloads, bound once (a call through the packet resolves the
    overload, and a lookup by name costs a __getattr__, every time)."""

    def __init__(self):
        for name in OP_NAMES + CPU_OP_NAMES:
            setattr(self, name, getattr(torch.ops.inplace_abn, name).default)


NATIVE = _NativeOps() if HAS_NATIVE else None


_device_kernel = {}  # device type -> bool; the dispatcher lookup costs ~14 us, twice per step


@torch.compiler.assume_constant_result  # registrations are fixed at import: no graph break under compile
def _has_device_kernel(device_type: str) -> bool:
    found = _device_kernel.get(device_type)
    if found is None:
        key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
        # (without the extension the operator is not declared, and asking would raise)
        found = HAS_NATIVE and key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
            "inplace_abn::forward_", key)
        _device_kernel[device_type] = found
    return found


def _initial_choice() -> str:
    choice = os.environ.get("INPLACE_ABN_BACKEND", "auto").lower()
    if choice not in ("auto", "native", "python"):
        raise ValueError(f"INPLACE_ABN_BACKEND must be auto, native or python, got {choice!r}")
    if choice == "native" and not HAS_NATIVE:
        raise ImportError(f"INPLACE_ABN_BACKEND=native but the extension could not be loaded: {_native_error}")
    if choice == "auto" and not HAS_NATIVE:
        warnings.warn(
            f"inplace_abn: native extension not available ({_native_error}); using the pure-PyTorch "
            "backend, which is correct but slower. Reinstall with `pip install --no-build-isolation -e .` "
            "to build it.",
            RuntimeWarning,
        )
    return choice


_default = _initial_choice()
# Unset in a thread that did not call use_backend: such a thread gets the default. The
# backward does not read it: it reuses the choice its forward made (autograd may run the
# backward in another thread).
_choice = contextvars.ContextVar("inplace_abn_backend")
_warned_devices = set()


def current() -> str:
    """The configured backend in this thread: ``auto``, ``native`` or ``python``."""
    return _choice.get(_default)


@contextlib.contextmanager
def use_backend(name: str):
    """Run a block with the ``native``, ``python`` or ``auto`` backend (this thread only)."""
    if name not in ("auto", "native", "python"):
        raise ValueError(f"backend must be auto, native or python, got {name!r}")
    if name == "native" and not HAS_NATIVE:
        raise RuntimeError(f"the native extension is not available: {_native_error}")
    token = _choice.set(name)
    try:
        yield
    finally:
        _choice.reset(token)


def ops_for(x: torch.Tensor, choice: Optional[str] = None):
    """The operator set that runs on ``x``'s device under ``choice`` (default: `current`)."""
    choice = current() if choice is None else choice
    if choice == "python" or not HAS_NATIVE:
        return _pure
    if _has_device_kernel("cpu" if x.is_cpu else x.device.type):  # (x.device costs ~0.2 us)
        return NATIVE
    if choice == "native":
        raise RuntimeError(f"inplace_abn: the native extension has no kernels for {x.device.type} tensors")
    if x.device.type not in _warned_devices:
        _warned_devices.add(x.device.type)
        warnings.warn(
            f"inplace_abn: no native kernels for {x.device.type}; using the pure-PyTorch backend",
            RuntimeWarning,
        )
    return _pure


def silu_keeps_z(y: torch.Tensor, act: int) -> bool:
    """Whether a native backward on y can keep its inverse z = f^-1(y) (or h = z / y)
    between its two passes in y's own dtype: SiLU, on the CPU with the extension
    built, float32/float64 (docs/DESIGN.md section 7.2). The GroupNorm operators'
    z path (`gn_backward_input_from_z_` writes dx over z) takes these alone; the
    BatchNorm operators' takes 16-bit y too (`z_buffer`)."""
    return HAS_NATIVE and act == _activation.SILU and y.device.type == "cpu" and y.dtype in (
        torch.float32, torch.float64)


def z_buffer(ops, y: torch.Tensor, act: int) -> Optional[torch.Tensor]:
    """The buffer in which the BatchNorm backward running ``ops`` keeps its inverse between
    its passes (`backward_reduce(..., z_out)`, then `backward_input_from_z_`), or None: SiLU
    on the CPU with the native operators, y's shape and layout in the compute type (y's
    dtype; float32 for bfloat16 / float16, whose dx then goes to a tensor of its own)."""
    if ops is not NATIVE or not HAS_NATIVE or act != _activation.SILU or y.device.type != "cpu":
        return None
    if y.dtype in (torch.float32, torch.float64):
        return torch.empty_like(y)
    if y.dtype in (torch.bfloat16, torch.float16):
        return torch.empty_like(y, dtype=torch.float32)
    return None


def _register_fakes():
    """Fake (meta) kernels: shapes and dtypes only, for torch.compile / export / opcheck."""

    def acc(t):
        return _activation.acc_dtype(t.dtype)

    @torch.library.register_fake("inplace_abn::batch_stats")
    def _(x, running_mean=None, running_var=None, momentum=0.0, groups=0):
        shape = (x.shape[0], groups) if groups else (x.shape[1],)  # per (n, group) for GroupNorm
        return x.new_empty(shape, dtype=acc(x)), x.new_empty(shape, dtype=acc(x))

    def mask(x, activation, groups=0):  # forward_'s SiLU mask
        # channels-last GroupNorm: the samples' masks, whole words each
        parts = x.shape[0] if groups and _pure.is_channels_last(x) and x.shape[0] else 1
        words = parts * ((x.numel() // parts + 31) // 32) if activation == 3 else 0
        return x.new_empty(words, dtype=torch.int32)

    def stats(x):
        C = x.shape[1]
        return x.new_empty(C, dtype=acc(x)), x.new_empty(C, dtype=acc(x))

    def functional_outputs(x, keep_z):  # (y, z) of the functional forwards (src/ops/functional_forward.cpp)
        x = _pure.walkable(x)
        return torch.empty_like(x), torch.empty_like(x, dtype=acc(x)) if keep_z else x.new_empty(0)

    @torch.library.register_fake("inplace_abn::forward_")
    def _(x, mean, var, weight, bias, residual, eps, activation, activation_param, signed_weight, z_out=None,
          groups=0, source=None):
        return mask(x, activation, groups)

    @torch.library.register_fake("inplace_abn::bn_forward_")
    def _(x, weight, bias, running_mean, running_var, residual, momentum, eps, activation, activation_param,
          signed_weight, z_out=None, source=None):
        return (mask(x, activation), *stats(x))

    @torch.library.register_fake("inplace_abn::forward")
    def _(x, mean, var, weight, bias, residual, eps, activation, activation_param, signed_weight, keep_z=False,
          groups=0):
        y, z = functional_outputs(x, keep_z)
        return y, z, mask(y, activation, groups)

    @torch.library.register_fake("inplace_abn::bn_forward")
    def _(x, weight, bias, residual, eps, activation, activation_param, signed_weight, keep_z=False):
        y, z = functional_outputs(x, keep_z)
        return (y, z, mask(y, activation), *stats(x))

    @torch.library.register_fake("inplace_abn::backward_reduce")
    def _(y, dy, mask, weight, bias, residual, eps, activation, activation_param, signed_weight, z_out=None,
          groups=0, relu=False):
        shape = y.shape[:2] if groups else y.shape[1:2]  # per (n, c) for GroupNorm
        return y.new_empty(shape, dtype=acc(y)), y.new_empty(shape, dtype=acc(y))

    @torch.library.register_fake("inplace_abn::backward_input")
    def _(y, dy, mask, var, weight, bias, residual, mean_gz, mean_gzx, eps, activation, activation_param,
          signed_weight, residual_grad, sums_scale=1.0, groups=0, relu=False):
        dx = torch.empty_like(y)
        dr = torch.empty_like(y) if residual_grad else y.new_empty(0)
        return dx, dr

    @torch.library.register_fake("inplace_abn::backward_input_from_z_")
    def _(z, y, dy, var, weight, bias, residual, mean_gz, mean_gzx, eps, activation, activation_param, signed_weight,
          residual_grad, sums_scale=1.0, groups=0, dx_out=None):
        return torch.empty_like(y) if residual_grad else y.new_empty(0)

    @torch.library.register_fake("inplace_abn::gn_backward")
    def _(y, dy, mask, var, weight, bias, residual, groups, eps, activation, activation_param, signed_weight,
          residual_grad):
        dr = torch.empty_like(y) if residual_grad else y.new_empty(0)
        C = y.shape[1]
        return torch.empty_like(y), dr, y.new_empty(C, dtype=acc(y)), y.new_empty(C, dtype=acc(y))

    @torch.library.register_fake("inplace_abn::bn_backward")
    def _(y, dy, mask, var, weight, bias, residual, eps, activation, activation_param, signed_weight, training,
          output_mask, relu=False, dx_out=None):
        need_x, need_w, need_b, need_r = output_mask

        def none():  # (a new one each: the outputs alias nothing)
            return y.new_empty(0)

        return (torch.empty_like(y) if need_x and dx_out is None else none(), weight.new_empty(weight.shape) if need_w else none(),
                bias.new_empty(bias.shape) if need_b else none(), torch.empty_like(y) if need_r else none())

    @torch.library.register_fake("inplace_abn::weight_grad")
    def _(sum_gz_xhat, weight, signed_weight):
        return weight.new_empty(weight.shape)


if HAS_NATIVE:
    _register_fakes()
