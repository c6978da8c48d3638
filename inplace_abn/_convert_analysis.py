"""Graph analysis for `convert_model`: tracing, the patterns around a
BatchNorm or GroupNorm call (a "norm" below: the rules are the same for both),
and whether overwriting its input is safe (see the docstring of
`inplace_abn.convert` for the rules)."""
import ast
import copy
import inspect
import operator
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from . import _activation
from .abn import ABN
from .groupnorm import AGN
from .memory import _storage_key

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
NORM_TYPES = BN_TYPES + (nn.GroupNorm,)  # the plain modules convert_model replaces
LAYER_TYPES = (ABN, AGN)  # this package's layers: never traced into or converted again


# Other libraries' modules that are a plain norm followed by ``self.drop`` and ``self.act`` (timm's
# norm + activation layers: their forward is the norm's, then drop, then act). Known by class, not
# imported: convert_model converts them as the norm + activation pair they are.
NORM_ACT_TYPES = frozenset(f"timm.layers.norm_act.{c}" for c in (
    "BatchNormAct2d", "SyncBatchNormAct", "GroupNormAct", "GroupNorm1Act"))


def norm_act_parts(m: nn.Module) -> Optional[Tuple[nn.Module, nn.Module]]:
    """(drop, act) of a known norm + activation module (`NORM_ACT_TYPES`), else None."""
    cls = type(m)
    if f"{cls.__module__}.{cls.__qualname__}" not in NORM_ACT_TYPES:
        return None
    drop, act = getattr(m, "drop", nn.Identity()), getattr(m, "act", nn.Identity())
    return (drop, act) if isinstance(drop, nn.Module) and isinstance(act, nn.Module) else None


def own_activation(m: nn.Module) -> Optional[Tuple[str, Any, str]]:
    """(activation, param, description) that a known norm + activation module applies
    itself (ReLU reported as "relu"); None for a plain norm or an identity ``act``."""
    parts = norm_act_parts(m)
    if parts is None or type(parts[1]) is nn.Identity:
        return None
    found = module_activation(parts[1])
    return None if found is None else (found[0], found[1], f"{found[2]} ({type(m).__name__}.act)")


def is_norm(m: nn.Module) -> bool:
    """Whether ``m`` is a BatchNorm or GroupNorm module (a subclass too: the report then says why it is left)."""
    return isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm))


def norm_kind(m: nn.Module) -> str:
    """``"gn"`` for a GroupNorm, ``"bn"`` for a BatchNorm: the prefix of the report's patterns."""
    return "gn" if isinstance(m, nn.GroupNorm) else "bn"

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
    F.hardswish, F.leaky_relu, F.mish, torch.mean, torch.sum,
}
_FRESH_METHODS = {"add", "sub", "mul", "div", "matmul", "clone", "__add__", "__mul__", "__sub__", "mean", "sum",
                  "var"}
# (amax, amin, norm, std, exp, sigmoid, softmax... save their output for backward: not fresh in this sense.
# tests/test_fuse_convert_edges.py checks every entry above against what autograd saves.)
# Operations whose output may be (a view of) their first argument.
_ALIAS_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)
_ALIAS_FUNCS = {torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze,
                torch.narrow, torch.select, operator.getitem, torch.detach, F.dropout, F.dropout1d, F.dropout2d,
                F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_ALIAS_METHODS = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose", "t",
                  "squeeze", "unsqueeze", "contiguous", "narrow", "select", "detach",
                  "__getitem__", "to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda"}
# Views in which several elements share memory: an in-place layer cannot write them.
_OVERLAP_FUNCS = {torch.broadcast_to}
_OVERLAP_METHODS = {"expand", "expand_as", "broadcast_to"}
# What ``a op= b`` runs in place of ``a op b`` (fx records both as the latter: `mark_augmented_assignments`).
_AUGMENTED = {operator.add: operator.iadd, operator.sub: operator.isub, operator.mul: operator.imul,
              operator.truediv: operator.itruediv, operator.floordiv: operator.ifloordiv, operator.mod: operator.imod,
              operator.pow: operator.ipow, operator.matmul: operator.imatmul, operator.and_: operator.iand,
              operator.or_: operator.ior, operator.xor: operator.ixor, operator.lshift: operator.ilshift,
              operator.rshift: operator.irshift}
