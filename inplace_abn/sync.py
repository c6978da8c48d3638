"""Synchronised layers for data-parallel training: `convert_sync` and `ABNSync`.

``convert_sync(model)`` is to this package what
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` is to torch: call it before
wrapping the model in DistributedDataParallel, launch with ``torchrun`` (one
or many nodes) and initialise the process group as usual::

    model = inplace_abn.convert_sync(model)              # or (model, process_group)
    model = DistributedDataParallel(model.cuda(), device_ids=[local_rank])

What each layer becomes:

- `InPlaceABN` (and `InPlaceABNSync`) -> `InPlaceABNSync`: same computation,
  same memory saving, statistics over the group.
- `ABN` -> `ABNSync` (default, ``abn="exact"``): stock BatchNorm math with the
  layer's weight used as it is, statistics over the group, not in place. It
  computes exactly what `ABN` computes on the concatenated batch, accepts
  ``relu``, and uses the memory of `ABN`.
- `ABN` -> `InPlaceABNSync(weight_mode="signed")` with ``abn="inplace"``: saves
  memory, but the in-place layer scales by sign(w)(|w| + eps) instead of w
  (the backward divides by the scale, so it must stay away from 0): each
  channel's output differs from `ABN`'s by eps * |xhat| (relative eps/|w|,
  1e-5 for |w| = 1 and the default eps), and a weight near 0 behaves like
  +-eps instead of 0. A ``relu`` layer stays correct but saves no memory.

Parameters and buffers are the original tensors (not copies), so optimisers
built before the conversion keep working and state dicts keep their keys.

Every synchronised layer runs one collective per training forward (plus one
while the group learns the buffer lengths its calls need, see
inplace_abn/_distributed.py) and one per backward on every rank of its group
(so every rank must run the same layers in the same order, forward and
backward). Under DDP's ``no_sync()``
(gradient accumulation) they still do: ``no_sync`` only defers DDP's gradient
all_reduce, and each micro-batch is normalised with its statistics over all
ranks. Eval mode runs no collective.
"""
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _activation, _distributed
from .abn import ABN, InPlaceABN, InPlaceABNSync
from .functions import count_batch, update_running_stats

_acc = _activation.acc_dtype


def _pc(v, nd):
    return v.view((1, -1) + (1,) * (nd - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """z = w (x - mu) / sqrt(var + eps) + b with (mu, var) over the group; not in place.

    Same protocol as the in-place layer (docs/DESIGN.md section 4): one float64
    all_reduce of the statistics forward, one of 2C values backward. The
    element-wise work runs through PyTorch's fused batch_norm kernels (in
    their eval form, fed the global statistics).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group):
        C, nd = x.shape[1], x.dim()
        acc = _acc(x.dtype)
        count = x.numel() // C if C else 0
        xa = x.to(acc)  # no copy for float32 / float64
        if count:
            dims = [0] + list(range(2, nd))
            mean = xa.mean(dims)
            d = xa - _pc(mean, nd)
            var = (d * d).mean(dims)  # two-pass: exact for data far from 0
            del d
        else:
            mean, var = xa.new_zeros(C), xa.new_zeros(C)
        mean, var, n = _distributed.reduce_stats(mean, var, count, group, running_mean)
        update_running_stats(mean, var, n, running_mean, running_var, momentum, x.shape, synced=True)
        w = None if weight is None else weight.detach().to(acc)
        b = None if bias is None else bias.detach().to(acc)
        z = F.batch_norm(xa, mean, var, w, b, False, 0.0, eps).to(x.dtype)
        ctx.save_for_backward(x, mean, var, weight)
        ctx.n, ctx.group, ctx.eps = n, group, eps
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dz):
        x, mean, var, weight = ctx.saved_tensors
        n, eps, acc = ctx.n, ctx.eps, mean.dtype
        C = mean.numel()
        w = torch.ones_like(mean) if weight is None else weight.to(acc)
        if x.numel():
            xa, g = x.to(acc), dz.to(acc)
            # eval-form backward: dx_eval = g w r, S_gx = sum g xhat, S_g = sum g (local sums)
            dx, s_gx, s_g = torch.ops.aten.native_batch_norm_backward(
                g, xa, w, mean, var, None, None, False, eps, [True, True, True])
        else:  # (native_batch_norm_backward divides by zero on empty inputs)
            xa, dx, s_gx, s_g = None, None, mean.new_zeros(C), mean.new_zeros(C)
        # Every rank takes part, whether or not it needs dx.
        t_g, t_gx = _distributed.reduce_grad_sums(s_g, s_gx, ctx.group)
        grad_x = dw = db = None
        if ctx.needs_input_grad[0]:
            if xa is None:
                grad_x = torch.zeros_like(x)
            else:
                # dx = w r (g - T_g/n - xhat T_gx/n): subtract (x - mu) r (r w T_gx/n) + w r T_g/n,
                # evaluated centred by the fused eval batch_norm kernel
                r = torch.rsqrt(var + eps)
                corr = F.batch_norm(xa, mean, var, w * r * t_gx / n, w * r * t_g / n, False, 0.0, eps)
                grad_x = dx.sub_(corr).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            dw = s_gx.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            db = s_g.to(mean.dtype if weight is None else weight.dtype)
        return grad_x, dw, db, None, None, None, None, None


_warned_no_dist = False


class ABNSync(ABN):
    """`ABN` (stock BatchNorm + activation, not in place) with batch statistics
    synchronised over a process group.

    Computes exactly what `ABN` computes on the batch of all ranks together:
    the weight is used as it is (no eps, any sign), ``relu`` is accepted, and
    the memory is that of `ABN`. Same protocol and rules as `InPlaceABNSync`:
    one float64 all_reduce of the statistics per training forward and one of 2C
    values per backward; every rank of the group runs forward and backward;
    batch and spatial sizes may differ and be 0, channels may not; running
    statistics use the global count. Eval mode runs no collective (with
    ``track_running_stats=False`` it uses the local batch statistics, as
    torch.nn.SyncBatchNorm does). Without an initialised torch.distributed it
    runs like `ABN` (one warning).

    Args: those of `ABN`, plus
        group: the process group to synchronise over, or None for the world.
        device, dtype: torch's factory arguments, as for torch.nn.BatchNorm2d.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        group: Optional[Any] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
                         device=device, dtype=dtype)
        self.group = group

    def set_group(self, group: Optional[Any]) -> None:
        """Set the process group to synchronise with (never between forward and backward)."""
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _warned_no_dist
        if not self.training:
            return super().forward(x)
        if not (dist.is_available() and dist.is_initialized()):
            if not _warned_no_dist:
                _warned_no_dist = True
                warnings.warn("ABNSync: torch.distributed is not initialized; running the non-synchronized ABN",
                              RuntimeWarning, stacklevel=2)
            return super().forward(x)
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"ABNSync: expected an input of shape (N, {self.num_features}, ...), "
                             f"got {list(x.shape)}")
        group = _distributed.resolve_group(self.group)
        momentum, _, running_mean, running_var, counter = self._batch_state()
        z = _SyncBatchNormFunction.apply(x, self.weight, self.bias, running_mean, running_var, momentum,
                                         float(self.eps), group)
        return self._activate(count_batch(z, counter))


