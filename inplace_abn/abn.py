"""Modules: ABN (BatchNorm + activation, not in place), InPlaceABN and
InPlaceABNSync. Constructor arguments and state-dict keys are those of the
original inplace_abn package, so its code and checkpoints work unchanged.
"""
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _activation
from .functions import WEIGHT_MODES, _apply, count_batch, inplace_abn_sync, module_affine, refuse_torchscript


class ABN(nn.Module):
    """Activated Batch Normalization: stock BatchNorm followed by an activation.

    The non-in-place reference layer (it accepts ``relu`` too). Input
    (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W); output the same shape.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance.
        momentum: running-statistics momentum, or None for a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics (else batch statistics
            are used in eval mode too).
        activation: ``identity``, ``relu``, ``leaky_relu``, ``elu``, ``silu``/``swish``.
        activation_param: leaky_relu slope or elu alpha.
        device, dtype (keyword only): where and in which dtype the parameters
            and running statistics are created, as for torch.nn.BatchNorm2d
            (``device="meta"`` for deferred initialisation).
    """

    _version = 2
    __prepare_scriptable__ = refuse_torchscript

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _activation.check(activation, activation_param)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.activation = activation
        self.activation_param = activation_param
        if affine:
            self.weight = nn.Parameter(torch.empty(num_features, **factory_kwargs))
            self.bias = nn.Parameter(torch.empty(num_features, **factory_kwargs))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory_kwargs))
            self.register_buffer("running_var", torch.ones(num_features, **factory_kwargs))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def _batch_state(self):
        """(momentum, use batch statistics, running_mean, running_var, counter) for
        this call, as torch.nn.BatchNorm computes them. ``counter`` is the
        num_batches_tracked to count the batch in once the layer has run
        (`functions.count_batch`; None: not counted), so that an input the layer refuses
        leaves it, like the running statistics, as it was.

        The buffers are read from ``_buffers`` itself: each ``self.running_mean``
        is an nn.Module.__getattr__ call, 0.6 us, and a small layer's whole
        forward is ~20 us (benchmarks/bench_cpu.py --quick). ``_buffers`` is what
        __getattr__, load_state_dict and torch.func.functional_call read and write.
        """
        training, track = self.training, self.track_running_stats
        buffers = self._buffers
        running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
        counter = buffers.get("num_batches_tracked") if training and track else None
        momentum = self.momentum
        if momentum is None:
            momentum = 1.0 / float(counter + 1) if counter is not None else 0.0
        use_batch_stats = training or running_mean is None
        if training and not track:
            running_mean = running_var = None
        return momentum, use_batch_stats, running_mean, running_var, counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        momentum, training, running_mean, running_var, counter = self._batch_state()
        x = F.batch_norm(x, running_mean, running_var, self.weight, self.bias, training, momentum, self.eps)
        return self._activate(count_batch(x, counter))

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's activation with the stock in-place functions (x is a fresh BN output)."""
        return _activation.apply(x, self.activation, self.activation_param, inplace=True)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Checkpoints of the original library before its version 2 have no
        # num_batches_tracked: keep the layer's own count (0 for a new layer), as
        # torch.nn.modules.batchnorm._NormBase does; 0 on the meta device.
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        if (version is None or version < 2) and self.track_running_stats and key not in state_dict:
            current = self.num_batches_tracked
            keep = current is not None and current.device != torch.device("meta")
            state_dict[key] = current if keep else torch.tensor(0, dtype=torch.long)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        rep = (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
               f"activation={self.activation}")
        if self.activation in ("leaky_relu", "elu"):
            rep += f"[{self.activation_param}]"
        return rep


class InPlaceABN(ABN):
    """In-Place Activated Batch Normalization.

    BatchNorm + activation fused into one operation that overwrites its input
    and keeps only its output for backward (about half the activation memory
    of BatchNorm followed by an activation). Same arguments as `ABN`, plus:

    Args:
        weight_mode: ``"abs"`` (default, compatible with the original library:
            the effective scale is |weight| + eps) or ``"signed"``
            (sign(weight)(|weight| + eps): standard BatchNorm weights load
            unchanged).
        preserve_input: keep x and return the output in a new tensor, still
            keeping only the output for backward (see `inplace_abn.functions.inplace_abn`):
            for an input that is read again after the layer.

    ``forward(x, residual=None)``: x of shape (N, C, ...) is overwritten with
    f(BN(x) + residual) and returned. relu (or leaky_relu with slope 0) is not
    invertible: such a layer stays correct but saves no memory, and warns once.
    """

    preserve_input = False  # default for layers pickled before the attribute existed

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        weight_mode: str = "abs",
        *,
        preserve_input: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
                         device=device, dtype=dtype)
        if weight_mode not in WEIGHT_MODES:
            raise ValueError(f"weight_mode must be 'abs' or 'signed', got {weight_mode!r}")
        self.weight_mode = weight_mode
        self.preserve_input = preserve_input

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        momentum, training, running_mean, running_var, counter = self._batch_state()
        weight, bias = module_affine(self)
        return _apply(x, weight, bias, running_mean, running_var, training, momentum, self.eps, self.activation,
                      self.activation_param, residual, self.weight_mode, None, counter,
                      self.preserve_input)

    def extra_repr(self) -> str:
        rep = super().extra_repr() + (", weight_mode=signed" if self.weight_mode == "signed" else "")
        return rep + (", preserve_input=True" if self.preserve_input else "")


class InPlaceABNSync(InPlaceABN):
    """`InPlaceABN` with batch statistics synchronised over a process group.

    Every rank of ``group`` (default: the world group) must run the layer;
    batch and spatial sizes may differ per rank (even be empty), channels may
    not. Without an initialised torch.distributed it runs like `InPlaceABN`
    (one warning). Eval mode runs no collective: it uses the running
    statistics, or local batch statistics with track_running_stats=False.
    See `inplace_abn.functions.inplace_abn_sync` for DDP, buffer broadcasting
    and gradient accumulation under ``no_sync()``.

    Args:
        group: the process group to synchronise over, or None for the world.
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
        weight_mode: str = "abs",
        *,
        preserve_input: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
                         weight_mode, preserve_input=preserve_input, device=device, dtype=dtype)
        self.group = group

    def set_group(self, group: Optional[Any]) -> None:
        """Set the process group to synchronise with (never between forward and backward)."""
        self.group = group

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.training:
            # Eval never synchronises (like torch.nn.SyncBatchNorm), so validation on a
            # subset of ranks cannot hang, even with track_running_stats=False.
            return super().forward(x, residual)
        momentum, training, running_mean, running_var, counter = self._batch_state()
        y = inplace_abn_sync(x, self.weight, self.bias, running_mean, running_var, training, momentum,
                             self.eps, self.activation, self.activation_param, self.group, residual=residual,
                             weight_mode=self.weight_mode, preserve_input=self.preserve_input)
        return count_batch(y, counter)
