"""convert_model on GroupNorms: GroupNorm -> activation and GroupNorm -> add ->
activation in traced graphs, the module-level rewrite of diffusers
ResnetBlock2D / UNet outputs, safety (unsafe GroupNorms left with a reason),
float64 equivalence of outputs and gradients with the stock model, state-dict
keys and the memory saved."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from inplace_abn import InPlaceAGN
from inplace_abn.convert import convert_model, load_batchnorm_state_dict
from inplace_abn.memory import model_saved_bytes


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _randomize_gn(model, seed=0):
    """Non-trivial GroupNorm weights (some negative) and biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.GroupNorm) and m.affine:
                C = m.num_channels
                w = torch.rand(C, generator=g, dtype=m.weight.dtype) + 0.5
                m.weight.copy_(torch.where(torch.rand(C, generator=g) < 0.3, -w, w))
                m.bias.copy_(torch.randn(C, generator=g, dtype=m.bias.dtype) * 0.2)
    return model


def _run(model, inputs):
    """Output and the gradients of the floating inputs and of every parameter (by name)."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    out = getattr(out, "sample", out)
    dy = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
    out.backward(dy)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), [t.grad for t in inputs if t.is_floating_point()], grads


def _assert_same(stock, converted, inputs, tol=1e-9):
    out_s, dx_s, g_s = _run(stock, inputs)
    out_c, dx_c, g_c = _run(converted, inputs)
    torch.testing.assert_close(out_c, out_s, rtol=tol, atol=tol)
    for a, b in zip(dx_c, dx_s):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-8)
    assert g_c.keys() == g_s.keys()
    for name in g_s:
        torch.testing.assert_close(g_c[name], g_s[name], rtol=1e-7, atol=1e-8, msg=name)


# ---- traced graphs ---------------------------------------------------------------------------


class GNBlock(nn.Module):
    """conv -> GN -> SiLU (module) -> conv -> GN -> (+ shortcut) -> LeakyReLU (functional)."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.gn1 = nn.GroupNorm(4, c)
        self.act = nn.SiLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.gn2 = nn.GroupNorm(2, c)

    def forward(self, x):
        h = self.act(self.gn1(self.conv1(x)))
        return F.leaky_relu(self.gn2(self.conv2(h)) + x, 0.1)


class GNChain(nn.Module):
    """GN with ReLU, ELU, F.silu and a GN whose input is read again (unsafe)."""

    def __init__(self, cin=3, c=8, relu_slope=None):
        super().__init__()
        self.relu_slope = relu_slope  # the reference: ReLU as convert_model maps it
        self.conv0 = nn.Conv2d(cin, c, 3, padding=1)
        self.gn_relu = nn.GroupNorm(4, c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.gn_elu = nn.GroupNorm(4, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.gn_silu = nn.GroupNorm(8, c)
        self.conv3 = nn.Conv2d(c, c, 1)
        self.gn_reread = nn.GroupNorm(2, c)

    def forward(self, x):
        h = self.gn_relu(self.conv0(x))
        h = torch.relu(h) if self.relu_slope is None else F.leaky_relu(h, self.relu_slope)
        h = F.elu(self.gn_elu(self.conv1(h)), 0.5)
        h = F.silu(self.gn_silu(self.conv2(h)))
        t = self.conv3(h)
        return F.silu(self.gn_reread(t)) * t.mean()  # t is read after the GroupNorm


@pytest.mark.parametrize("with_inputs", [False, True])
def test_traced_groupnorm_patterns_match_stock_in_float64(with_inputs):
    torch.manual_seed(0)
    stock = _randomize_gn(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), GNBlock(), GNChain(cin=8))).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    converted, report = convert_model(stock, example_inputs=(x,) if with_inputs else None, return_report=True)
    found = {c.name: c for c in report.converted}
    assert found["1.gn1"].pattern == "gn+act" and found["1.gn1"].activation == "silu"
    assert found["1.gn2"].pattern == "gn+add+act" and found["1.gn2"].activation_param == 0.1
    assert found["2.gn_relu"].activation == "leaky_relu" and found["2.gn_relu"].activation_param == 0.01
    assert found["2.gn_elu"].activation == "elu" and found["2.gn_elu"].activation_param == 0.5
    assert found["2.gn_silu"].activation == "silu"
    # its input is read again (by the mean): converted with preserve_input
    reread = found["2.gn_reread"]
    assert not report.left and reread.pattern == "gn+act", report
    assert reread.note.startswith("preserve_input: ") and ("read again" in reread.note or "also read" in reread.note)
    assert converted.get_submodule("2.gn_reread").preserve_input
    assert isinstance(converted.get_submodule("1.gn2"), InPlaceAGN)
    assert converted.get_submodule("1.gn2").weight_mode == "signed"
    assert "GroupNorm layers to InPlaceAGN" in report.summary()
    assert converted.state_dict().keys() == stock.state_dict().keys()
    reference = copy.deepcopy(stock)
    reference[2].relu_slope = 0.01  # convert_model's default activation replaces ReLU
    _assert_same(reference, converted, (x,))
    # the stock state dict loads into the converted model and gives the same function
    other = _randomize_gn(copy.deepcopy(stock), seed=3)
    load_batchnorm_state_dict(converted, other.state_dict())
    other[2].relu_slope = 0.01
    with torch.no_grad():
        torch.testing.assert_close(converted(x), other(x), rtol=1e-9, atol=1e-9)