_INPLACE_FUNCS = set(_AUGMENTED.values()) | {operator.setitem}


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
    """None when the norm's input may be overwritten, else why not."""
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
        if (node.op == "call_function" and node.target in _OVERLAP_FUNCS) or (
                node.op == "call_method" and node.target in _OVERLAP_METHODS):
            return f"its input is an expanded view ({_callable_name(node, modules)}: elements share memory)"
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
    return map_relu(_find_activation(node, src, modules), relu_to)


def module_activation(m: nn.Module) -> Optional[Tuple[str, Any, str]]:
    """(activation, param, description) of an activation module this package
    supports (ReLU reported as "relu": the caller maps it), else None."""
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


def map_relu(found: Optional[Tuple[str, Any, str]], relu_to) -> Optional[Tuple[str, Any, str]]:
    """``found`` with ReLU replaced by ``relu_to`` (ReLU is not invertible), the description saying so."""
    if found is None or found[0] != "relu":
        return found
    return relu_to[0], relu_to[1], f"{found[2]} -> {relu_to[0]}({relu_to[1]:g})"


def _find_activation(node: fx.Node, src: fx.Node, modules) -> Optional[Tuple[str, Any, str]]:
    if not node.args or node.args[0] is not src:
        return None

    def arg(i, key, default):
        if len(node.args) > i:
            return _number(node.args[i])
        return _number(node.kwargs.get(key, default))

    if node.op == "call_module":
        return module_activation(modules[node.target])
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


def act_problem(act: str, param) -> Optional[str]:
    """Why the in-place layer cannot take this activation (or would save nothing with it), or None."""
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
        return f"the shortcut's shape {list(mb.shape)} differs from the norm's output's {list(ma.shape)}"
    if ma.dtype != mb.dtype:
        return f"the shortcut's dtype {mb.dtype} differs from the norm's output's {ma.dtype}"
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


def _own_sources(cls: type) -> Optional[List[str]]:
    """The source of every class of ``cls``'s MRO below nn.Module (torch.nn's own left out), most
    derived first; None when one is unavailable."""
    sources = []
    for c in cls.__mro__:
        if c in (nn.Module, object) or c.__module__.startswith("torch.nn."):
            continue
        try:
            sources.append(inspect.getsource(c))
        except (OSError, TypeError):
            return None
    return sources


def reached_into(cls: type) -> Optional[set]:
    """Names of attributes whose own attributes or items' attributes the code
    of ``cls`` uses (``self.block.bn``, ``self.blocks[0].bn``,
    ``self.heads.items()``), and ``name[]`` for those it indexes
    (``self.block[1]``), from the source of every class of its MRO below nn.Module; None when a
    source is unavailable (then anything may be reached)."""
    sources = _own_sources(cls)
    if sources is None:
        return None
    names: set = set()
    for src in sources:
        names |= set(re.findall(r"self\.(\w+)\.", src)) | set(re.findall(r"self\.(\w+)\[[^\]]*\]\.", src))
        names |= {f"{n}[]" for n in re.findall(r"self\.(\w+)\[", src)}
    return names


def _methods(module: nn.Module) -> Optional[Dict[str, ast.FunctionDef]]:
    """The methods defined by the classes of ``module``'s MRO below nn.Module (the first definition of
    each name wins), parsed; None when a source is unavailable."""
    sources = _own_sources(type(module))
    if sources is None:
        return None
    found: Dict[str, ast.FunctionDef] = {}
    for src in sources:
        try:
            tree = ast.parse(textwrap.dedent(src))
        except SyntaxError:
            return None
        for fn in tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else ():
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(fn.name, fn)
    return found


