"""Whole-model conversion to In-Place ABN (``convert_model``).

``convert_model`` traces a model with ``torch.fx`` and rewrites, per BatchNorm
or GroupNorm module call (in order of preference; a GroupNorm's patterns read
``gn+add+act``, ``gn+act``, ``gn+add``, ``gn``):

=============  ===========================================  ===========================
pattern        graph before                                 after
=============  ===========================================  ===========================
``bn+add+act`` ``a = f(bn(x) + r)``                         ``a = iabn(x, residual=r)``
``bn+act``     ``a = f(bn(x))``                             ``a = iabn(x)``
``bn+add``     ``s = bn(x) + r`` (no activation after)      ``s = iabn_identity(x, residual=r)``
``bn``         ``z = bn(x)`` (anything else after)          ``z = iabn_identity(x)``
=============  ===========================================  ===========================

``iabn`` is an `InPlaceABN` with ``weight_mode="signed"`` (an `InPlaceABNSync`
for ``nn.SyncBatchNorm``; an `InPlaceAGN` for ``nn.GroupNorm``, same groups
and eps) stored under the norm's own qualified name, so state-dict keys do
not change. GroupNorm follows every rule below as BatchNorm does. ``f`` is
ReLU (mapped to ``activation``, by default leaky_relu(0.01): ReLU is not
invertible), LeakyReLU (slope kept),
ELU (alpha kept) or SiLU, as a module (``nn.ReLU(inplace=True)`` too), a
function (``F.relu``, ``torch.relu``, ``F.silu``, ``F.leaky_relu``, ``F.elu``,
their ``_`` variants) or a method (``x.relu()``).

Every converted layer keeps only its output (and ``r``) for backward, and
overwrites its input ``x`` when that is safe:

- ``x`` has no reader but the BatchNorm, is not a model input, and comes from
  an operation known to return a fresh tensor that its own backward does not
  need (convolution, linear, add, cat, pooling, interpolation...; not
  ``amax``, ``norm``, ``std`` or ``exp``, which save their output), possibly
  through views whose only reader is the next step of the chain (not an
  ``expand``: its elements share memory);
- a fused activation is the only reader of the BatchNorm (or add) output, and
  the add's output has no reader but the activation;
- the layer's output (and ``r``) is not modified in place later (autograd
  would refuse the backward);
- the BatchNorm module is called once and is a plain ``nn.BatchNorm1d/2d/3d``,
  ``nn.SyncBatchNorm`` or ``nn.GroupNorm`` with initialised parameters, or one
  of timm's norm + activation modules (``BatchNormAct2d``, ``SyncBatchNormAct``,
  ``GroupNormAct``, ``GroupNorm1Act``) whose ``drop`` is an identity and whose
  ``act`` an identity or one of the activations above: it becomes one layer
  with that activation (``bn+act``), or, with an identity ``act``, takes the
  patterns above.

With ``example_inputs`` these rules are not taken from operator tables but
observed: the graph runs on the inputs (on a copy, in training and in eval
mode, everything requiring grad) under saved-tensor hooks, and ``x`` may be
overwritten when its memory is no model input, parameter or buffer, has no
overlapping elements, is read by no operation after the BatchNorm and is
saved for backward by none (nor by a layer converted before); a candidate's
output and shortcut must not be written in place (version counters) later.
That judgement holds for inputs like the examples (a ``reshape`` may copy
or not depending on strides).

Where it is not, a call that fuses an activation or an add still becomes a
layer, with ``preserve_input=True`` (its output in a new tensor; the report's
note says why); one without anything to fuse is left (a standalone layer
beside an input kept alive would save more, not less).

Whatever is not converted stays as it was; the `ConversionReport` says what
was converted and why the rest was left.

``keep_modules=True`` keeps the model's own class and code: the graph only
informs module swaps (the norm for the layer, a fused activation module for
``nn.Identity``), so no add is fused, an activation only as a module called
once, and ``a += b`` (traced as ``a + b``) counts as the in-place write it is
in the model's code, judged from the source line of each node.

Known blocks that torch.fx cannot trace are rewritten at module level first
(`inplace_abn._convert_diffusers`, imported only when diffusers is): each
diffusers ``ResnetBlock2D`` (norm1 -> nonlinearity and norm2 -> nonlinearity,
norm1 with ``preserve_input``: the shortcut reads the block input) and the
``conv_norm_out -> conv_act`` of ``UNet2DModel`` / ``UNet2DConditionModel``.
The report lists those blocks in ``rewritten``; when the model itself cannot
be traced after that, its submodules are converted one by one instead of
raising.

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
layers as leaves, and also any module whose ``forward`` reads
``self.training`` (torchvision's ``StochasticDepth``): tracing into it would
freeze the mode it was traced in; timm's norm + activation modules, and, when
timm is loaded, the modules and functions timm registers as not to be traced
(its "same"-padding convolutions). Calls of plain ``nn.Identity`` modules on
a norm's output or on its sum with a shortcut (timm's ``drop_path`` at rate
0) are removed from the traced graph, so they do not stand between the norm
and what it fuses. Such a leaf that holds BatchNorms, like any
leaf of a custom ``tracer`` that does, is converted on its own. A module whose
traced graph still depends on the mode (the model's own ``forward`` reading
``self.training``, e.g. torchvision's Inception3), or a submodule that
torch.fx cannot trace, is kept as it is: each of its submodules is converted
separately, and the BatchNorms its own forward calls are left (the report
says so and carries a warning). A submodule whose insides its code uses
(``self.block.bn``, ``self.block[1]``: found in the class's source) is kept
the same way, and a BatchNorm called by two traced forwards is left. A
submodule converted on its own returns no layer output (which the layer saves
for backward) into code that may write it in place: kept Python code that
applies an augmented assignment, an ``x_()`` call or ``inplace=True`` to what
that submodule returned (read from its source), or a parent graph that writes
the leaf's output (an in-place layer made there included). The
result is then that module, not a ``GraphModule``. As with any ``torch.fx`` conversion, modules that a traced
forward never calls are not part of the result. Without ``example_inputs`` a
tensor added to a BatchNorm output is assumed to have its shape (a
broadcasting add then fails with the layer's clear shape error).
"""
import copy
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import _activation
from .abn import ABN, InPlaceABN
from .groupnorm import InPlaceAGN
from . import _convert_analysis as analysis
from ._convert_weights import bn_weight_to_signed, load_batchnorm_state_dict, make_layer

