"""benchmarks/bench_unet.py: the upper bound of the GroupNorm pair conversion, and a quick run
(with a one-step --breakdown)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import inplace_abn
from inplace_abn.memory import model_saved_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_unet.py")


def _load():
    pytest.importorskip("diffusers")  # the script imports the example, which builds a diffusers UNet
    spec = importlib.util.spec_from_file_location("bench_unet", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pair_bound_keeps_each_pair_output_and_what_others_save():
    bu = _load()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.GroupNorm(4, 8), nn.GELU(), nn.Conv2d(8, 3, 1))
    x = torch.randn(2, 3, 6, 6)
    stock, bound, pairs = bu.pair_bound(model, x)
    assert pairs == 1  # GroupNorm -> GELU is not a pair
    act = 2 * 8 * 6 * 6 * 4
    assert stock == model_saved_bytes(model, x)
    # kept: x (conv0), the pair's output (conv1's input), conv1's output (GN2), GN2's stats, GELU's input,
    # conv2's input; dropped: GN1's input and its stats, SiLU's input
    gn_stats = 2 * (2 * 2 * 4)  # mean and rstd, (N, G) float32 each, of the first GroupNorm
    assert bound == stock - 2 * act - gn_stats, (stock, bound)
    converted = inplace_abn.convert_model(model, example_inputs=(x,), standalone=False)  # pairs only
    assert bound <= model_saved_bytes(converted, x) <= 1.05 * bound


def test_quick_run_prints_the_tables_and_meets_the_bound(tmp_path):
    _load()
    out = tmp_path / "unet.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--threads", "1", "--no-progress", "--breakdown", "1",
                           "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"ISA {torch.backends.cpu.get_cpu_capability()}" in proc.stdout
    res = json.loads(out.read_text())
    v, bound = res["variants"], res["bound_bytes"]
    assert bound <= v["converted"]["saved_bytes"] <= 1.05 * bound
    assert v["converted"]["saved_bytes"] < v["norm1 kept"]["saved_bytes"] < v["stock"]["saved_bytes"]
    assert v["norm1 on a clone"]["saved_bytes"] == v["converted"]["saved_bytes"]  # the clone is what it keeps
    assert "converted / norm1 on a clone, paired: " in proc.stdout
    assert v["converted"]["saved_bytes"] <= 0.65 * v["stock"]["saved_bytes"]
    # the breakdown: stock and converted only; stock's GroupNorm and SiLU seen, ours in converted
    lines = proc.stdout.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("breakdown: "))
    assert [ln.split(" | ")[1] for ln in lines[i + 3:i + 5]] == ["stock", "converted"]
    assert lines[i + 6].startswith("unet 2 x 32: bound")
    bd = res["breakdown"]
    assert set(bd) == {"stock", "converted"}
    for r in bd.values():
        assert r["steps"] == 1 and r["norm+act_ms"] > 0 and r["conv_ms"] > 0
        assert r["norm+act_ms"] + r["conv_ms"] + r["other_ms"] == pytest.approx(r["step_ms"], rel=0.01)
    assert "aten::native_group_norm" in bd["stock"]["events"] and "aten::silu" in bd["stock"]["events"]
    assert any(n.startswith("inplace_abn::") for n in bd["converted"]["events"])
