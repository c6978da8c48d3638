"""benchmarks/bench_models.py: the checkpoint variant's memory method, the variants'
shared initial weights, the --breakdown classification and profile, and quick runs end to end."""
import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import inplace_abn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_models.py")


def _load(path=SCRIPT):
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _classify():
    return _load(os.path.join(ROOT, "benchmarks", "breakdown.py")).classify


def _block():
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())


def test_checkpoint_memory_counts_outside_ops_and_block_inputs():
    bm = _load()
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _block(), _block())
    ckpt = copy.deepcopy(stock)
    ckpt = bm.with_checkpoints(ckpt, [(ckpt, 1), (ckpt, 2)])
    assert [type(m) for m in ckpt] == [nn.Conv2d, bm.Checkpointed, bm.Checkpointed]
    x = torch.randn(2, 3, 8, 8)
    # the stem conv saves x; each checkpointed block keeps its input (2x4x8x8 float32); nothing inside a block counts
    expected = 4 * (x.numel() + 2 * (2 * 4 * 8 * 8))
    assert bm.saved_bytes(ckpt, x) == expected
    assert bm.saved_bytes(stock, x) > expected


def test_variants_start_from_the_same_weights():
    bm = _load()
    models, _ = bm.build_variants("deeplabv3_resnet18")
    stock = models["stock"].state_dict()
    ckpt = {k.replace(".block.", "."): v for k, v in models["checkpoint"].state_dict().items()}
    assert ckpt.keys() == stock.keys()
    assert all(torch.equal(ckpt[k], stock[k]) for k in stock)
    conv = models["converted"].state_dict()
    convs = [k for k in stock if k.endswith("conv1.weight") or k.endswith("conv2.weight")]
    assert convs and all(torch.equal(conv[k], stock[k]) for k in convs)
    # the checkpoint variant computes the same function
    x = torch.randn(2, 3, 48, 48)
    for m in models.values():
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(models["checkpoint"](x)["out"], models["stock"](x)["out"])


def test_paired_ratio_is_the_median_of_per_repeat_ratios_with_its_interval():
    bm = _load()
    # a host whose speed drifts 2x over the run: each pair shares the drift, the ratio is 0.9 +- noise
    ratios = [0.9 + 0.01 * ((7 * i) % 30 - 14.5) / 14.5 for i in range(30)]
    base = [1.0 + i / 30 for i in range(30)]
    med, lo, hi = bm.paired_ratio([r * b for r, b in zip(ratios, base)], base)
    ranked = sorted(ratios)
    assert med == pytest.approx((ranked[14] + ranked[15]) / 2)
    assert (lo, hi) == (pytest.approx(ranked[9]), pytest.approx(ranked[20]))  # ranks 10 and 21 of 30
    # the ratio of medians would not see the pairing: the drift dominates the spread
    assert hi - lo < 0.01
    assert bm.paired_ratio([2.0, 3.0, 4.0], [2.0, 2.0, 2.0]) == (1.5, 1.0, 2.0)  # few repeats: the extremes
    assert bm.ratio_cell([1.0] * 8, [2.0] * 8) == "0.500 [0.500, 0.500]"


def test_quick_run_prints_one_table_and_writes_json(tmp_path):
    out = tmp_path / "models.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--models", "efficientnet_b0", "--threads", "2",
                           "--no-progress", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"torch {torch.__version__}, 2 threads, CPU ")
    assert f"ISA {torch.backends.cpu.get_cpu_capability()}" in lines[0]
    assert [ln.split(" | ")[2] for ln in lines[3:]] == ["stock", "converted", "checkpoint"]
    res = json.loads(out.read_text())
    (row,) = res["results"]
    v = row["variants"]
    assert row["model"] == "efficientnet_b0" and (row["batch"], row["size"]) == (2, 32)
    assert all(len(v[k]["times_s"]) == 2 and min(v[k]["times_s"]) > 0 for k in v)
    stock = v["stock"]["saved_bytes"]
    assert v["converted"]["saved_bytes"] <= 0.5 * stock
    assert v["checkpoint"]["saved_bytes"] < v["converted"]["saved_bytes"]


@pytest.mark.parametrize("name, cls", [
    ("aten::native_batch_norm", "norm+act"),
    ("aten::batch_norm", "norm+act"),
    ("aten::native_batch_norm_backward", "norm+act"),
    ("aten::native_group_norm_backward", "norm+act"),
    ("inplace_abn::backward_reduce", "norm+act"),
    ("inplace_abn::gn_forward_", "norm+act"),
    ("_InPlaceABNFunction", "norm+act"),
    ("_InPlaceABNFunctionBackward", "norm+act"),
    ("autograd::engine::evaluate_function: _InPlaceAGNFunctionBackward", "norm+act"),
    ("autograd::engine::evaluate_function: NativeBatchNormBackward0", "norm+act"),
    ("NativeGroupNormBackward0", "norm+act"),
    ("aten::relu_", "norm+act"),
    ("aten::clamp_min_", "norm+act"),
    ("aten::threshold_backward", "norm+act"),
    ("LeakyReluBackward1", "norm+act"),
    ("autograd::engine::evaluate_function: SiluBackward0", "norm+act"),
    ("aten::silu_backward", "norm+act"),
    ("aten::elu", "norm+act"),
    ("aten::mkldnn_convolution", "conv"),
    ("aten::conv2d", "conv"),
    ("aten::convolution_backward", "conv"),
    ("autograd::engine::evaluate_function: ConvolutionBackward0", "conv"),
    ("aten::addmm", "other"),
    ("aten::copy_", "other"),
    ("aten::add_", "other"),
    ("aten::empty_strided", "other"),
    ("aten::gelu", "other"),
    ("aten::native_layer_norm", "other"),
    ("aten::_convert_indices_from_coo_to_csr", "other"),
    ("Optimizer.step#SGD.step", "other"),
])
def test_classify_event_names(name, cls):
    assert _classify()(name) == cls


