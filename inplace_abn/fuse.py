"""Inference folding: `fuse_for_inference` turns every eval-mode ABN,
InPlaceABN and InPlaceABNSync of a model into standard operators.

In eval mode such a layer computes, per channel c (docs/DESIGN.md section 1),

    y = f(scale * x + shift [+ residual]),
    scale = g~ / sqrt(running_var + eps),  shift = beta - running_mean * scale,

with g~ = |gamma| + eps ("abs") or sign(gamma)(|gamma| + eps) ("signed";
stock `ABN` uses gamma itself). `FoldedABN` holds scale and shift as
buffers and evaluates this with multiply, add and the stock activation: no
custom operator, nothing in place, and a torch.export or ONNX graph of
``Mul, Add, LeakyRelu`` (or Elu, Sigmoid+Mul, Relu). One exception keeps the
model's meaning: an in-place layer overwrote its input, so where something
may read that input afterwards (seen in a torch.fx trace; always, when the
model cannot be traced) its `FoldedABN` writes the result into it too.

When the layer's input is the output of a convolution used by nothing else,
scale and shift go into the convolution's weight and bias instead, and the
layer becomes its activation alone (``Conv, LeakyRelu``). "Used by nothing
else" is proven, not assumed: inside an ``nn.Sequential`` (a Conv directly
followed by the layer), or from a ``torch.fx`` trace of the model in which
the convolution and the layer are each called once and the layer is the
convolution's only user. In a model that torch.fx cannot trace the graph is
unknown: only a Conv directly followed by the layer inside a stock
``nn.Sequential`` (its ``forward`` not overridden, neither module registered
anywhere else) is folded, and that fold is guarded: the folded convolution and
activation raise a RuntimeError when called other than as that pair inside the
Sequential's own ``forward`` (a conv also called alone, or its output read by
anything but the layer, would otherwise be silently wrong). Every other layer
becomes a scale/shift `FoldedABN`, which is exact whatever the graph.
"""
import copy
from typing import Optional

import torch
import torch.nn as nn

from . import _activation
from .abn import ABN, InPlaceABN

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class FoldedABN(nn.Module):
    """y = f(scale * x + shift [+ residual]) with stock operators (inference only).

    ``scale`` and ``shift`` are (C,) buffers, or None when they were folded
    into the preceding convolution (the module is then the activation alone).
    ``forward(x, residual=None)`` takes the arguments of the layer it replaces
    and returns a new tensor (x is not overwritten), or, with ``write_input``,
    writes the result into x and returns x, as the in-place layer it replaces
    did (used where something may read x afterwards).
    """

    write_input = False  # default for modules pickled before the attribute existed

    def __init__(self, scale: Optional[torch.Tensor], shift: Optional[torch.Tensor], activation: str = "identity",
                 activation_param: float = 0.01, write_input: bool = False):
        super().__init__()
        self.register_buffer("scale", scale)
        self.register_buffer("shift", shift)
        self.activation = activation
        self.activation_param = activation_param
        self.write_input = write_input

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        z = x
        if self.scale is not None:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            z = z * self.scale.view(shape) + self.shift.view(shape)
        if residual is not None:
            z = z + residual
        y = _activation.apply(z, self.activation, self.activation_param)
        return x.copy_(y) if self.write_input else y

    def extra_repr(self) -> str:
        folded = "" if self.scale is not None else ", folded into the convolution"
        param = f"[{self.activation_param}]" if self.activation in ("leaky_relu", "elu") else ""
        written = ", writes its input" if self.write_input else ""
        return f"activation={self.activation}{param}{folded}{written}"


def _scale_shift(layer: ABN):
    """(scale, shift) of an eval-mode layer, computed in float64."""
    var = layer.running_var.detach().double()
    mean = layer.running_mean.detach().double()
    if layer.weight is None:
        g = torch.ones_like(var)
    elif isinstance(layer, InPlaceABN):
        g = _activation.effective_weight(layer.weight.detach().double(), layer.eps, layer.weight_mode == "signed")
    else:  # ABN: stock BatchNorm weight
        g = layer.weight.detach().double()
    beta = torch.zeros_like(var) if layer.bias is None else layer.bias.detach().double()
    scale = g * torch.rsqrt(var + layer.eps)
    return scale, beta - mean * scale