logger = logging.getLogger(__name__)

_FUNCTIONAL_NORMS = {F.batch_norm: "batch_norm", torch.batch_norm: "batch_norm", F.group_norm: "group_norm",
                     torch.group_norm: "group_norm"}

__all__ = ["convert_model", "ConversionReport", "ConvertedLayer", "LeftLayer", "bn_weight_to_signed",
           "load_batchnorm_state_dict"]


# ---- report ------------------------------------------------------------------------------


@dataclass
class ConvertedLayer:
    """One BatchNorm (GroupNorm) converted to an in-place layer."""

    name: str  # qualified module name (the new layer keeps it)
    pattern: str  # "bn+add+act", "bn+act", "bn+add" or "bn"; "gn+..." for GroupNorms
    activation: str  # the in-place layer's activation
    activation_param: float
    source: str = ""  # what was fused, e.g. "add + ReLU -> leaky_relu(0.01)"
    note: str = ""  # why a better pattern was not possible, if one was tried
    small_weights: int = 0  # channels with |w| <= eps (scale moved to +-eps)


@dataclass
class LeftLayer:
    """One BatchNorm (GroupNorm) call left as it was."""

    name: str
    reason: str


@dataclass
class ConversionReport:
    """What `convert_model` converted, and what it left and why. ``str()`` is a table."""

    converted: List[ConvertedLayer] = field(default_factory=list)
    left: List[LeftLayer] = field(default_factory=list)
    shapes_checked: bool = False
    warnings: List[str] = field(default_factory=list)
    # blocks rewritten at module level (known structure, not traced), "name (class)"
    rewritten: List[str] = field(default_factory=list)

    def counts(self) -> Dict[str, int]:
        """Number of layers per pattern, plus ``"left"``."""
        out: Dict[str, int] = {}
        for c in self.converted:
            out[c.pattern] = out.get(c.pattern, 0) + 1
        out["left"] = len(self.left)
        return out

    def summary(self) -> str:
        c = self.counts()
        pieces = []
        for kind, norm, layer in (("bn", "BatchNorm", "InPlaceABN"), ("gn", "GroupNorm", "InPlaceAGN")):
            patterns = [p for p in (f"{kind}+add+act", f"{kind}+act", f"{kind}+add", kind) if c.get(p)]
            n = sum(c[p] for p in patterns)
            if n or (kind == "bn" and not any(p.startswith("gn") for p in c)):
                parts = ", ".join(f"{c[p]} {p}" for p in patterns)
                pieces.append(f"{n} {norm} layers to {layer}{' (' + parts + ')' if parts else ''}")
        text = f"converted {' and '.join(pieces)}; left {c['left']}"
        if self.rewritten:
            text += (f"; {len(self.rewritten)} blocks rewritten at module level "
                     f"({', '.join(sorted(set(r[r.index(' (') + 2:-1] for r in self.rewritten)))})")
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
        if any("add" in c.pattern for c in self.converted) and not self.shapes_checked:
            lines.append("(residual shapes were not checked: pass example_inputs to check them)")
        return "\n".join(lines)

    __repr__ = __str__


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
    keep_modules: bool = False,
    return_report: bool = False,
) -> Union[nn.Module, Tuple[nn.Module, ConversionReport]]:
    """Rewrite BatchNorm / GroupNorm (+ add) + activation chains of ``model`` as in-place layers.

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
        example_inputs: optional inputs (tuple). The model runs on them once
            in eval mode without gradients (to record what each submodule
            converted on its own receives), and the traced graph twice, on a
            copy of the model, in training and in eval mode with gradients
            (the model's running statistics are not touched): the safety
            rules are then judged from what each operation actually read,
            wrote in place, returned and saved for backward (see the module
            docstring), and the shapes and dtypes of residual adds are checked.
            Without them, the rules use the operator tables, and a tensor
            added to a BatchNorm output is assumed to have its shape (a
            broadcasting add then raises a clear error in the layer).
        inplace: convert ``model`` itself (its BatchNorm weights are rewritten
            and its modules shared with the result) instead of a deep copy.
        keep_modules: return the model's own class (its methods and
            attributes: timm's ``reset_classifier``, ``forward_features``,
            ``pretrained_cfg``...) with modules swapped, instead of a
            GraphModule: each converted norm module becomes the layer, and a
            fused activation module, called once and only there, an
            ``nn.Identity``. Only what module swaps can express is converted:
            no fused add (it is in the forward's code), no functional
            activation; the report's notes say what was given up.
        return_report: also return the `ConversionReport`.

    Returns:
        A ``torch.fx.GraphModule`` (an ordinary ``nn.Module``: train it, save
        its ``state_dict``, switch it to eval) with the original parameter and
        buffer names, or with ``keep_modules`` the model itself (copied unless
        ``inplace``), and the report when ``return_report``. When the model's
        own forward depends on the train/eval mode, the model itself (copied
        unless ``inplace``) with its submodules converted. The report's
        summary is also logged (logger ``inplace_abn.convert``, level INFO).
    """
    _activation.check(activation, activation_param)
    if not inplace:
        model = copy.deepcopy(model)
    job = _Job(ConversionReport(), (activation, activation_param), residual, standalone, None, keep_modules)
    _rewrite_known_modules(model, job)
    if example_inputs is not None:
        job.inputs = _module_inputs(model, example_inputs, job.handled)
    result = _convert(model, "", tracer, concrete_args, example_inputs, job)
    logger.info("convert_model: %s", job.report.summary())
    if return_report:
        return result, job.report
    return result