def _self_call(call: ast.AST) -> Optional[str]:
    """``name`` for a call of ``self.name(...)`` or ``self.name[...](...)``, else None."""
    if not isinstance(call, ast.Call):
        return None
    f = call.func.value if isinstance(call.func, ast.Subscript) else call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
        return f.attr
    return None


def code_writes_in_place(module: nn.Module) -> Dict[str, str]:
    """{child name: how ``module``'s own code (its forward and the methods it calls on self) may
    write in place what that child returned}, for the children where it may. Each name's value is
    followed through the statements in order (both branches of an ``if``, loop bodies twice; what a
    method of self returns counts as every child's) to an augmented assignment, an ``x_()`` call,
    ``inplace=True``, or a child module with ``inplace=True`` applied to it. Without the source,
    every child, under ``"*"``."""
    methods = _methods(module)
    if methods is None:
        return {"*": f"the source of {type(module).__name__} is unavailable"}
    children = dict(module.named_children())
    found: Dict[str, str] = {}
    todo, seen = ["forward"], set()

    def value_of(e, held) -> set:
        """The children whose result the value of ``e`` may be, or a view of (a call may return its
        first argument or its receiver: a view, an identity module; arithmetic makes new tensors)."""
        while isinstance(e, (ast.Subscript, ast.Attribute, ast.Starred)):
            e = e.value
        if isinstance(e, ast.Call):
            called = _self_call(e)
            out = {called} if called in children else set(children) if called in methods else set()
            if isinstance(e.func, ast.Attribute) and called is None:
                out |= value_of(e.func.value, held)  # x.view(...), x.contiguous()
            if called in children and isinstance(children[called], _FRESH_MODULES):
                return out  # a convolution, a norm...: a new tensor
            return out | (value_of(e.args[0], held) if e.args else set())
        if isinstance(e, (ast.Tuple, ast.List)):
            return set().union(*(value_of(x, held) for x in e.elts))
        if isinstance(e, ast.IfExp):
            return value_of(e.body, held) | value_of(e.orelse, held)
        return set(held.get(e.id, ())) if isinstance(e, ast.Name) else set()

    def check(expr, held, where):
        """Record the in-place writes that ``expr`` (no nested statements) makes to held values."""
        for n in ast.walk(expr):
            if not isinstance(n, ast.Call):
                continue
            called = _self_call(n)
            if called in methods:
                todo.append(called)
            writes = []
            if isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_") and not n.func.attr.startswith("_"):
                writes.append((n.func.value, f"with .{n.func.attr}()"))
            if n.args and (any(k.arg == "inplace" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in n.keywords) or getattr(children.get(called), "inplace", False) is True):
                writes.append((n.args[0], "in place (inplace=True)"))
            for target, how in writes:
                for child in value_of(target, held):
                    found.setdefault(child, f"{where} writes {ast.unparse(target)} {how}")

    def visit(stmts, held, where) -> dict:
        for st in stmts:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(st, ast.If):
                check(st.test, held, where)
                a, b = visit(st.body, dict(held), where), visit(st.orelse, dict(held), where)
                held = {k: a.get(k, set()) | b.get(k, set()) for k in set(a) | set(b)}
                continue
            if isinstance(st, (ast.For, ast.AsyncFor, ast.While)):
                check(st.iter if isinstance(st, (ast.For, ast.AsyncFor)) else st.test, held, where)
                for _ in range(2):  # a value may come round the loop
                    if isinstance(st, (ast.For, ast.AsyncFor)):
                        for t in ast.walk(st.target):
                            if isinstance(t, ast.Name):
                                held[t.id] = held.get(t.id, set()) | value_of(st.iter, held)
                    out = visit(st.body, dict(held), where)
                    held = {k: held.get(k, set()) | out.get(k, set()) for k in set(held) | set(out)}
                held = visit(st.orelse, held, where)
                continue
            if isinstance(st, (ast.With, ast.AsyncWith, ast.Try)):
                for item in getattr(st, "items", ()):
                    check(item.context_expr, held, where)
                held = visit(st.body, held, where)
                for h in getattr(st, "handlers", ()):
                    held = visit(h.body, held, where)
                held = visit(getattr(st, "orelse", []) + getattr(st, "finalbody", []), held, where)
                continue
            check(st, held, where)
            if isinstance(st, ast.AugAssign):
                for child in value_of(st.target, held):
                    found.setdefault(child, f"{where} writes {ast.unparse(st.target)} with an augmented assignment")
            if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
                value = value_of(st.value, held)
                for target in st.targets if isinstance(st, ast.Assign) else [st.target]:
                    names = [t for t in ast.walk(target) if isinstance(t, ast.Name)]
                    for t in names:  # (a tuple target: each name may hold any part)
                        held[t.id] = set(value)
        return held

    while todo:
        name = todo.pop()
        fn = methods.get(name)
        if fn is None or name in seen:
            continue
        seen.add(name)
        visit(fn.body, {}, f"{type(module).__name__}.{name}")
    return found


