"""Edge cases of `fuse_for_inference` and `convert_model` that used to be
silently wrong or to raise where stock PyTorch works (issue 11, items 5, 6, 9).

References are stock ``torch.nn`` models (or stock batch_norm + activation)
evaluated in float64."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from inplace_abn import ABN, FoldedABN, InPlaceABN, fuse_for_inference
from reference import rel_err

# ---- fuse_for_inference on a model torch.fx cannot trace (item 5) -------------------------


def _randomise_abn(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ABN):
                C = m.num_features
                m.weight.copy_(torch.rand(C, generator=g, dtype=m.weight.dtype) + 0.5)
                m.bias.copy_(torch.randn(C, generator=g, dtype=m.bias.dtype))
                m.running_mean.copy_(torch.randn(C, generator=g, dtype=m.running_mean.dtype))
                m.running_var.copy_(torch.rand(C, generator=g, dtype=m.running_var.dtype) + 0.5)
    return model.eval()


def _stock_abn(layer, h):
    """Stock eval-mode BatchNorm + activation of an ABN (weight used as it is)."""
    z = F.batch_norm(h, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.0, layer.eps)
    return F.leaky_relu(z, layer.activation_param)


class _Untraceable(nn.Module):
    """A conv + ABN pair inside an nn.Sequential, data-dependent control flow
    (torch.fx cannot trace it), and the conv used outside the Sequential too."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.seq = nn.Sequential(nn.Conv2d(3, 4, 1), ABN(4, activation="leaky_relu", activation_param=0.1))

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent: torch.fx cannot trace this
            x = x * 1.0
        if self.use == "read_twice":  # the conv's output read by the layer and by the add
            h = self.seq[0](x)
            return self.seq[1](h) + h
        if self.use == "conv_alone":  # the conv called through the Sequential and alone
            return self.seq(x) + self.seq[0](x)
        return self.seq(x)  # the Sequential alone: the fold is valid

    def reference(self, x):
        conv, abn = self.seq
        h = conv(x)
        y = _stock_abn(abn, h)
        return y + h if self.use in ("read_twice", "conv_alone") else y


@pytest.mark.parametrize("use", ["read_twice", "conv_alone"])
def test_fuse_untraceable_conv_used_outside_sequential_refuses(use):
    """Before: the conv was folded (the Sequential 'proved' it) and the output
    was off by 2.2 (relative), silently. Now the folded pair refuses to run
    outside its Sequential; without conv folding the result is exact."""
    model = _randomise_abn(_Untraceable(use)).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = model.reference(x)
        fused = fuse_for_inference(model)
        assert fused.seq[1].scale is None  # folded, guarded
        with pytest.raises(RuntimeError, match="fold_conv=False"):
            fused(x)
        plain = fuse_for_inference(model, fold_conv=False)
        assert rel_err(plain(x), ref) < 1e-12


def test_fuse_untraceable_guarded_fold_is_exact_and_survives_copies():
    model = _randomise_abn(_Untraceable("sequential")).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = model.reference(x)
        fused = fuse_for_inference(model)
        assert fused.seq[1].scale is None
        assert rel_err(fused(x), ref) < 1e-12
        for again in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
            assert rel_err(again(x), ref) < 1e-12
            with pytest.raises(RuntimeError, match="outside that Sequential"):
                again.seq[0](x)  # the guard travels with the model
        buf = io.BytesIO()
        torch.save(fused, buf)
        buf.seek(0)
        with pytest.raises(RuntimeError, match="outside that Sequential"):
            torch.load(buf, weights_only=False).seq[0](x)


def test_fuse_untraceable_shared_conv_or_custom_sequential_not_folded():
    """A conv registered under a second name, or a Sequential with its own
    forward, proves nothing: scale/shift folding only, exact."""

    class Shared(_Untraceable):
        def __init__(self):
            super().__init__("sequential")
            self.alias = self.seq[0]

        def forward(self, x):
            return super().forward(x) + self.alias(x)

        def reference(self, x):
            return super().reference(x) + self.seq[0](x)

    class Reordered(nn.Sequential):
        def forward(self, x):
            h = self[0](x)
            return self[1](h) + h

    custom = _Untraceable("sequential")
    custom.seq = Reordered(*custom.seq)
    custom.reference = lambda x: (lambda h: _stock_abn(custom.seq[1], h) + h)(custom.seq[0](x))
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for model in (_randomise_abn(Shared()).double(), _randomise_abn(custom).double()):
        with torch.no_grad():
            ref = model.reference(x)
            fused = fuse_for_inference(model)
            assert fused.seq[1].scale is not None
            assert rel_err(fused(x), ref) < 1e-12


def test_fuse_traced_conv_weight_read_directly_not_folded():
    """fx path: a forward that also reads the conv's weight (F.conv2d(x, self.conv.weight))."""

    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1, bias=False)
            self.abn = InPlaceABN(4, activation="leaky_relu", activation_param=0.1)

        def forward(self, x):
            return self.abn(self.conv(x)) + F.conv2d(x, self.conv.weight)

    model = _randomise_abn(Direct()).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        fused = fuse_for_inference(model)
        assert isinstance(fused.abn, FoldedABN) and fused.abn.scale is not None
        assert rel_err(fused(x), ref) < 1e-12
