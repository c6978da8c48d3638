"""Module-level conversion of diffusers' UNet building blocks (docs/DESIGN.md section 9.1).

torch.fx cannot trace diffusers' UNets (their forwards branch on shapes and
on ``self.training``), so `convert_model` rewrites the blocks whose forward it
knows instead of tracing them. Imported by `convert_model` only when
``diffusers`` is already imported (a model holding diffusers blocks implies
it): diffusers is never a dependency of this package. Written against
diffusers 0.42.1; the tests compare every converted block with the stock one.

- ``ResnetBlock2D`` (``time_embedding_norm="default"``, a supported
  nonlinearity): the instance's class becomes `InPlaceResnetBlock2D`, whose
  forward is ResnetBlock2D's with ``norm1 -> nonlinearity`` and
  ``norm2 -> nonlinearity`` each done by one `InPlaceAGN` stored as ``norm1`` /
  ``norm2`` (same state-dict keys). ``norm2`` reads ``conv1(..) (+ temb)``,
  which nothing else reads: it is overwritten directly. ``norm1`` reads the
  block input, which the shortcut reads again: it is made with
  ``preserve_input=True`` (its output goes to a new tensor, which is all it
  keeps for backward; see section 9.1 for the measured cost).
- ``Attention`` and ``Transformer2DModel``: their GroupNorm (``group_norm``,
  ``norm``) feeds a projection, not an activation, and its input is the
  residual: left, with that reason.
- ``UNet2DModel`` / ``UNet2DConditionModel`` (their own forward):
  ``conv_norm_out -> conv_act`` becomes one `InPlaceAGN` (``conv_act`` an
  ``nn.Identity``). Its input is the last up block's output, which that
  forward reads nowhere else and no operation saves (a residual sum or a
  division by a constant).
"""
from typing import Optional, Set, Tuple

import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from diffusers.models.unets.unet_2d import UNet2DModel
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.utils import deprecate

from . import _convert_analysis as analysis
from ._convert_weights import make_layer


class InPlaceResnetBlock2D(ResnetBlock2D):
    """ResnetBlock2D whose ``norm1`` and ``norm2`` are `InPlaceAGN` layers that
    also apply the block's nonlinearity (``self.nonlinearity`` still serves the
    time embedding). Made by `convert_model` from a ResnetBlock2D instance
    (its class is swapped: submodules, parameters and names stay)."""

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", "The `scale` argument is deprecated and will be ignored.")
        if self.fused_norm1:  # (preserve_input: the shortcut reads input_tensor again)
            hidden_states = self.norm1(input_tensor)
        else:
            hidden_states = self.nonlinearity(self.norm1(input_tensor))
        if self.upsample is not None:
            if hidden_states.shape[0] >= 64:  # as diffusers: upsample_nearest_nhwc fails with large batches
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)
        hidden_states = self.conv1(hidden_states)
        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]
        if temb is not None:
            hidden_states = hidden_states + temb
        hidden_states = self.norm2(hidden_states)  # + nonlinearity, in place: nothing else reads its input
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)
        if self.conv_shortcut is not None:
            if self.training:
                input_tensor = input_tensor.contiguous()
            input_tensor = self.conv_shortcut(input_tensor)
        return (input_tensor + hidden_states) / self.output_scale_factor


def _activation_of(module: nn.Module, relu_to) -> Tuple[Optional[tuple], Optional[str]]:
    """((activation, param, description), None) for a supported activation module, else (None, why not)."""
    found = analysis.map_relu(analysis.module_activation(module), relu_to)
    if found is None:
        return None, f"its nonlinearity {type(module).__name__} is not a supported activation"
    problem = analysis.act_problem(found[0], found[1])
    return (None, f"activation {found[2]}: {problem}") if problem else (found, None)


def _norm_problem(norm: nn.Module) -> Optional[str]:
    if type(norm) is not nn.GroupNorm:
        return f"{type(norm).__name__} is not a plain GroupNorm"
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in norm.parameters()):
        return "lazy module not initialised yet"
    return None