def returned(node: fx.Node, modules) -> bool:
    """Whether ``node``'s value (or a view of it) is an output of its graph."""
    return any(u.op == "output" for u, _ in _alias_readers(node, modules))


class ReturnedWritten:
    """A safety (`StaticSafety`, `RunSafety`) for a graph whose outputs the caller may write in place
    (``why``): a value returned counts as modified in place."""

    def __init__(self, inner, modules, why: str):
        self.inner, self.modules, self.why = inner, modules, why

    def modified_in_place(self, node: fx.Node) -> Optional[str]:
        found = self.inner.modified_in_place(node)
        if found is None and returned(node, self.modules):
            found = f"the caller, to which it is returned ({self.why})"
        return found

    def __getattr__(self, name):
        return getattr(self.inner, name)


def has_norm(m: nn.Module, skip: frozenset = frozenset()) -> bool:
    """Whether ``m`` holds a BatchNorm or GroupNorm module (not counting this
    package's layers, nor the modules whose ids are in ``skip``, with theirs)."""
    if id(m) in skip:
        return False
    return is_norm(m) or any(has_norm(c, skip) for c in m.children())


def _timm_notrace() -> Tuple[tuple, tuple]:
    """(modules, functions) that timm registers as not to be traced into (its own fx
    feature extraction's leaves: e.g. the dynamic padding of its "same" convolutions),
    when timm is loaded; a model holding its modules implies it."""
    registry = sys.modules.get("timm.layers._fx")
    if registry is None:
        return (), ()
    try:
        modules, functions = registry.get_notrace_modules(), registry.get_notrace_functions()
    except AttributeError:  # another timm layout: its models may then need a tracer of their own
        return (), ()
    return tuple(m for m in modules if isinstance(m, type)), tuple(f for f in functions if callable(f))


class _Tracer(fx.Tracer):
    """fx's default tracer, plus leaves: the package's own layers, modules
    whose forward reads ``self.training`` (tracing into them would freeze the
    mode they were traced in, e.g. torchvision's StochasticDepth would keep
    dropping paths in eval mode; one holding norms is converted on its own),
    known norm + activation modules (`NORM_ACT_TYPES`), and timm's registered
    leaves and functions."""

    def __init__(self):
        self._notrace_modules, functions = _timm_notrace()
        super().__init__(autowrap_functions=functions)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (isinstance(m, LAYER_TYPES) or super().is_leaf_module(m, qualname) or _reads_training(type(m))
                or norm_act_parts(m) is not None or isinstance(m, self._notrace_modules))


def trace(model: nn.Module, tracer: Optional[fx.Tracer], concrete_args, stack_traces: bool = False
          ) -> Tuple[fx.Graph, nn.Module, bool]:
    """(graph, root, mode_dependent): the graph of ``model`` in its current
    mode, and whether tracing in the other mode gives a different graph.
    ``stack_traces``: our tracer records each node's stack (`mark_augmented_assignments`)."""
    tr = tracer if tracer is not None else _Tracer()
    if tracer is None:
        tr.record_stack_traces = stack_traces
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