def _foldable(layer: nn.Module) -> bool:
    if not isinstance(layer, ABN):
        return False
    if layer.running_mean is None:  # batch statistics in eval mode too: nothing to fold
        return False
    if layer.training:
        raise ValueError(f"fuse_for_inference: {type(layer).__name__} is in training mode; call model.eval() first")
    return True


def _fold_into_conv(conv: nn.Module, scale: torch.Tensor, shift: torch.Tensor) -> None:
    w = conv.weight
    shape = (-1,) + (1,) * (w.dim() - 1)
    with torch.no_grad():
        new_w = (w.detach().double() * scale.view(shape)).to(w.dtype)
        b = torch.zeros_like(shift) if conv.bias is None else conv.bias.detach().double()
        new_b = (b * scale + shift).to(w.dtype)
    conv.weight = nn.Parameter(new_w, requires_grad=w.requires_grad)
    conv.bias = nn.Parameter(new_b, requires_grad=w.requires_grad)


class _SequentialFoldGuard:
    """Forward hooks that keep a fold made without a graph honest.

    ``conv`` was folded into ``layer`` because ``seq`` (a stock nn.Sequential)
    calls them one after the other. That is equivalent only while the conv is
    called by ``seq.forward`` and its output goes to ``layer`` alone, which
    the Sequential's own loop guarantees. Any other call raises. (A module-level
    class, so the hooks pickle and deep-copy with the model.)
    """

    def __init__(self, seq: str, conv: str, layer: str):
        self.names = (seq, conv, layer)
        self.depth = 0  # how many seq.forward calls are running
        self.pending = None  # the conv output the layer must receive next

    def _refuse(self, what: str):
        seq, conv, layer = self.names
        raise RuntimeError(
            f"fuse_for_inference folded convolution '{conv}' into '{layer}' because they follow each other in "
            f"nn.Sequential '{seq}' (the model could not be traced by torch.fx), but {what}: that fold is not "
            "valid for this model. Fuse with fold_conv=False, or make the model traceable by torch.fx")

    def seq_enter(self, module, args):
        self.depth += 1
        self.pending = None

    def seq_exit(self, module, args, output):
        self.depth -= 1
        self.pending = None

    def conv_enter(self, module, args):
        if self.depth == 0:
            self._refuse("the convolution was called outside that Sequential")

    def conv_exit(self, module, args, output):
        self.pending = output

    def layer_enter(self, module, args):
        if self.depth == 0 or self.pending is None or not args or args[0] is not self.pending:
            self._refuse("the layer was called other than on the convolution's output inside that Sequential")
        self.pending = None

    def install(self, seq: nn.Module, conv: nn.Module, layer: nn.Module) -> None:
        seq.register_forward_pre_hook(self.seq_enter)
        seq.register_forward_hook(self.seq_exit, always_call=True)
        conv.register_forward_pre_hook(self.conv_enter)
        conv.register_forward_hook(self.conv_exit)
        layer.register_forward_pre_hook(self.layer_enter)


def _conv_pairs_sequential(model: nn.Module):
    """(conv, layer, (guard, seq)) for each layer directly following a conv in a stock
    nn.Sequential, both registered nowhere else (see the module docstring)."""
    seen = {}
    for _, m in model.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    pairs = []
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential) or type(seq).forward is not nn.Sequential.forward:
            continue
        items = list(seq.named_children())
        for (a_name, a), (b_name, b) in zip(items, items[1:]):
            if isinstance(a, _CONVS) and _foldable(b) and seen[id(a)] == 1 and seen[id(b)] == 1:
                prefix = f"{seq_name}." if seq_name else ""
                guard = _SequentialFoldGuard(seq_name or "(the model)", prefix + a_name, prefix + b_name)
                pairs.append((a, b, (guard, seq)))
    return pairs