def test_breakdown_of_a_small_model_sums_and_sees_both_norms():
    bm, classify = _load(), _classify()
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), _block(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    converted = inplace_abn.convert_model(stock, activation="leaky_relu", activation_param=0.01)
    x, target = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    steps = {"stock": bm.make_step(stock, x, target), "converted": bm.make_step(converted, x, target)}
    bd = bm.profile_variants(steps, 2)
    assert list(bd) == ["stock", "converted"]
    for v, r in bd.items():
        parts = r["norm+act_ms"] + r["conv_ms"] + r["other_ms"]
        assert abs(parts - r["step_ms"]) <= 0.01 * r["step_ms"], (v, r)
        assert r["norm+act_ms"] > 0 and r["conv_ms"] > 0 and r["other_ms"] > 0, (v, r)
        assert -0.01 * r["step_ms"] <= r["untraced_ms"] < r["other_ms"], (v, r)
        # the parts are the classified events' self times
        for cls in ("norm+act", "conv"):
            assert r[cls + "_ms"] == pytest.approx(sum(ms for ms, c in r["events"].values() if c == cls))
        assert all(c == classify(name) for name, (_, c) in r["events"].items())
    stock_ev, conv_ev = bd["stock"]["events"], bd["converted"]["events"]
    assert any(n.startswith("inplace_abn::") for n in conv_ev)
    assert not any(n.startswith("inplace_abn::") for n in stock_ev)
    assert "aten::native_batch_norm" in stock_ev and "aten::native_batch_norm" not in conv_ev
    d = bm.breakdown_table([("tiny", bd)])
    assert d.splitlines()[2].startswith("| tiny | stock | ") and "tiny: bound" in d


def test_norm_floor_step_covers_every_norm_layer_and_changes_no_state():
    bd_mod = _load(os.path.join(ROOT, "benchmarks", "breakdown.py"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                          nn.GroupNorm(2, 8), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 7 * 7, 3), nn.BatchNorm1d(3))
    model = model.to(memory_format=torch.channels_last).train()
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    step = bd_mod.norm_floor_step(model, x)
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    from torch.profiler import profile

    with profile() as prof:
        step()
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls == {"aten::neg_": 3, "aten::mul": 3}  # nothing else: no scalar conversions
    bufs = step.tensors
    assert [tuple(y.shape) for y, _, _ in bufs] == [(4, 8, 16, 16), (4, 8, 7, 7), (4, 3)]
    assert bufs[0][0].is_contiguous(memory_format=torch.channels_last)
    assert all(dx.shape == y.shape == dy.shape for y, dy, dx in bufs)
    with pytest.raises(ValueError, match="no BatchNorm or GroupNorm"):
        bd_mod.norm_floor_step(nn.Linear(2, 2), torch.randn(1, 2))
    # floor bound = (stock step - stock norm+act + floor) / stock step
    d = bd_mod.derived({"stock": {"step_ms": 100.0, "norm+act_ms": 10.0},
                        "converted": {"norm+act_ms": 5.0},
                        "floor": {"step_ms": 3.0, "untraced_ms": 1.0}})
    assert d["bound"] == pytest.approx(0.9) and d["norm_act_ratio"] == pytest.approx(0.5)
    assert d["floor_ms"] == pytest.approx(2.0) and d["floor_bound"] == pytest.approx(0.92)


def test_quick_breakdown_prints_and_writes_it(tmp_path):
    out = tmp_path / "models.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--models", "deeplabv3_resnet18", "--threads", "2",
                           "--no-progress", "--breakdown", "1", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("breakdown: "))
    assert f"torch {torch.__version__}, 2 threads, CPU " in lines[i]
    assert f"ISA {torch.backends.cpu.get_cpu_capability()}" in lines[i] and "1 profiled steps" in lines[i]
    assert [ln.split(" | ")[1] for ln in lines[i + 3:i + 5]] == ["stock", "converted"]
    assert lines[i + 6].startswith("deeplabv3_resnet18 2 x 32: bound") and "floor bound" in lines[i + 6]
    (row,) = json.loads(out.read_text())["results"]
    assert set(row["variants"]) == {"stock", "converted", "checkpoint"}
    bd = row["breakdown"]
    assert set(bd) == {"stock", "converted", "floor"} and all(bd[v]["steps"] == 1 for v in bd)
    # the floor is one neg_ and one mul per norm layer, nothing else
    assert {n: c for n, (_, c) in bd["floor"]["events"].items()} == {"aten::neg_": "other", "aten::mul": "other"}
    assert any(n.startswith("inplace_abn::") for n in bd["converted"]["events"])
