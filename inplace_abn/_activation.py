"""The single Python source of the per-layer formulas shared by every module:
activation names, codes and parameter checks, the stock-operator activation
(``apply``), the effective weight g~ and the accumulation dtype.

The in-place element-wise math (forward, inverse, derivative) lives in
``src/activations.h`` (native kernels) and, for the pure-PyTorch backend, in
``_pure.py``; see docs/DESIGN.md.
"""
import warnings

import torch
import torch.nn.functional as F

IDENTITY, LEAKY_RELU, ELU, SILU = 0, 1, 2, 3

# Names accepted by the in-place layers; "swish" is an alias of "silu".
CODES = {"identity": IDENTITY, "leaky_relu": LEAKY_RELU, "elu": ELU, "silu": SILU, "swish": SILU}
# "relu" is accepted too: it is not invertible, see `is_invertible`.
NAMES = ("identity", "relu", "leaky_relu", "elu", "silu", "swish")


def check(activation: str, activation_param: float) -> None:
    """Raise a clear error for an unknown activation or an invalid parameter."""
    if activation not in NAMES:
        raise ValueError(f"Unknown activation {activation!r}: expected one of {', '.join(NAMES)}")
    if activation == "leaky_relu" and not activation_param >= 0:
        raise ValueError(
            f"leaky_relu needs a non-negative slope, got activation_param={activation_param} "
            "(a slope > 0 keeps the layer invertible)"
        )
    if activation == "elu" and not activation_param > 0:
        raise ValueError(f"elu needs alpha > 0, got activation_param={activation_param}")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and per-channel coefficients are computed in:
    float64 for float64 inputs, float32 for everything else (float16, bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def effective_weight(weight: torch.Tensor, eps: float, signed: bool) -> torch.Tensor:
    """The scale g~ the layers apply, from the stored (C,) ``weight``.

    ``abs`` mode (``signed=False``, the original library's convention):
    g~ = |weight| + eps. ``signed`` mode: g~ = sign(weight) (|weight| + eps)
    with sign(0) = +1, so standard BatchNorm weights load unchanged. Computed
    in ``weight``'s dtype (convert first for another one). Under autograd the
    derivative is the one the in-place backward uses: sign(weight) in abs mode
    (0 at 0), 1 everywhere in signed mode.
    """
    g = weight.abs() + eps
    if not signed:
        return g
    g = torch.where(weight < 0, -g, g)
    if weight.requires_grad:  # d g~ / d weight = 1, also at weight = 0 where abs' is 0
        g = g.detach() + (weight - weight.detach())
    return g


def apply(z: torch.Tensor, activation: str, activation_param: float, inplace: bool = False) -> torch.Tensor:
    """f(z) with the stock torch.nn.functional operators (any shape).

    The reference and export form of every activation name, ``relu`` included.
    """
    if activation == "relu":
        return F.relu(z, inplace=inplace)
    if activation == "leaky_relu":
        return F.leaky_relu(z, negative_slope=activation_param, inplace=inplace)
    if activation == "elu":
        return F.elu(z, alpha=activation_param, inplace=inplace)
    if activation in ("silu", "swish"):
        return F.silu(z, inplace=inplace)
    if activation == "identity":
        return z
    raise ValueError(f"Unknown activation {activation!r}: expected one of {', '.join(NAMES)}")


def is_invertible(activation: str, activation_param: float) -> bool:
    """Whether y = f(z) determines z, which the in-place backward needs."""
    return not (activation == "relu" or (activation == "leaky_relu" and activation_param == 0))


_warned_not_invertible = False


def warn_not_invertible(activation: str, activation_param: float) -> None:
    """Warn once per process that an in-place layer saves no memory. Not while torch.compile
    traces: dynamo cannot trace ``warnings.warn``, and ``fullgraph=True`` would fail on it
    (the layer's eager calls warn)."""
    global _warned_not_invertible
    if _warned_not_invertible or torch.compiler.is_compiling():
        return
    _warned_not_invertible = True
    what = "relu" if activation == "relu" else f"leaky_relu with slope {activation_param}"
    warnings.warn(
        f"In-place ABN with {what} is not invertible: the layer keeps a copy of its pre-activation "
        "for backward, so it computes correct gradients but saves no memory. Use leaky_relu with "
        "a slope > 0 (e.g. activation_param=0.01) to restore the memory saving.",
        RuntimeWarning,
        stacklevel=4,
    )