def drop_identities(gm: fx.GraphModule) -> None:
    """Remove from ``gm``'s graph the calls of plain ``nn.Identity`` modules applied to a norm's
    output or to its sum with a shortcut (their readers read that value): placeholders such as timm's
    ``drop_path`` / ``drop_block`` at rate 0 or an absent attention would otherwise stand between the
    norm and the add or activation it fuses. Other identities stay (a head set to ``nn.Identity()``
    may be replaced later)."""
    def is_norm_call(n) -> bool:
        return isinstance(n, fx.Node) and n.op == "call_module" and is_norm(gm.get_submodule(n.target))

    def fusable(n) -> bool:  # a norm's output, or its sum with a shortcut (then an activation may follow)
        return is_norm_call(n) or (isinstance(n, fx.Node) and any(_match_add(n, a) is not None
                                                                  for a in n.args if is_norm_call(a)))

    for node in list(gm.graph.nodes):
        if (node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.Identity
                and len(node.args) == 1 and not node.kwargs and fusable(node.args[0])):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _source_line(node: fx.Node) -> Optional[str]:
    """The line of model code that created ``node``, from its recorded stack (the last frame outside
    torch.fx), or None where no stack was recorded."""
    frames = re.findall(r'File "([^"]*)", line \d+, in \S+\n[ \t]*(.*)', node.stack_trace or "")
    code = [line for path, line in frames if "/torch/fx/" not in path.replace("\\", "/")]
    return code[-1].strip() if code else None


def _is_augmented(line: str) -> bool:
    try:
        tree = ast.parse(line)
    except SyntaxError:  # a statement over several lines: assume the worst
        return True
    return any(isinstance(n, ast.AugAssign) for n in ast.walk(tree))


def mark_augmented_assignments(gm: fx.GraphModule) -> None:
    """Where the model's own forward runs (``keep_modules``), ``a += b`` on tensors writes ``a`` in
    place, but fx records it as ``a + b``: give such nodes their in-place operator, judged from the
    source line that created them (without a recorded line, every such operator counts as in place)."""
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target in _AUGMENTED and node.args
                and isinstance(node.args[0], fx.Node)):
            line = _source_line(node)
            if line is None or _is_augmented(line):
                node.target = _AUGMENTED[node.target]


def set_submodule(root: nn.Module, target: str, module: nn.Module) -> None:
    *path, name = target.split(".")
    parent = root.get_submodule(".".join(path)) if path else root
    setattr(parent, name, module)


# ---- candidates --------------------------------------------------------------------------


@dataclass
class Candidate:
    """One way of converting a norm call: ``act(bn(x) [+ shortcut])``."""

    pattern: str  # "bn+add+act", "bn+act", "bn+add" or "bn" ("gn..." for a GroupNorm)
    activation: str
    param: float
    source: str  # what is fused, for the report
    act: Optional[fx.Node] = None  # the activation node fused, if any
    add: Optional[fx.Node] = None  # the add node fused, if any
    shortcut: Optional[fx.Node] = None  # the add's other operand

    def output(self, bn: fx.Node) -> fx.Node:
        """The node whose value the converted layer returns."""
        return self.act if self.act is not None else self.add if self.add is not None else bn