@dataclass
class _Job:
    """What one convert_model call carries through the module tree."""

    report: ConversionReport
    relu_to: Tuple[str, float]
    residual: bool
    standalone: bool
    inputs: Optional[Dict[int, tuple]]  # id(module) -> its first inputs, with example_inputs
    keep_modules: bool = False  # swap modules in the model instead of returning rewritten graphs
    done: Dict[int, nn.Module] = field(default_factory=dict)  # id(module) -> its conversion
    handled: set = field(default_factory=set)  # ids of modules the module-level rewrite converted or left
    calls: Dict[int, int] = field(default_factory=dict)  # id(module) -> calls in all the graphs traced so far


def _rewrite_known_modules(model: nn.Module, job: _Job) -> None:
    """Module-level rewrite of the blocks whose structure is known and which
    torch.fx cannot trace (diffusers' ResnetBlock2D, UNet outputs: section 9.1
    of docs/DESIGN.md). Only when diffusers is imported: a model holding its
    blocks implies it, and this package never imports it otherwise."""
    if "diffusers" in sys.modules:
        try:
            from . import _convert_diffusers
        except ImportError as e:  # another diffusers layout: convert what fx can, and say so
            job.report.warnings.append(f"diffusers blocks not rewritten (this diffusers has another layout: {e})")
            logger.warning("convert_model: %s", job.report.warnings[-1])
            return
        _convert_diffusers.rewrite(model, job.relu_to, job.report, job.handled)