def test_groupnorm_conversion_saves_memory():
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(), nn.Conv2d(16, 3, 1))
    x = torch.randn(2, 3, 16, 16)
    converted, report = convert_model(stock, example_inputs=(x,), return_report=True)
    assert report.counts() == {"gn+act": 2, "left": 0}
    stock_b, conv_b = model_saved_bytes(stock, x), model_saved_bytes(converted, x)
    act = 2 * 16 * 16 * 16 * 4  # one activation tensor
    # stock keeps GN input, SiLU input and conv input per pair; converted only the last (+ mask, variances)
    assert stock_b - conv_b >= 2 * 2 * act * 0.95, (stock_b, conv_b)


def test_unsafe_groupnorms_keep_their_input_functional_ones_are_left():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.gn = nn.GroupNorm(2, 4)
            self.gn_in = nn.GroupNorm(2, 4)

        def forward(self, x, x2):
            t = self.conv(x)
            y = F.silu(self.gn(t)) + t  # t read again by the add
            z = F.silu(F.group_norm(y, 2))
            return F.silu(self.gn_in(x2)) + z  # x2 is a model input

    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    model = M().double()
    for inputs in (None, (x, x.clone())):
        converted, report = convert_model(model, example_inputs=inputs, return_report=True)
        reasons = {x.name: x.reason for x in report.left}
        assert list(reasons) == ["group_norm"] and "functional group_norm" in reasons["group_norm"], reasons
        notes = {c.name: c.note for c in report.converted}
        assert "preserve_input: " in notes["gn"] and "read" in notes["gn"], notes
        assert "preserve_input: " in notes["gn_in"] and "model input" in notes["gn_in"], notes
        x2 = x.clone()
        with torch.no_grad():
            torch.testing.assert_close(converted(x, x2), model(x, x2), rtol=1e-12, atol=1e-12)
        assert torch.equal(x2, x)  # the caller's tensor is not written


# ---- diffusers -----------------------------------------------------------------------------------


def _block(**kw):
    from diffusers.models.resnet import ResnetBlock2D

    args = dict(in_channels=8, out_channels=16, temb_channels=6, groups=4, eps=1e-6)
    args.update(kw)
    return ResnetBlock2D(**args)


@pytest.mark.parametrize("kw", [{}, {"up": True}, {"down": True}, {"out_channels": 8, "output_scale_factor": 2.0},
                                {"non_linearity": "relu", "conv_shortcut": True, "skip_time_act": True}, {"temb_channels": None}])