def module_problem(bn: fx.Node, modules: Dict[str, nn.Module], calls: Dict[str, int]) -> Optional[str]:
    """Why the module called by ``bn`` (a call_module of a norm) cannot be replaced, or None."""
    module = modules[bn.target]
    parts = norm_act_parts(module)
    if type(module) not in NORM_TYPES and parts is None:
        return f"{type(module).__name__} is not a plain {'GroupNorm' if norm_kind(module) == 'gn' else 'BatchNorm'}"
    if parts is not None:
        drop, act = parts
        if type(drop) is not nn.Identity:
            return f"{type(module).__name__} applies {type(drop).__name__} between the norm and its activation"
        if type(act) is not nn.Identity and module_activation(act) is None:
            return (f"the activation of {type(module).__name__}, {type(act).__name__}, is not supported "
                    "(identity, ReLU, LeakyReLU, ELU, SiLU)")
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
        return "lazy module not initialised yet"
    if calls[bn.target] > 1:
        return f"the module is called {calls[bn.target]} times"
    owner = next((t for t in calls if bn.target.startswith(t + ".")), None)
    if owner is not None:
        return f"it belongs to {owner}, called as a whole too (its forward may call the module as well)"
    if len(bn.args) != 1 or bn.kwargs or not isinstance(bn.args[0], fx.Node):
        return "unexpected call arguments"
    return None


def find_candidates(bn: fx.Node, modules, relu_to, residual: bool, standalone: bool
                    ) -> Tuple[List[Candidate], List[str]]:
    """The patterns that fit around ``bn`` (a norm call), best first, and notes on why better ones do not."""
    kind = norm_kind(modules[bn.target])
    notes: List[str] = []
    own = own_activation(modules[bn.target])
    if own is not None:  # a norm + activation module: its output is activated already, nothing else fuses
        act = map_relu(own, relu_to)
        problem = act_problem(act[0], act[1])
        if problem:
            return [], [f"activation {act[2]}: {problem}"]
        return [Candidate(f"{kind}+act", act[0], act[1], act[2])], notes
    users = list(bn.users)
    found: List[Candidate] = []
    if len(users) != 1:
        notes.append(f"its output has {len(users)} readers: not fused")
    else:
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
                    problem = act_problem(act[0], act[1])
                    if problem:
                        notes.append(f"activation {act[2]}: {problem}")
                    else:
                        found.append(Candidate(f"{kind}+add+act", act[0], act[1], f"add + {act[2]}", act=add_users[0],
                                               add=user, shortcut=shortcut))
                elif len(add_users) == 1:
                    notes.append(f"the add feeds {_callable_name(add_users[0], modules)}, not a supported "
                                 "activation")
                else:
                    notes.append(f"the add's output has {len(add_users)} readers")
                found.append(Candidate(f"{kind}+add", "identity", 0.0, "add", add=user, shortcut=shortcut))
        act = _match_activation(user, bn, modules, relu_to)
        if act is not None:
            problem = act_problem(act[0], act[1])
            if problem:
                notes.append(f"activation {act[2]}: {problem}")
            else:
                found.append(Candidate(f"{kind}+act", act[0], act[1], act[2], act=user))
        elif shortcut is None:
            notes.append(f"its output feeds {_callable_name(user, modules)}, not a supported activation")
    if standalone:
        found.append(Candidate(kind, "identity", 0.0, ""))
    return found, notes


class InputProblem(str):
    """Why a norm's input may not be overwritten (a safety's ``input_problem``): the
    report's text, and ``preservable``: whether a layer with preserve_input, which only
    reads its input, may still take the norm (not where the input is no tensor)."""

    preservable: bool

    def __new__(cls, text: str, preservable: bool = True):
        problem = super().__new__(cls, text)
        problem.preservable = preservable
        return problem


def can_preserve(bn: fx.Node, problem: InputProblem) -> bool:
    """Whether a norm whose input may not be overwritten (``problem``) can still become a
    layer with preserve_input: its input is a graph value the layer can read."""
    return bool(bn.args) and isinstance(bn.args[0], fx.Node) and problem.preservable


def preserve_candidates(bn: fx.Node, candidates: List[Candidate], notes: List[str], safety) -> List[Candidate]:
    """The candidates a preserve_input layer may take. A fused add moves the norm's call to
    the add's place (`convert._rewrite`): only where nothing writes its input in between."""
    writer = safety.modified_in_place(bn.args[0])
    if writer is None:
        return candidates
    kept = [c for c in candidates if c.add is None]
    if len(kept) < len(candidates):
        notes.append(f"no fused add: its input is modified in place later by {writer}")
    return kept