def _analyse_fx(model: nn.Module):
    """From a torch.fx trace: (pairs, silent), the (conv, layer, None) pairs
    proven foldable and the ids of in-place layers whose overwriting of their
    input nothing reads afterwards; None if the model does not trace."""
    import torch.fx

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, _CONVS + (ABN,)) or super().is_leaf_module(m, qualname)

    try:
        graph = _Tracer().trace(model)
    except Exception:  # dynamic control flow etc.: fall back to nn.Sequential analysis
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    calls = {}
    read_params = set()  # modules whose parameters the forward reads directly (F.conv2d(x, self.conv.weight))
    for node in graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, []).append(node)
        elif node.op == "get_attr":
            read_params.add(node.target.rpartition(".")[0])

    def observed(x, reader) -> bool:
        """Whether anything may read ``x`` (or what it aliases) after ``reader`` overwrites it."""
        if not isinstance(x, torch.fx.Node) or any(order[u] > order[reader] for u in x.users if u is not reader):
            return True
        if x.op == "call_module":
            m = model.get_submodule(x.target)
            if isinstance(m, _CONVS + (nn.Linear,)):
                return False
            if isinstance(m, InPlaceABN) and x.args:  # its output is its input
                return observed(x.args[0], x)
        return True  # a model input, a parameter, or an operation that may return a view

    pairs, silent, heard = [], set(), set()
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        layer = model.get_submodule(node.target)
        if isinstance(layer, InPlaceABN):
            (heard if not node.args or observed(node.args[0], node) else silent).add(id(layer))
        if len(calls[node.target]) != 1 or not _foldable(layer) or not node.args:
            continue
        src = node.args[0]
        if not (isinstance(src, torch.fx.Node) and src.op == "call_module" and len(calls[src.target]) == 1):
            continue
        conv = model.get_submodule(src.target)
        if not isinstance(conv, _CONVS) or src.target in read_params:
            continue
        # The layer must be the conv output's only user, and use it only as x.
        if len(src.users) != 1 or node.args.count(src) != 1 or src in node.kwargs.values():
            continue
        pairs.append((conv, layer, None))
    return pairs, silent - heard


def fuse_for_inference(model: nn.Module, fold_conv: bool = True, inplace: bool = False) -> nn.Module:
    """Replace every eval-mode ABN / InPlaceABN / InPlaceABNSync by standard operators.

    Each layer becomes a `FoldedABN`: y = f(scale * x + shift [+ residual])
    with the layer's running statistics and affine parameters folded into
    ``scale`` and ``shift`` (float64 arithmetic, stored in the layer's dtype).
    With ``fold_conv``, a layer whose input is a convolution's output used by
    nothing else (see the module docstring) is folded into that convolution's
    weight and bias, leaving only the activation.

    Layers without running statistics (``track_running_stats=False``: batch
    statistics in eval mode too) are left as they are; under torch.export
    they still become stock ``batch_norm`` + activation.

    Args:
        model: the model, in eval mode (a layer in training mode raises ValueError).
        fold_conv: also fold into preceding convolutions.
        inplace: modify ``model`` itself instead of a deep copy.
    Returns:
        The folded model, for inference: its outputs equal the original
        model's eval-mode outputs up to float rounding; it needs no custom
        operator, so torch.export and ONNX graphs of it hold only standard ones.
    """
    if not inplace:
        model = copy.deepcopy(model)
    if isinstance(model, ABN):
        if not _foldable(model):
            return model
        scale, shift = _scale_shift(model)
        dtype = model.running_mean.dtype
        return FoldedABN(scale.to(dtype), shift.to(dtype), model.activation, model.activation_param)
    facts = _analyse_fx(model)
    pairs, silent = facts if facts is not None else (_conv_pairs_sequential(model), set())
    into_conv = {id(layer): (conv, guard) for conv, layer, guard in pairs} if fold_conv else {}
    for parent in list(model.modules()):
        for name, layer in list(parent.named_children()):
            if not _foldable(layer):
                continue
            scale, shift = _scale_shift(layer)
            conv, guard = into_conv.get(id(layer), (None, None))
            if conv is not None:
                _fold_into_conv(conv, scale, shift)
                folded = FoldedABN(None, None, layer.activation, layer.activation_param)
                if guard is not None:  # proven by an nn.Sequential only: refuse any other use at run time
                    guard[0].install(guard[1], conv, folded)
            else:
                # An in-place layer overwrote x: keep doing so unless the graph shows nothing reads x later
                # (a preserve_input layer never wrote x: its input is read again)
                write = (isinstance(layer, InPlaceABN) and not layer.preserve_input
                         and id(layer) not in silent)
                dtype = layer.running_mean.dtype
                folded = FoldedABN(scale.to(dtype), shift.to(dtype), layer.activation, layer.activation_param, write)
            folded.train(False)
            setattr(parent, name, folded)
    return model


__all__ = ["FoldedABN", "fuse_for_inference"]
