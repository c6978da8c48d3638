"""Whole-model conversion to In-Place ABN (``convert_model``).

``convert_model`` traces a model with ``torch.fx`` and rewrites, per BatchNorm
module call (in order of preference):

=============  ===========================================  ===========================
pattern        graph before                                 after
=============  ===========================================  ===========================
``bn+add+act`` ``a = f(bn(x) + r)``                         ``a = iabn(x, residual=r)``
``bn+act``     ``a = f(bn(x))``                             ``a = iabn(x)``
``bn+add``     ``s = bn(x) + r`` (no activation after)      ``s = iabn_identity(x, residual=r)``
``bn``         ``z = bn(x)`` (anything else after)          ``z = iabn_identity(x)``
=============  ===========================================  ===========================

``iabn`` is an `InPlaceABN` with ``weight_mode="signed"`` (an `InPlaceABNSync`
for ``nn.SyncBatchNorm``) stored under the BatchNorm's own qualified name, so
state-dict keys do not change. ``f`` is ReLU (mapped to ``activation``, by
default leaky_relu(0.01): ReLU is not invertible), LeakyReLU (slope kept),
ELU (alpha kept) or SiLU, as a module (``nn.ReLU(inplace=True)`` too), a
function (``F.relu``, ``torch.relu``, ``F.silu``, ``F.leaky_relu``, ``F.elu``,
their ``_`` variants) or a method (``x.relu()``).

Every converted layer overwrites its input ``x`` and keeps only its output
(and ``r``) for backward. So a call is converted only when that is safe:

- ``x`` has no reader but the BatchNorm, is not a model input, and comes from
  an operation known to return a fresh tensor (convolution, linear, add, cat,
  pooling, interpolation...), possibly through views whose only reader is
  the next step of the chain;
- a fused activation is the only reader of the BatchNorm (or add) output, and
  the add's output has no reader but the activation;
- the layer's output (and ``r``) is not modified in place later (autograd
  would refuse the backward);
- the BatchNorm module is called once and is a plain ``nn.BatchNorm1d/2d/3d``
  or ``nn.SyncBatchNorm`` with initialised parameters.

Whatever is not converted stays as it was; the `ConversionReport` says what
was converted and why the rest was left.

Weights. With ``weight_mode="signed"`` the layer scales by
``g~ = sign(w')(|w'| + eps)``. The converted weight ``w'`` is chosen so that
``g~`` equals the BatchNorm weight ``w`` bit for bit wherever that is possible
(see `bn_weight_to_signed`): for float64 weights in both backends, for
float32 weights in the pure-PyTorch backend's float32 arithmetic; the native
kernels form ``g~`` in double from the float32 ``w'``, which lands within one
float32 ulp of ``w`` (a relative 6e-8, below float32 rounding noise). Two
cases are not exact in any backend:

- ``|w| < eps`` (e.g. ``zero_init_residual=True``): ``|g~| >= eps`` always,
  so ``g~ = sign(w) * eps``: the scale moves by at most ``eps`` (1e-5 by
  default), the channel's output by at most ``eps * |xhat|``;
- a rounding tie: in a few binades ``fl(c + eps)`` only reaches every second
  float (float32, eps=1e-5: 6.1e-5 <= |w| < 1.2e-4), and then ``g~`` is one
  ulp away from ``w`` for half of those weights. Weights near 1 are exact.

The gradient for ``w'`` equals the BatchNorm's gradient for ``w`` (d g~ / d w'
= 1), so training proceeds as with the BatchNorm, shifted by ``eps`` (a
weight crossing zero makes g~ jump by 2 eps).

Tracing. The default tracer keeps ``torch.nn`` modules and this package's
layers as leaves, and also any module without BatchNorm whose ``forward``
reads ``self.training`` (torchvision's ``StochasticDepth``): tracing into it
would freeze the mode it was traced in. If the traced graph still depends on
the mode, the report carries a warning. As with any ``torch.fx`` conversion,
modules that the forward never calls are not part of the result. Without
``example_inputs`` a tensor added to a BatchNorm output is assumed to have its
shape (a broadcasting add then fails with the layer's clear shape error).
"""
import copy
import inspect
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import _activation
from .abn import ABN, InPlaceABN, InPlaceABNSync