def module_level_candidates(candidates: List[Candidate], notes: List[str], modules, calls) -> List[Candidate]:
    """The candidates that swapping modules can express (``convert_model(keep_modules=True)``): no
    fused add (it is in the forward's code), and a fused activation only as a module that the traced
    forwards call once (``calls(module)``), on this norm's output: it becomes an nn.Identity."""
    kept = []
    for c in candidates:
        if c.add is not None:
            problem = "the add is in the forward's code"
        elif c.act is not None and c.act.op != "call_module":
            problem = f"the activation {_callable_name(c.act, modules)} is in the forward's code"
        elif c.act is not None and calls(modules[c.act.target]) != 1:
            problem = (f"the activation module {c.act.target} is called "
                       f"{calls(modules[c.act.target])} times")
        else:
            kept.append(c)
            continue
        notes.append(f"{c.pattern} not taken with keep_modules: {problem}")
    return kept


def choose(bn: fx.Node, candidates: List[Candidate], notes: List[str], safety) -> Optional[Candidate]:
    """The first candidate whose output (and shortcut) nothing modifies in place later;
    the reasons for skipping the others are appended to ``notes``."""
    for cand in candidates:
        problem = safety.modified_in_place(cand.output(bn))
        if problem:
            problem = f"the output would be modified in place by {problem}"
        elif cand.shortcut is not None:
            problem = safety.modified_in_place(cand.shortcut)
            if problem:
                problem = f"the shortcut is modified in place by {problem}"
        if problem:
            notes.append(f"{cand.pattern}: {problem}")
            continue
        return cand
    return None


class StaticSafety:
    """Safety judged from the graph and the operator tables above (no example inputs)."""

    def __init__(self, modules: Dict[str, nn.Module]):
        self.modules = modules

    def input_problem(self, bn: fx.Node) -> Optional[InputProblem]:
        problem = _input_problem(bn.args[0], bn, self.modules)
        return None if problem is None else InputProblem(problem)

    def modified_in_place(self, node: fx.Node) -> Optional[str]:
        return _modified_in_place(node, self.modules)

    def converted(self, bn: fx.Node, chosen: "Candidate", preserve: bool = False) -> None:
        pass  # a converted layer is not a fresh-tensor operation: later inputs from it are left anyway


# ---- safety observed in a run ------------------------------------------------------------


