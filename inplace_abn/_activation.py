"""Activation names, codes and parameter checks shared by every layer.

The element-wise math itself lives in ``src/activations.h`` (native kernels)
and, for the pure-PyTorch backend, in ``_pure.py``.
"""
import warnings

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


def is_invertible(activation: str, activation_param: float) -> bool:
    """Whether y = f(z) determines z, which the in-place backward needs."""
    return not (activation == "relu" or (activation == "leaky_relu" and activation_param == 0))


_warned_not_invertible = False


def warn_not_invertible(activation: str, activation_param: float) -> None:
    """Warn once per process that an in-place layer saves no memory."""
    global _warned_not_invertible
    if _warned_not_invertible:
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