logger = logging.getLogger(__name__)

__all__ = ["convert_model", "ConversionReport", "ConvertedLayer", "LeftLayer", "bn_weight_to_signed",
           "load_batchnorm_state_dict"]

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


# ---- report ------------------------------------------------------------------------------


@dataclass
class ConvertedLayer:
    """One BatchNorm converted to an in-place layer."""

    name: str  # qualified module name (the new layer keeps it)
    pattern: str  # "bn+add+act", "bn+act", "bn+add" or "bn"
    activation: str  # the in-place layer's activation
    activation_param: float
    source: str = ""  # what was fused, e.g. "add + ReLU -> leaky_relu(0.01)"
    note: str = ""  # why a better pattern was not possible, if one was tried
    small_weights: int = 0  # channels with |w| <= eps (scale moved to +-eps)


@dataclass
class LeftLayer:
    """One BatchNorm call left as it was."""

    name: str
    reason: str


@dataclass
class ConversionReport:
    """What `convert_model` converted, and what it left and why. ``str()`` is a table."""

    converted: List[ConvertedLayer] = field(default_factory=list)
    left: List[LeftLayer] = field(default_factory=list)
    shapes_checked: bool = False
    warnings: List[str] = field(default_factory=list)

    def counts(self) -> Dict[str, int]:
        """Number of layers per pattern, plus ``"left"``."""
        out: Dict[str, int] = {}
        for c in self.converted:
            out[c.pattern] = out.get(c.pattern, 0) + 1
        out["left"] = len(self.left)
        return out

    def summary(self) -> str:
        c = self.counts()
        parts = [f"{c[p]} {p}" for p in ("bn+add+act", "bn+act", "bn+add", "bn") if c.get(p)]
        text = (f"converted {len(self.converted)} BatchNorm layers to InPlaceABN"
                f"{' (' + ', '.join(parts) + ')' if parts else ''}; left {c['left']}")
        small = sum(x.small_weights for x in self.converted)
        if small:
            text += f"; {small} channels had |weight| <= eps (scale set to +-eps)"
        return text

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.converted:
            w = max(len(c.name) for c in self.converted)
            lines.append("converted:")
            for c in self.converted:
                act = c.activation + (f"({c.activation_param:g})" if c.activation in ("leaky_relu", "elu") else "")
                extra = f"  [{c.note}]" if c.note else ""
                lines.append(f"  {c.name:<{w}}  {c.pattern:<10}  {act:<17}  {c.source}{extra}")
        if self.left:
            w = max(len(x.name) for x in self.left)
            lines.append("left as they were:")
            for x in self.left:
                lines.append(f"  {x.name:<{w}}  {x.reason}")
        lines += [f"warning: {w}" for w in self.warnings]
        if self.converted and not self.shapes_checked:
            lines.append("(residual shapes were not checked: pass example_inputs to check them)")
        return "\n".join(lines)

    __repr__ = __str__


# ---- weights -----------------------------------------------------------------------------


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
    """Load a state dict of the ORIGINAL (BatchNorm) model into a converted model.

    The keys match as they are; the weights of signed-mode in-place layers are
    mapped with `bn_weight_to_signed` on the way (the converted model's own
    checkpoints load with the ordinary ``load_state_dict``).
    """
    state_dict = dict(state_dict)
    for name, m in model.named_modules():
        key = f"{name}.weight" if name else "weight"
        if isinstance(m, InPlaceABN) and m.weight_mode == "signed" and key in state_dict:
            state_dict[key] = bn_weight_to_signed(state_dict[key], m.eps)[0]
    return model.load_state_dict(state_dict, strict=strict)