def _tensors(value) -> List[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _keys(value) -> set:
    """Storage identities of the tensors in ``value`` (empty storages left out)."""
    return {key for key, nbytes in map(_storage_key, _tensors(value)) if nbytes}


class _Recorder(ShapeProp):
    """Runs a graph and records, per node name, the storages it reads, writes in
    place (version counters), returns and saves for backward (saved-tensor hooks),
    and (as ShapeProp) each node's shape and dtype in ``node.meta``.
    Every value stays alive until the end, so no storage address is reused."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.garbage_collect_values = False
        self.reads, self.writes, self.returns, self.saves, self.overlap = {}, {}, {}, {}, {}

    def run_node(self, n: fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = _tensors((args, kwargs))
        versions = [t._version for t in inputs]
        saved: List[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = super().run_node(n)
        self.reads[n.name] = _keys(inputs)
        self.writes[n.name] = _keys([t for t, v in zip(inputs, versions) if t._version != v])
        self.returns[n.name] = _keys(out)
        self.saves[n.name] = _keys(saved)
        self.overlap[n.name] = any(torch._debug_has_internal_overlap(t) != 0 for t in _tensors(out))
        return out


class _Run:
    """What one run of the graph did (one mode)."""

    def __init__(self, gm: fx.GraphModule, inputs, training: bool):
        gm.train(training)
        rec = _Recorder(gm)
        with torch.enable_grad():
            rec.propagate(*inputs)
        self.rec = rec
        self.inputs = _keys(inputs)
        self.state = _keys(list(gm.parameters()) + list(gm.buffers()))
        self.mode = "training" if training else "eval"


class RunSafety:
    """Safety observed in runs of the graph on example inputs, in training and
    in eval mode, with every floating-point input and parameter requiring
    grad: what each node reads, writes in place, returns and saves for
    backward, from the tensors' storages, version counters and autograd's
    saved-tensor hooks. No operator table is consulted.

    ``x`` (a norm's input) may be overwritten when its storage is no
    model input, parameter or buffer, has no internal overlap, is read by no
    node after the norm, and is saved for backward by no node (nor by a
    layer converted before). A candidate's output must not be written in
    place by a later node (the layer saves it).
    """

    def __init__(self, gm: fx.GraphModule, example_inputs):
        self.modules = dict(gm.named_modules())
        self.graph_nodes = list(gm.graph.nodes)  # the original nodes, for descriptions
        self.names = [n.name for n in gm.graph.nodes]  # in execution order (records are by name: of a copy)
        self.index = {name: i for i, name in enumerate(self.names)}
        copy_gm = copy.deepcopy(gm)
        for p in copy_gm.parameters():
            if p.is_floating_point():
                p.requires_grad_(True)
        inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                  for t in example_inputs]
        self.runs = [_Run(copy_gm, inputs, training) for training in (True, False)]
        # Shapes and dtypes of the eval-mode run (the residual-shape check reads them).
        for n, c in zip(gm.graph.nodes, copy_gm.graph.nodes):
            if "tensor_meta" in c.meta:
                n.meta["tensor_meta"] = c.meta["tensor_meta"]
        self.kept = [set() for _ in self.runs]  # storages saved by the layers converted so far, per run

    def _after(self, node: fx.Node) -> List[str]:
        return self.names[self.index[node.name] + 1:]

    def _describe(self, name: str) -> str:
        node = next((n for n in self.graph_nodes if n.name == name), None)
        return name if node is None else f"{name} ({_callable_name(node, self.modules)})"

    def input_problem(self, bn: fx.Node) -> Optional[InputProblem]:
        x = bn.args[0]
        for run, kept in zip(self.runs, self.kept):
            rec = run.rec
            keys = rec.returns.get(x.name, set())
            where = f" (in {run.mode} mode)"
            if not keys:
                return InputProblem("its input holds no tensor memory" + where, preservable=False)
            if keys & run.inputs:
                return InputProblem("its input is a model input (the caller's tensor would be overwritten)")
            if keys & run.state:
                return InputProblem("its input is a parameter or buffer")
            if rec.overlap[x.name]:
                return InputProblem(f"its input has elements sharing memory (an expanded view){where}")
            if keys & kept:
                return InputProblem("its input's memory is saved by an in-place layer converted before it" + where)
            for n in self._after(bn):
                if rec.reads[n] & keys:
                    return InputProblem(f"its input's memory is read again after it by {self._describe(n)}" + where)
            for n in self.names:
                if n != bn.name and rec.saves[n] & keys:
                    return InputProblem(f"its input's memory is saved for backward by {self._describe(n)}{where}")
        return None

    def modified_in_place(self, node: fx.Node) -> Optional[str]:
        for run in self.runs:
            keys = run.rec.returns.get(node.name, set())
            for n in self._after(node):
                if run.rec.writes[n] & keys:
                    return self._describe(n)
        return None

    def converted(self, bn: fx.Node, chosen: "Candidate", preserve: bool = False) -> None:
        """Record what the new layer saves: its input's memory (which becomes its output, unless
        ``preserve``: a new tensor) and the shortcut."""
        saved = (chosen.output(bn), chosen.shortcut) + (() if preserve else (bn.args[0],))
        for run, kept in zip(self.runs, self.kept):
            for n in saved:
                if n is not None:
                    kept |= run.rec.returns.get(n.name, set())