def test_resnet_block_rewrite_matches_stock_in_float64(kw):
    pytest.importorskip("diffusers")
    from inplace_abn._convert_diffusers import InPlaceResnetBlock2D

    torch.manual_seed(0)
    stock = _randomize_gn(_block(**kw)).double()
    x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    temb = torch.randn(2, 6, dtype=torch.float64)
    converted, report = convert_model(stock, return_report=True)
    assert type(converted) is InPlaceResnetBlock2D
    assert isinstance(converted.norm1, InPlaceAGN) and isinstance(converted.norm2, InPlaceAGN)
    assert [c.name for c in report.converted] == ["norm1", "norm2"] and not report.left
    assert report.rewritten == ["the model (diffusers ResnetBlock2D)"]
    assert "module-level" in report.converted[0].source and "module level" in report.summary()
    if kw.get("non_linearity") == "relu":
        assert converted.norm1.activation == "leaky_relu"  # ReLU becomes convert_model's activation
        stock.nonlinearity = nn.LeakyReLU(0.01)  # what the converted norms apply (skip_time_act: temb has none)
    assert converted.state_dict().keys() == stock.state_dict().keys()
    inputs = (x, temb) if kw.get("temb_channels", 6) else (x,)
    if len(inputs) == 1:  # no time embedding
        _assert_same(_NoTemb(stock), _NoTemb(converted), inputs)
    else:
        _assert_same(stock, converted, inputs)


class _NoTemb(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x, None)


@pytest.mark.parametrize("kw, why", [({"non_linearity": "mish"}, "Mish is not a supported activation"),
                                     ({"time_embedding_norm": "scale_shift"}, "time_embedding_norm='scale_shift'")])
def test_unsupported_resnet_blocks_are_left_with_reasons(kw, why):
    pytest.importorskip("diffusers")
    block = _block(**kw)
    converted, report = convert_model(block, return_report=True)
    assert not report.converted and type(converted) is type(block)
    assert [x.name for x in report.left] == ["norm1", "norm2"]
    assert all(why in x.reason and "module-level" in x.reason for x in report.left), report.left


def _unet():
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16),
                       layers_per_block=1, norm_num_groups=4, attention_head_dim=4,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def test_unet2d_model_converted_matches_stock_and_saves_memory():
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    stock = _randomize_gn(_unet()).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    t = torch.tensor([3, 700])
    converted, report = convert_model(stock, return_report=True)
    # two pairs per ResnetBlock2D and the output pair; the attentions' GroupNorms are left
    blocks = [m for m in stock.modules() if type(m).__name__ == "ResnetBlock2D"]
    assert report.counts() == {"gn+act": 2 * len(blocks) + 1, "left": 4}, report
    assert all("diffusers Attention: its GroupNorm feeds a projection" in x.reason for x in report.left)
    assert any("UNet2DModel output" in r for r in report.rewritten)
    assert converted.state_dict().keys() == stock.state_dict().keys()

    class Call(nn.Module):
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, x):
            return self.unet(x, t).sample

    _assert_same(Call(stock), Call(converted), (x,))
    stock_b = model_saved_bytes(stock.float().train(), x.float(), t)
    conv_b = model_saved_bytes(converted.float().train(), x.float(), t)
    assert conv_b < 0.7 * stock_b, (conv_b, stock_b)


def test_unet2d_condition_model_converted_matches_stock():
    pytest.importorskip("diffusers")
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    stock = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                 layers_per_block=1, norm_num_groups=4, cross_attention_dim=8,
                                 attention_head_dim=2, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    stock = _randomize_gn(stock).double()
    converted, report = convert_model(stock, return_report=True)
    blocks = [m for m in stock.modules() if type(m).__name__ == "ResnetBlock2D"]
    assert report.counts()["gn+act"] == 2 * len(blocks) + 1
    assert report.left and all("diffusers Transformer2DModel" in x.reason for x in report.left), report
    assert not report.warnings  # every GroupNorm was decided at module level: no traced fallbacks
    assert converted.state_dict().keys() == stock.state_dict().keys()
    t = torch.tensor([10, 500])
    ctx = torch.randn(2, 3, 8, dtype=torch.float64)

    class Call(nn.Module):
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, x, ctx):
            return self.unet(x, t, encoder_hidden_states=ctx).sample

    _assert_same(Call(stock), Call(converted), (torch.randn(2, 4, 8, 8, dtype=torch.float64), ctx))