# ---- graph analysis ----------------------------------------------------------------------

_RELU_FUNCS = {F.relu, torch.relu, torch.relu_, F.relu_}
_LEAKY_FUNCS = {F.leaky_relu, F.leaky_relu_}
_ELU_FUNCS = {F.elu, F.elu_}
_SILU_FUNCS = {F.silu}
_ADD_FUNCS = {operator.add, operator.iadd, torch.add}

# Operations known to return a newly allocated tensor that they do not save for
# their own backward (overwriting it must break neither another reader nor autograd).
_FRESH_MODULES = (
    nn.modules.conv._ConvNd, nn.Linear, nn.Bilinear, nn.Embedding, nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd, nn.Upsample, nn.LayerNorm, nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm, nn.modules.batchnorm._BatchNorm, nn.GELU, nn.SiLU, nn.Hardswish,
    nn.LeakyReLU, nn.Mish,
)
_POOL_MAX_MODULES = (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)
_FRESH_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.matmul, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.matmul, torch.bmm, torch.cat, torch.concat, torch.stack,
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.linear,
    F.interpolate, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm, F.gelu, F.silu,
    F.hardswish, F.leaky_relu, F.mish, torch.mean, torch.sum, torch.amax, torch.amin,
}
_FRESH_METHODS = {"add", "sub", "mul", "div", "matmul", "clone", "__add__", "__mul__", "__sub__", "mean", "sum",
                  "amax", "amin", "std", "var", "norm"}
# Operations whose output may be (a view of) their first argument.
_ALIAS_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)
_ALIAS_FUNCS = {torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze,
                torch.narrow, torch.select, operator.getitem, torch.detach, F.dropout, F.dropout1d, F.dropout2d,
                F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_ALIAS_METHODS = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose", "t",
                  "squeeze", "unsqueeze", "contiguous", "narrow", "select", "expand", "expand_as", "detach",
                  "__getitem__", "to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda"}
_INPLACE_FUNCS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}


def _callable_name(node: fx.Node, modules: Dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"{type(modules[node.target]).__name__} {node.target}"
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}()"
    return node.op


