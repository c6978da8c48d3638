"""benchmarks/bench_cpu.py and bench_groupnorm.py: the timed in-place step does the work
stock's does. Each case checks, before timing, that ours and stock computed the same input
and parameter gradients; until commit f7e33df ours took its input gradient with respect to
the tensor it overwrites (dy itself), which skipped the layer's input-gradient pass."""
import os
import sys

import pytest
import torch

import inplace_abn

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import bench_cpu  # noqa: E402
import bench_groupnorm  # noqa: E402


@pytest.mark.parametrize("activation", ["leaky_relu", "silu", "relu"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_bench_cpu_case_runs_and_checks(activation, channels_last):
    t_ours, t_stock, t_floor, _, _ = bench_cpu.bench((2, 8, 4, 4), activation, channels_last, repeats=2)
    assert t_ours > 0 and t_stock > 0 and t_floor > 0
    # --preserve: preserve_input on the leaf (its gradients checked against stock's too), a ratio
    *_, ratio = bench_cpu.bench((2, 8, 4, 4), activation, channels_last, repeats=2, preserve=True)
    assert ratio > 0


@pytest.mark.parametrize("activation", ["leaky_relu", "silu"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_bench_groupnorm_case_runs_and_checks(activation, channels_last):
    t_ours, t_stock = bench_groupnorm.bench((2, 64, 4, 4), activation, channels_last, repeats=2)
    assert t_stock > 0


def test_gradient_check_refuses_the_partial_step():
    """The old step's input gradient (with respect to the overwritten clone) is dy: refused."""
    layer, bn = inplace_abn.InPlaceABN(4, activation="silu"), torch.nn.BatchNorm2d(4)
    leaf, dy = torch.randn(2, 4, 3, 3).requires_grad_(), torch.randn(2, 4, 3, 3)
    x = leaf.clone()
    partial = torch.autograd.grad(layer(x), [x, layer.weight, layer.bias], dy)
    assert torch.equal(partial[0], dy)
    stock = torch.autograd.grad(torch.nn.functional.silu(bn(leaf)), [leaf, bn.weight, bn.bias], dy)
    with pytest.raises(RuntimeError, match="disagree on the input gradient"):
        bench_cpu.check_same_grads(partial, stock, "partial step")
    full = torch.autograd.grad(layer(leaf.clone()), [leaf, layer.weight, layer.bias], dy)
    bench_cpu.check_same_grads(full, stock, "full step")


def test_gradient_check_lets_kink_flips_through_and_nothing_else():
    """A z within rounding of 0 on the other side of a kink moves one entry of a gradient by a
    whole dy (4096x512 leaky_relu: the bias gradient 1.7e-3 off in norm, one element of 2M):
    up to 8 such entries pass; nine, or an error spread over every entry, do not."""
    g = torch.Generator().manual_seed(0)
    stock = [torch.randn(512, generator=g) * 64 for _ in range(3)]
    flip = [t.clone() for t in stock]
    flip[2][3] += 2.5
    assert (flip[2] - stock[2]).norm() / stock[2].norm() > 1e-3
    bench_cpu.check_same_grads(flip, stock, "one flip")
    nine = [t.clone() for t in stock]
    nine[1][:9] += 2.5
    with pytest.raises(RuntimeError, match="disagree on the weight gradient"):
        bench_cpu.check_same_grads(nine, stock, "nine flips")
    spread = [stock[0], stock[1], stock[2] * 1.003]
    with pytest.raises(RuntimeError, match="disagree on the bias gradient"):
        bench_cpu.check_same_grads(spread, stock, "spread")


def test_bench_groupnorm_unet_layers():
    """--unet finds every GroupNorm + SiLU layer of bench_unet.py's converted UNet (45, as
    convert_model reports), in both layouts."""
    pytest.importorskip("diffusers")
    layers = bench_groupnorm.unet_layers()
    assert sum(layers.values()) == 45
    assert {act for (_, _, _, act) in layers} == {"silu"} and {g for (_, _, g, _) in layers} == {8}
    assert {cl for (_, cl, _, _) in layers} == {False, True}


@pytest.mark.parametrize("activation", ["identity", "silu"])
@pytest.mark.parametrize("variant", ["ours", "stock"])
def test_count_instructions_worker_checks_and_runs(variant, activation, capsys):
    """The step that benchmarks/count_instructions.py counts under callgrind: both layers
    checked against each other first, then the steps of one; the ISA printed."""
    import count_instructions

    count_instructions.worker(variant, (2, 8, 4, 4), activation, 2)
    assert capsys.readouterr().out.strip() == f"ISA {torch.backends.cpu.get_cpu_capability()}"


def test_count_instructions_worker_refuses_different_layers(monkeypatch):
    """A stock layer that computes something else (another activation) is refused."""
    import count_instructions

    both = count_instructions.layers((2, 8, 4, 4), "silu")
    monkeypatch.setattr(count_instructions, "layers",
                        lambda shape, act: {"ours": both["ours"], "stock": torch.nn.BatchNorm2d(8)})
    with pytest.raises(RuntimeError, match="disagree on the input gradient"):
        count_instructions.worker("ours", (2, 8, 4, 4), "silu", 1)
