"""Weight transfer for `convert_model`: a BatchNorm's (GroupNorm's) parameters
and buffers handed to a ``weight_mode="signed"`` in-place layer (see the docstring of
`inplace_abn.convert`, "Weights")."""
import math
from typing import Dict, Tuple

import torch
import torch.nn as nn

from . import _activation
from .abn import InPlaceABN, InPlaceABNSync
from .groupnorm import InPlaceAGN


def bn_weight_to_signed(weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``weight_mode="signed"`` weight that reproduces a BatchNorm weight.

    Returns ``(w2, exact)``: ``w2`` (same dtype as ``weight``) whose scale
    ``sign(w2) * (|w2| + eps)``, computed as the pure-PyTorch backend does
    (in float32, or float64 for float64 weights; sign(0) = +1), is the float
    nearest to ``weight`` that the formula can produce, and ``exact`` where it
    equals ``weight`` bit for bit (the native kernels, which form the scale in
    double, are then within one float32 ulp, and exact for float64). That is everywhere ``|weight| >= eps`` except on
    rounding ties (then one ulp off; see the module docstring). Where
    ``|weight| < eps`` the scale is ``sign(weight) * eps`` (w2 = 0, or for a
    negative weight a negative number too small to change ``|w2| + eps``).
    Half-precision weights are rounded once more on the way back.
    """
    acc = _activation.acc_dtype(weight.dtype)
    w = weight.detach().to(acc)
    a = w.abs()
    zero = torch.zeros((), dtype=acc, device=w.device)
    inf = torch.full((), math.inf, dtype=acc, device=w.device)
    c = (a.double() - eps).to(acc).clamp(min=0)
    # The kernels compute |w2| + eps in acc with eps rounded to acc (a tensor
    # plus a Python float does the same). Walk c by one ulp until it lands.
    for _ in range(16):
        g = c + eps
        low, high = g < a, (g > a) & (c > 0)
        if not bool((low | high).any()):
            break
        c = torch.where(low, torch.nextafter(c, inf), torch.where(high, torch.nextafter(c, zero), c))
    exact = (c + eps) == a
    # Negative weights keep their sign even when c is 0: sign(-0.0) is +1 for
    # the kernels, so use a negative number too small to change |w2| + eps.
    tiny = eps * torch.finfo(acc).eps / 8
    c = torch.where(w < 0, -torch.where(c > 0, c, torch.full_like(c, tiny)), c)
    return c.to(weight.dtype), exact


def load_batchnorm_state_dict(model: nn.Module, state_dict: Dict[str, torch.Tensor], strict: bool = True):
    """Load a state dict of the ORIGINAL (BatchNorm / GroupNorm) model into a converted model.

    The keys match as they are; the weights of signed-mode in-place layers
    (`InPlaceABN`, `InPlaceAGN`) are
    mapped with `bn_weight_to_signed` on the way (the converted model's own
    checkpoints load with the ordinary ``load_state_dict``).
    """
    state_dict = dict(state_dict)
    for name, m in model.named_modules():
        key = f"{name}.weight" if name else "weight"
        if isinstance(m, (InPlaceABN, InPlaceAGN)) and m.weight_mode == "signed" and key in state_dict:
            state_dict[key] = bn_weight_to_signed(state_dict[key], m.eps)[0]
    return model.load_state_dict(state_dict, strict=strict)


def make_layer(norm: nn.Module, activation: str, param: float) -> Tuple[nn.Module, int]:
    """The in-place layer replacing ``norm`` (an `InPlaceABN` / `InPlaceABNSync`
    for a BatchNorm, an `InPlaceAGN` for a GroupNorm) and its count of channels
    with |weight| <= eps. It takes over the norm's Parameter and buffer objects
    (the weight rewritten in place by `bn_weight_to_signed`) and its mode."""
    common = dict(eps=norm.eps, affine=norm.affine, activation=activation, activation_param=param,
                  weight_mode="signed")
    if isinstance(norm, nn.GroupNorm):
        layer = InPlaceAGN(norm.num_groups, norm.num_channels, **common)
    else:
        kwargs = dict(common, momentum=norm.momentum, track_running_stats=norm.track_running_stats)
        if isinstance(norm, nn.SyncBatchNorm):
            layer = InPlaceABNSync(norm.num_features, group=norm.process_group, **kwargs)
        else:
            layer = InPlaceABN(norm.num_features, **kwargs)
        if norm.track_running_stats:
            layer.running_mean, layer.running_var = norm.running_mean, norm.running_var
            layer.num_batches_tracked = norm.num_batches_tracked
    small = 0
    if norm.affine:
        with torch.no_grad():
            w2, exact = bn_weight_to_signed(norm.weight, norm.eps)
            small = int((~exact).sum())
            norm.weight.copy_(w2)  # same Parameter objects: optimizers built on them keep working
        layer.weight, layer.bias = norm.weight, norm.bias
    layer.train(norm.training)
    return layer, small