def _module_inputs(model: nn.Module, example_inputs, skip: set) -> Dict[int, tuple]:
    """The inputs (positional, in signature order) each module holding a norm
    receives at its first call in an eval-mode, no-grad run on the example
    inputs, for the modules converted on their own."""
    seen: Dict[int, tuple] = {}

    def hook(module, args, kwargs):
        if id(module) in seen:
            return
        try:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
        except TypeError:
            return
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in bound.signature.parameters.values()):
            return
        bound.apply_defaults()
        seen[id(module)] = torch.utils._pytree.tree_map(
            lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tuple(bound.arguments.values()))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
               if analysis.has_norm(m, skip) and not analysis.is_norm(m)]
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
        for m, t in modes.items():
            m.training = t
    return seen


def _convert(module: nn.Module, qual: str, tracer, concrete_args, inputs, job: _Job,
             written: Optional[str] = None) -> nn.Module:
    """``module`` converted: a GraphModule, or ``module`` itself with its
    submodules converted one by one when its forward depends on the train/eval
    mode (or, below the top, cannot be traced). ``written``: why the code that
    calls ``module`` may write what it returns in place (no layer's output or
    shortcut is then returned), or None."""
    where = f"{qual} ({type(module).__name__})" if qual else f"the model ({type(module).__name__})"
    if id(module) in job.handled or (job.handled and not analysis.has_norm(module, job.handled)):
        return module  # rewritten at module level, or nothing left to convert after that
    try:
        graph, root, mode_dependent = analysis.trace(module, tracer, concrete_args, stack_traces=job.keep_modules)
    except Exception as e:
        if not qual and not job.report.rewritten:
            raise
        return _convert_children(module, qual, job, f"{where} cannot be traced by torch.fx "
                                                    f"({type(e).__name__}: {e})", written)
    if mode_dependent:
        return _convert_children(module, qual, job, f"the forward of {where} depends on the train/eval mode "
                                                    "(it reads self.training)", written)
    for n in graph.nodes:
        if n.op == "call_module":
            key = id(root.get_submodule(n.target))
            job.calls[key] = job.calls.get(key, 0) + 1
    gm = fx.GraphModule(root, graph, module.__class__.__name__)
    analysis.drop_identities(gm)
    if job.keep_modules:  # (the graph only informs the swaps: the model's own forward runs)
        analysis.mark_augmented_assignments(gm)
    # GraphModule rebuilds the module tree above the leaves as plain Modules: keep their modes.
    for name, m in gm.named_modules():
        try:
            m.training = module.get_submodule(name).training if name else module.training
        except AttributeError:
            pass
    if inputs is not None:
        safety = analysis.RunSafety(gm, inputs)
        job.report.shapes_checked = True
    else:
        safety = analysis.StaticSafety(dict(gm.named_modules()))
    if written is not None:
        safety = analysis.ReturnedWritten(safety, dict(gm.named_modules()), written)
    # keep_modules: the swaps go into the module itself, which is the result; the graph only informs them
    result = module if job.keep_modules else gm
    _convert_graph(gm, safety, job, f"{qual}." if qual else "", result)
    # Leaves holding norms (modules whose forward reads self.training, or a
    # custom tracer's leaves) are converted on their own.
    calls: Dict[str, List[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls.setdefault(n.target, []).append(n)
    for target, nodes in calls.items():
        leaf = gm.get_submodule(target)
        if isinstance(leaf, analysis.LAYER_TYPES) or analysis.is_norm(leaf) or not analysis.has_norm(leaf, job.handled):
            continue
        # what its output meets here: in-place writes, or a layer made above that overwrites its input (judged
        # before the leaf was converted: its result was then no layer's saved output)
        writer = next(filter(None, (safety.modified_in_place(n) or _overwritten_by_layer(n, result) for n in nodes)),
                      None)
        analysis.set_submodule(result, target, _convert_once(leaf, f"{qual}.{target}" if qual else target, job,
                                                             None if writer is None else f"by {writer}"))
    return result


def _overwritten_by_layer(node: fx.Node, owner: nn.Module) -> Optional[str]:
    """The converted in-place layer (not ``preserve_input``) that takes ``node``'s value as its input, described."""
    for u in node.users:
        if u.op == "call_module" and u.args and u.args[0] is node:
            layer = owner.get_submodule(u.target)
            if isinstance(layer, (InPlaceABN, InPlaceAGN)) and not layer.preserve_input:
                return f"{u.target} ({type(layer).__name__}, which overwrites its input)"
    return None


def _convert_once(module: nn.Module, qual: str, job: _Job, written: Optional[str] = None) -> nn.Module:
    """`_convert` of a submodule, once per module object (a module registered twice stays one module)."""
    if id(module) in job.handled:
        return module  # rewritten (or left) at module level already
    if id(module) not in job.done:
        inputs = None if job.inputs is None else job.inputs.get(id(module))
        job.done[id(module)] = _convert(module, qual, None, None, inputs, job, written)
    return job.done[id(module)]


def _convert_children(module: nn.Module, qual: str, job: _Job, why: str, written: Optional[str] = None
                      ) -> nn.Module:
    """Keep ``module``'s own forward; convert each child holding norms on its
    own, and leave (and report) the norms the forward calls directly.
    ``written``: why the code calling ``module`` may write what it returns in
    place (what a child returns may be returned on), else its own code's."""
    job.report.warnings.append(f"{why}: kept as it is, its submodules converted one by one")
    logger.warning("convert_model: %s", job.report.warnings[-1])
    _convert_members(module, qual, job, why, outer=written)
    return module


def _convert_members(module: nn.Module, qual: str, job: _Job, why: str, reach_all: bool = False,
                     outer: Optional[str] = None, writes: Optional[Dict[str, str]] = None,
                     key: Optional[str] = None) -> None:
    """Convert each child of ``module`` holding norms on its own; a child
    whose submodules ``module``'s code uses directly (or, ``reach_all``, any
    child) is kept as it is too, its own children converted one by one.
    ``outer``: why the code calling ``module`` may write what it returns in
    place; ``writes``: `code_writes_in_place` of the code that calls the
    children (``module``'s, or for a container its owner's, ``key`` its name there)."""
    reached = None if reach_all else analysis.reached_into(type(module))
    if writes is None:
        writes = analysis.code_writes_in_place(module)
    for name, child in module.named_children():
        child_qual = f"{qual}.{name}" if qual else name
        if isinstance(child, analysis.LAYER_TYPES) or not analysis.has_norm(child, job.handled):
            continue
        container = type(child).forward is nn.Module.forward  # ModuleList, ModuleDict: not called itself
        inside = reached is None or name in reached or (not container and f"{name}[]" in reached)
        if analysis.is_norm(child):
            job.report.left.append(LeftLayer(child_qual, f"called by a forward kept as Python code: {why}"))
            continue
        if container:  # (its items are called by module's code)
            _convert_members(child, child_qual, job, why, reach_all=inside, outer=outer, writes=writes,
                             key=key or name)
            continue
        # why the code calling the child may write what it returns in place
        written = outer or writes.get(key or name) or writes.get("*")
        if inside:
            _convert_children(child, child_qual, job, f"the code of {qual or 'the model'} "
                                                      f"({type(module).__name__}) may use the submodules of "
                                                      f"{child_qual} directly", written)
        else:
            new = _convert_once(child, child_qual, job, written)
            if new is not child:
                setattr(module, name, new)


def _convert_graph(gm: fx.GraphModule, safety, job: _Job, prefix: str, owner: nn.Module) -> None:
    """Replace each convertible BatchNorm or GroupNorm call of ``gm`` (and what it fuses) by an
    in-place layer; ``prefix`` makes the reported names qualified in the model. ``owner``: ``gm``,
    or with ``job.keep_modules`` the traced module, whose modules are swapped instead (the norm
    for the layer, a fused activation module for an nn.Identity; the graph is left as it is)."""
    report = job.report
    modules = dict(gm.named_modules())
    calls: Dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    for bn in list(gm.graph.nodes):
        if bn.op == "call_function" and bn.target in _FUNCTIONAL_NORMS:
            report.left.append(LeftLayer(prefix + bn.name, f"functional {_FUNCTIONAL_NORMS[bn.target]} "
                                                           "(no module to hold an in-place layer)"))
            continue
        if bn.op != "call_module" or not analysis.is_norm(modules[bn.target]):
            continue
        target = bn.target
        if any(x.name == prefix + target for x in report.left):
            continue  # reported at its first call, or from the graph of a module holding it
        elsewhere = job.calls.get(id(modules[target]), 0) - calls[target]
        reason = analysis.module_problem(bn, modules, calls) or (
            f"it is also called by another traced forward ({elsewhere} call{'s' if elsewhere > 1 else ''})"
            if elsewhere > 0 else None)
        if reason:
            report.left.append(LeftLayer(prefix + target, reason))
            continue
        # An input that may not be overwritten: the layer with preserve_input (its output in a
        # new tensor, still the only tensor it keeps), where it fuses an activation or an add
        keep_input = safety.input_problem(bn)
        if keep_input is not None and not analysis.can_preserve(bn, keep_input):
            report.left.append(LeftLayer(prefix + target, keep_input))
            continue
        # (no standalone layer then: a new output beside an input kept alive would save more)
        candidates, notes = analysis.find_candidates(bn, modules, job.relu_to, job.residual,
                                                     job.standalone and keep_input is None)
        if keep_input is not None:
            candidates = analysis.preserve_candidates(bn, candidates, notes, safety)
        if job.keep_modules:
            candidates = analysis.module_level_candidates(candidates, notes, modules,
                                                          lambda m: job.calls.get(id(m), 0))
        chosen = analysis.choose(bn, candidates, notes, safety)
        if chosen is None:
            why = "; ".join(notes) if notes else "nothing to fuse"
            report.left.append(LeftLayer(prefix + target, f"{keep_input}; {why}" if keep_input else why))
            continue
        layer, small = make_layer(modules[target], chosen.activation, chosen.param)
        if keep_input is not None:
            layer.preserve_input = True
            notes.insert(0, f"preserve_input: {keep_input}")
        analysis.set_submodule(owner, target, layer)
        modules[target] = layer
        safety.converted(bn, chosen, preserve=keep_input is not None)
        if job.keep_modules:
            if chosen.act is not None:  # (the layer applies it; the analysis of later norms sees an alias)
                modules[chosen.act.target] = nn.Identity()
                analysis.set_submodule(owner, chosen.act.target, modules[chosen.act.target])
        else:
            _rewrite(gm, bn, chosen)
        report.converted.append(ConvertedLayer(prefix + target, chosen.pattern, chosen.activation, chosen.param,
                                               chosen.source, "; ".join(notes), small))
    if not job.keep_modules:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()


def _rewrite(gm: fx.GraphModule, bn: fx.Node, chosen: "analysis.Candidate") -> None:
    """Make the ``bn`` node compute the whole candidate and drop the nodes it absorbs."""
    if chosen.add is not None:
        chosen.add.prepend(bn)  # the fused layer runs where the add was (the shortcut exists there)
        bn.kwargs = {"residual": chosen.shortcut}
    last = chosen.act if chosen.act is not None else chosen.add
    if last is not None:
        last.replace_all_uses_with(bn)
        gm.graph.erase_node(last)
    if chosen.act is not None and chosen.add is not None:
        gm.graph.erase_node(chosen.add)