def _is_inplace(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether the node modifies its first argument in place."""
    if node.op == "call_module":
        return bool(getattr(modules[node.target], "inplace", False))
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (node.target in _INPLACE_FUNCS or bool(node.kwargs.get("inplace", False))
                or (name.endswith("_") and not name.endswith("__")))
    if node.op == "call_method":
        t = node.target
        return (t.endswith("_") and not t.endswith("__")) or t in ("__setitem__", "__iadd__", "__imul__")
    return False


def _aliases_input(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether the node's output may alias its first argument."""
    if _is_inplace(node, modules):
        return True
    if node.op == "call_module":
        return isinstance(modules[node.target], _ALIAS_MODULES)
    if node.op == "call_function":
        return node.target in _ALIAS_FUNCS
    if node.op == "call_method":
        return node.target in _ALIAS_METHODS
    return False


def _is_fresh(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether the node is known to return a newly allocated tensor."""
    if _is_inplace(node, modules):
        return False
    if node.op == "call_module":
        m = modules[node.target]
        if isinstance(m, _POOL_MAX_MODULES):
            return not getattr(m, "return_indices", False)
        return isinstance(m, _FRESH_MODULES)
    if node.op == "call_function":
        return node.target in _FRESH_FUNCS
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    return False


def _input_problem(x: fx.Node, bn: fx.Node, modules) -> Optional[str]:
    """None when the BatchNorm's input may be overwritten, else why not."""
    chain, node = bn, x
    while True:
        others = [u for u in node.users if u is not chain]
        if others:
            what = "input" if node is x else f"input's base {node.name}"
            return f"its {what} is also read by {', '.join(u.name for u in others)}"
        if node.op == "placeholder":
            return "its input is a model input (the caller's tensor would be overwritten)"
        if node.op == "get_attr":
            return "its input is a parameter or buffer"
        if _is_fresh(node, modules):
            return None
        if _is_inplace(node, modules):
            return (f"its input is the result of the in-place {_callable_name(node, modules)}, which its "
                    "backward may need")
        if _aliases_input(node, modules) and node.args and isinstance(node.args[0], fx.Node):
            chain, node = node, node.args[0]
            continue
        return f"its input comes from {_callable_name(node, modules)}, not known to return a fresh tensor"


def _alias_readers(node: fx.Node, modules) -> List[Tuple[fx.Node, fx.Node]]:
    """(reader, what it reads) for every node reading ``node`` or a possible alias of it."""
    out, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if (u, n) in seen:
                continue
            seen.add((u, n))
            out.append((u, n))
            known = _is_fresh(u, modules)
            if u.args and u.args[0] is n and not known:
                todo.append(u)  # a view, or an unknown operation that may return n itself
    return out


def _modified_in_place(node: fx.Node, modules) -> Optional[str]:
    """The first node that modifies ``node`` (or an alias of it) in place, described."""
    for u, n in _alias_readers(node, modules):
        if u.args and u.args[0] is n and _is_inplace(u, modules):
            return f"{u.name} ({_callable_name(u, modules)})"
    return None


def _number(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _match_activation(node: fx.Node, src: fx.Node, modules, relu_to) -> Optional[Tuple[str, Any, str]]:
    """(activation, param or None if not a constant, description) when ``node`` applies a
    supported activation to ``src``; None otherwise. ReLU is mapped to ``relu_to``."""
    found = _find_activation(node, src, modules)
    if found is None:
        return None
    act, param, desc = found
    if act == "relu":
        return relu_to[0], relu_to[1], f"{desc} -> {relu_to[0]}({relu_to[1]:g})"
    return act, param, desc


def _find_activation(node: fx.Node, src: fx.Node, modules) -> Optional[Tuple[str, Any, str]]:
    if not node.args or node.args[0] is not src:
        return None

    def arg(i, key, default):
        if len(node.args) > i:
            return _number(node.args[i])
        return _number(node.kwargs.get(key, default))

    if node.op == "call_module":
        m = modules[node.target]
        kind = type(m)
        if kind is nn.ReLU:
            return "relu", 0.0, "ReLU"
        if kind is nn.LeakyReLU:
            return "leaky_relu", _number(m.negative_slope), f"LeakyReLU({m.negative_slope:g})"
        if kind is nn.ELU:
            return "elu", _number(m.alpha), f"ELU({m.alpha:g})"
        if kind is nn.SiLU:
            return "silu", 0.0, "SiLU"
        return None
    if node.op == "call_function":
        t = node.target
        name = getattr(t, "__name__", str(t))
        if t in _RELU_FUNCS:
            return "relu", 0.0, name
        if t in _LEAKY_FUNCS:
            return "leaky_relu", arg(1, "negative_slope", 0.01), name
        if t in _ELU_FUNCS:
            return "elu", arg(1, "alpha", 1.0), name
        if t in _SILU_FUNCS:
            return "silu", 0.0, name
        return None
    if node.op == "call_method" and node.target in ("relu", "relu_"):
        return "relu", 0.0, f".{node.target}()"
    return None


def _match_add(node: fx.Node, src: fx.Node) -> Optional[fx.Node]:
    """The other operand when ``node`` is ``src + other`` with ``other`` a tensor node."""
    if node.op == "call_function" and node.target in _ADD_FUNCS:
        pass
    elif node.op == "call_method" and node.target in ("add", "add_", "__add__", "__iadd__"):
        pass
    else:
        return None
    if len(node.args) != 2:
        return None
    if any(k != "alpha" for k in node.kwargs) or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if node.op == "call_method" and a is not src:
        return None  # other.add_(bn): in place on the shortcut
    other = b if a is src else a if b is src else None
    if not isinstance(other, fx.Node) or other is src or other.op == "get_attr":
        return None
    return other


def _act_problem(act: str, param) -> Optional[str]:
    if param is None:
        return "its parameter is not a constant"
    try:
        _activation.check(act, param)
    except ValueError as e:
        return str(e)
    if not _activation.is_invertible(act, param):
        return f"{act}({param:g}) is not invertible (an in-place layer would save no memory)"
    return None


def _tensor_meta(node: fx.Node):
    return node.meta.get("tensor_meta", None)


def _same_shape(a: fx.Node, b: fx.Node) -> Optional[str]:
    ma, mb = _tensor_meta(a), _tensor_meta(b)
    if ma is None or mb is None:
        return None
    if tuple(ma.shape) != tuple(mb.shape):
        return f"the shortcut's shape {list(mb.shape)} differs from the BatchNorm output's {list(ma.shape)}"
    if ma.dtype != mb.dtype:
        return f"the shortcut's dtype {mb.dtype} differs from the BatchNorm output's {ma.dtype}"
    return None


# ---- tracing -----------------------------------------------------------------------------


def _reads_training(cls: type) -> bool:
    """Whether ``cls.forward``'s source mentions ``self.training``."""
    if cls not in _READS_TRAINING:
        try:
            _READS_TRAINING[cls] = "self.training" in inspect.getsource(cls.forward)
        except (OSError, TypeError):
            _READS_TRAINING[cls] = False
    return _READS_TRAINING[cls]


_READS_TRAINING: Dict[type, bool] = {}


class _Tracer(fx.Tracer):
    """fx's default tracer, plus leaves: the package's own layers, and modules
    without BatchNorm whose forward reads ``self.training`` (tracing into them
    would freeze the mode they were traced in, e.g. torchvision's
    StochasticDepth would keep dropping paths in eval mode)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, ABN) or super().is_leaf_module(m, qualname):
            return True
        return _reads_training(type(m)) and not any(isinstance(s, nn.modules.batchnorm._BatchNorm)
                                                    for s in m.modules())


def _trace(model: nn.Module, tracer: Optional[fx.Tracer], concrete_args) -> Tuple[fx.Graph, nn.Module, bool]:
    """(graph, root, mode_dependent): the graph of ``model`` in its current
    mode, and whether tracing in the other mode gives a different graph."""
    tr = tracer if tracer is not None else _Tracer()
    graph = tr.trace(model, concrete_args)
    root = tr.root
    modes = {m: m.training for m in model.modules()}
    try:
        other = type(tr)() if tracer is not None else _Tracer()
        model.train(not model.training)
        other_graph = other.trace(model, concrete_args)
        differs = other_graph.python_code("self").src != graph.python_code("self").src
    except Exception:  # a custom tracer that cannot be rebuilt: no check
        differs = False
    finally:
        for m, t in modes.items():
            m.training = t
    return graph, root, differs


def _set_submodule(root: nn.Module, target: str, module: nn.Module) -> None:
    *path, name = target.split(".")
    parent = root.get_submodule(".".join(path)) if path else root
    setattr(parent, name, module)


def _make_layer(bn: nn.Module, activation: str, param: float) -> Tuple[InPlaceABN, int]:
    kwargs = dict(eps=bn.eps, momentum=bn.momentum, affine=bn.affine, track_running_stats=bn.track_running_stats,
                  activation=activation, activation_param=param, weight_mode="signed")
    if isinstance(bn, nn.SyncBatchNorm):
        layer = InPlaceABNSync(bn.num_features, group=bn.process_group, **kwargs)
    else:
        layer = InPlaceABN(bn.num_features, **kwargs)
    small = 0
    if bn.affine:
        with torch.no_grad():
            w2, exact = bn_weight_to_signed(bn.weight, bn.eps)
            small = int((~exact).sum())
            bn.weight.copy_(w2)  # same Parameter objects: optimizers built on them keep working
        layer.weight, layer.bias = bn.weight, bn.bias
    if bn.track_running_stats:
        layer.running_mean, layer.running_var = bn.running_mean, bn.running_var
        layer.num_batches_tracked = bn.num_batches_tracked
    layer.train(bn.training)
    return layer, small


# ---- the converter -----------------------------------------------------------------------


def convert_model(
    model: nn.Module,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    *,
    residual: bool = True,
    standalone: bool = True,
    example_inputs: Optional[Sequence[Any]] = None,
    inplace: bool = False,
    tracer: Optional[fx.Tracer] = None,
    concrete_args: Optional[Dict[str, Any]] = None,
    return_report: bool = False,
) -> Union[fx.GraphModule, Tuple[fx.GraphModule, ConversionReport]]:
    """Rewrite BatchNorm (+ add) + activation chains of ``model`` as in-place layers.

    See the module docstring for the patterns and the safety rules.

    Args:
        model: the model; traced with ``torch.fx`` (``tracer`` / ``concrete_args``
            as for ``torch.fx.Tracer.trace``).
        activation, activation_param: what ReLU becomes (ReLU is not
            invertible). LeakyReLU, ELU and SiLU keep their own parameters.
        residual: fuse ``bn(x) + r`` (and a following activation) into one layer.
        standalone: convert a BatchNorm with no fusable activation into an
            in-place layer with the identity activation (it then saves its
            output instead of its input, a buffer its consumer often saves
            anyway). False leaves such BatchNorms alone.
        example_inputs: optional inputs (tuple) used to check the shapes and
            dtypes of residual adds by running the model in eval mode under
            ``torch.no_grad()`` (running statistics are not touched).
            Without them, a tensor added to a BatchNorm output is assumed to
            have its shape (a broadcasting add then raises a clear error in
            the layer).
        inplace: convert ``model`` itself (its BatchNorm weights are rewritten
            and its modules shared with the result) instead of a deep copy.
        return_report: also return the `ConversionReport`.

    Returns:
        A ``torch.fx.GraphModule`` (an ordinary ``nn.Module``: train it, save
        its ``state_dict``, switch it to eval) with the original parameter and
        buffer names, and the report when ``return_report``. The report's
        summary is also logged (logger ``inplace_abn.convert``, level INFO).
    """
    _activation.check(activation, activation_param)
    if not inplace:
        model = copy.deepcopy(model)
    graph, root, mode_dependent = _trace(model, tracer, concrete_args)
    gm = fx.GraphModule(root, graph, model.__class__.__name__)
    # GraphModule rebuilds the module tree above the leaves as plain Modules: keep their modes.
    for qual, m in gm.named_modules():
        try:
            m.training = model.get_submodule(qual).training if qual else model.training
        except AttributeError:
            pass

    report = ConversionReport()
    if mode_dependent:
        report.warnings.append(
            f"the traced graph depends on the train/eval mode (a traced forward reads self.training): the "
            f"converted model keeps the {'training' if model.training else 'eval'}-mode graph in both modes. "
            "Make such modules leaves (tracer=...) or convert in the mode you will run")
        logger.warning("convert_model: %s", report.warnings[-1])
    if example_inputs is not None:
        from torch.fx.passes.shape_prop import ShapeProp

        modes = {m: m.training for m in gm.modules()}
        try:
            gm.eval()
            with torch.no_grad():
                ShapeProp(gm).propagate(*example_inputs)
        finally:
            for m, t in modes.items():
                m.training = t
        report.shapes_checked = True

    modules = dict(gm.named_modules())
    relu_to = (activation, activation_param)
    calls: Dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1

    for bn in list(gm.graph.nodes):
        if bn.op == "call_function" and bn.target in (F.batch_norm, torch.batch_norm):
            report.left.append(LeftLayer(bn.name, "functional batch_norm (no module to hold an in-place layer)"))
            continue
        if bn.op != "call_module" or not isinstance(modules[bn.target], nn.modules.batchnorm._BatchNorm):
            continue
        module = modules[bn.target]
        target = bn.target
        reason = None
        if type(module) not in _BN_TYPES:
            reason = f"{type(module).__name__} is not a plain BatchNorm"
        elif any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
            reason = "lazy module not initialised yet"
        elif calls[target] > 1:
            if any(x.name == target for x in report.left):
                continue  # reported at its first call
            reason = f"the module is called {calls[target]} times"
        elif len(bn.args) != 1 or bn.kwargs or not isinstance(bn.args[0], fx.Node):
            reason = "unexpected call arguments"
        else:
            reason = _input_problem(bn.args[0], bn, modules)
        if reason:
            report.left.append(LeftLayer(target, reason))
            continue

        # Candidates in order of preference: (pattern, activation, param, act node, add node, shortcut, source)
        notes: List[str] = []
        users = list(bn.users)
        candidates = []
        if len(users) == 1:
            user = users[0]
            shortcut = _match_add(user, bn) if residual else None
            if shortcut is not None:
                problem = _same_shape(bn, shortcut)
                if problem:
                    notes.append(problem)
                else:
                    add_users = list(user.users)
                    act = _match_activation(add_users[0], user, modules, relu_to) if len(add_users) == 1 else None
                    if act is not None:
                        problem = _act_problem(act[0], act[1])
                        if problem:
                            notes.append(f"activation {act[2]}: {problem}")
                        else:
                            candidates.append(("bn+add+act", act[0], act[1], add_users[0], user, shortcut,
                                               f"add + {act[2]}"))
                    elif len(add_users) == 1:
                        notes.append(f"the add feeds {_callable_name(add_users[0], modules)}, not a supported "
                                     "activation")
                    else:
                        notes.append(f"the add's output has {len(add_users)} readers")
                    candidates.append(("bn+add", "identity", 0.0, None, user, shortcut, "add"))
            act = _match_activation(user, bn, modules, relu_to)
            if act is not None:
                problem = _act_problem(act[0], act[1])
                if problem:
                    notes.append(f"activation {act[2]}: {problem}")
                else:
                    candidates.append(("bn+act", act[0], act[1], user, None, None, act[2]))
            elif shortcut is None:
                notes.append(f"its output feeds {_callable_name(user, modules)}, not a supported activation")
        else:
            notes.append(f"its output has {len(users)} readers: not fused")
        if standalone:
            candidates.append(("bn", "identity", 0.0, None, None, None, ""))

        chosen = None
        for cand in candidates:
            pattern, act_name, param, act_node, add_node, shortcut, src = cand
            out = act_node if act_node is not None else add_node if add_node is not None else bn
            problem = _modified_in_place(out, modules)
            if problem is None and shortcut is not None:
                problem = _modified_in_place(shortcut, modules)
                if problem:
                    problem = f"the shortcut is modified in place by {problem}"
            elif problem:
                problem = f"the output would be modified in place by {problem}"
            if problem:
                notes.append(f"{pattern}: {problem}")
                continue
            chosen = cand
            break
        if chosen is None:
            report.left.append(LeftLayer(target, "; ".join(notes) if notes else "nothing to fuse"))
            continue

        pattern, act_name, param, act_node, add_node, shortcut, src = chosen
        layer, small = _make_layer(module, act_name, param)
        _set_submodule(gm, target, layer)
        modules[target] = layer
        if add_node is not None:
            add_node.prepend(bn)  # the fused layer runs where the add was (the shortcut exists there)
            bn.kwargs = {"residual": shortcut}
        last = act_node if act_node is not None else add_node
        if last is not None:
            last.replace_all_uses_with(bn)
            gm.graph.erase_node(last)
        if act_node is not None and add_node is not None:
            gm.graph.erase_node(add_node)
        report.converted.append(ConvertedLayer(target, pattern, act_name, param, src, "; ".join(notes), small))

    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    logger.info("convert_model: %s", report.summary())
    if return_report:
        return gm, report
    return gm