def _resnet_block_problem(block: ResnetBlock2D, relu_to) -> Tuple[Optional[tuple], Optional[str]]:
    if type(block) is not ResnetBlock2D:
        return None, f"{type(block).__name__} is a subclass of ResnetBlock2D (its forward is not known)"
    if block.time_embedding_norm != "default":
        return None, (f"time_embedding_norm={block.time_embedding_norm!r}: norm2 is not followed by the "
                      "nonlinearity (only 'default' is converted)")
    act, problem = _activation_of(block.nonlinearity, relu_to)
    problem = problem or _norm_problem(block.norm1) or _norm_problem(block.norm2)
    return act, problem


def convert_resnet_block(block: ResnetBlock2D, relu_to, fuse_norm1: bool = True):
    """Make ``block`` an `InPlaceResnetBlock2D` in place. Returns ``(layers, None)``
    with ``layers`` = [(name, layer, small, act)] of the converted norms, or
    ``(None, why)`` when the block's configuration is not supported (the block
    is then untouched). ``fuse_norm1=False`` leaves norm1 a stock GroupNorm
    (the alternative measured in benchmarks/bench_unet.py)."""
    act, problem = _resnet_block_problem(block, relu_to)
    if problem:
        return None, problem
    names = ("norm1", "norm2") if fuse_norm1 else ("norm2",)
    layers = []
    for name in names:
        layer, small = make_layer(getattr(block, name), act[0], act[1])
        layer.preserve_input = name == "norm1"  # the shortcut reads the block input again
        setattr(block, name, layer)
        layers.append((name, layer, small, act))
    block.__class__ = InPlaceResnetBlock2D
    block.fused_norm1 = fuse_norm1
    return layers, None


def _convert_unet_output(unet: nn.Module, relu_to):
    """``conv_norm_out -> conv_act`` of a UNet fused; ([(name, layer, small, act)], None) or (None, why)."""
    if type(unet).forward not in (UNet2DModel.forward, UNet2DConditionModel.forward):
        return None, f"{type(unet).__name__} has its own forward"
    if getattr(unet, "conv_norm_out", None) is None:
        return [], None
    act, problem = _activation_of(unet.conv_act, relu_to)
    problem = problem or _norm_problem(unet.conv_norm_out)
    if problem:
        return None, problem
    layer, small = make_layer(unet.conv_norm_out, act[0], act[1])
    unet.conv_norm_out = layer
    unet.conv_act = nn.Identity()
    return [("conv_norm_out", layer, small, act)], None


def rewrite(model: nn.Module, relu_to, report, handled: Set[int], fuse_norm1: bool = True) -> None:
    """Convert every known diffusers block of ``model`` in place, appending to
    ``report`` (a `ConversionReport`) and adding the ids of the blocks it
    converted or left to ``handled`` (the traced conversion skips them)."""
    from .convert import ConvertedLayer, LeftLayer

    for qual, module in list(model.named_modules()):
        prefix = f"{qual}." if qual else ""
        if isinstance(module, ResnetBlock2D):
            kind, norms = "diffusers ResnetBlock2D", ("norm1", "norm2")
            layers, why = convert_resnet_block(module, relu_to, fuse_norm1)
            handled.add(id(module))
        elif isinstance(module, (UNet2DModel, UNet2DConditionModel)):
            kind, norms = f"diffusers {type(module).__name__} output", ("conv_norm_out",)
            layers, why = _convert_unet_output(module, relu_to)
            if not layers and not why:
                continue
        elif isinstance(module, (Attention, Transformer2DModel)):
            name = "group_norm" if isinstance(module, Attention) else "norm"
            if isinstance(getattr(module, name, None), nn.GroupNorm):
                handled.add(id(module))
                report.left.append(LeftLayer(prefix + name, f"diffusers {type(module).__name__}: its GroupNorm "
                                             "feeds a projection, not an activation, and its input is the "
                                             "residual (read again)"))
            continue
        else:
            continue
        if why:
            report.left += [LeftLayer(prefix + n, f"{why} ({kind}, module-level rewrite)") for n in norms]
            continue
        report.rewritten.append(f"{qual or 'the model'} ({kind})")
        for name, layer, small, (activation, param, desc) in layers:
            how = f"{desc}, module-level rewrite of {kind}"
            if name == "norm1":
                how += "; preserve_input (the shortcut reads the block input)"
            report.converted.append(ConvertedLayer(prefix + name, "gn+act", activation, param, how, "", small))