def _common_kwargs(m):
    return dict(eps=m.eps, momentum=m.momentum, affine=m.affine, track_running_stats=m.track_running_stats,
                activation=m.activation, activation_param=m.activation_param)


def _adopt_state(new, old):
    """Make ``new`` use ``old``'s parameters, buffers and mode (the same tensors)."""
    with torch.no_grad():
        for name in ("weight", "bias"):
            setattr(new, name, getattr(old, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            new._buffers[name] = old._buffers.get(name)
    new.training = old.training
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig
    return new


def convert_sync(module: torch.nn.Module, process_group: Optional[Any] = None, abn: str = "exact") -> torch.nn.Module:
    """Replace every `InPlaceABN` and `ABN` in ``module`` by a synchronised layer.

    In the spirit of ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: returns
    ``module`` with its layers replaced (or the new layer, if ``module`` is
    itself one); parameters and buffers are the same tensor objects, and
    activation, activation_param, eps, momentum, affine, track_running_stats,
    weight_mode, preserve_input and the train/eval mode are kept.

    Args:
        module: a model (or a single layer).
        process_group: the group to synchronise over; None for the world
            (resolved at each forward, so the model may be converted before
            ``init_process_group``).
        abn: what `ABN` layers become. ``"exact"`` (default): `ABNSync`, which
            computes exactly what `ABN` computes, without the memory saving.
            ``"inplace"``: `InPlaceABNSync` with ``weight_mode="signed"``,
            which saves memory but scales by sign(w)(|w| + eps) instead of w
            (see the module docstring).

    Returns:
        The converted module.
    """
    if abn not in ("exact", "inplace"):
        raise ValueError(f"convert_sync: abn must be 'exact' or 'inplace', got {abn!r}")
    out = module
    if isinstance(module, InPlaceABN):
        out = _adopt_state(
            InPlaceABNSync(module.num_features, group=process_group, weight_mode=module.weight_mode,
                           preserve_input=module.preserve_input, **_common_kwargs(module)),
            module)
    elif isinstance(module, ABN):
        if abn == "exact":
            new = ABNSync(module.num_features, group=process_group, **_common_kwargs(module))
        else:
            new = InPlaceABNSync(module.num_features, group=process_group, weight_mode="signed",
                                 **_common_kwargs(module))
        out = _adopt_state(new, module)
    for name, child in module.named_children():
        out.add_module(name, convert_sync(child, process_group, abn))
    return out


__all__ = ["ABNSync", "convert_sync"]
