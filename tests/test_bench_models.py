"""benchmarks/bench_models.py: the checkpoint variant's memory method, the variants'
shared initial weights, and a quick run end to end."""
import copy
import importlib.util
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_models.py")


def _load():
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
