#!/usr/bin/env python
"""Whole-model training steps on the CPU: stock, converted, and checkpointed (issue 13).

For each model it builds three variants from the same initial weights:

  stock      : the torchvision model;
  converted  : ``inplace_abn.convert_model(model, activation="leaky_relu",
               activation_param=0.01)`` (ReLU becomes leaky_relu(0.01);
               EfficientNet keeps its SiLU);
  checkpoint : the stock model with ``torch.utils.checkpoint.checkpoint(...,
               use_reentrant=False)`` around every block (ResNet bottleneck
               blocks, EfficientNet MBConv stages ``features[1:8]``, the
               DeepLab backbone's ``layer1``..``layer4``): the other common way
               to save activation memory, paying a second forward of each block
               in backward.

deeplabv3_resnet18 is the model of ``examples/train_segmentation.py``, built
by its ``build_model``. ``timm_efficientnet_b0`` (on request, with timm
installed) is timm's EfficientNet-B0, whose BatchNormAct2d modules hold their
SiLU; its checkpoint variant wraps each of the ``blocks`` stages.

Timed: one training step (forward, cross-entropy loss, backward, SGD step
with momentum), median and interquartile range over ``--repeats`` steps after
``--warmup`` steps. The variants take turns within every repeat (the order
rotates from one repeat to the next) so that all of them see the same machine
state on average; the table gives each variant's median as a ratio to stock's.

Memory: activation bytes saved for backward by one training forward
(docs/DESIGN.md section 5), ``inplace_abn.memory.model_saved_bytes``:
distinct storages packed by autograd's saved_tensors_hooks, parameters and
buffers left out. For the checkpoint variant the same method measures what
its forward keeps for backward: (a) what the operations outside the blocks
save (stem, head) and (b) the input of every block, which checkpoint keeps to
recompute the block (torch packs it with the saved_tensors_hooks active around
the checkpoint call, so the method sees it; distinct storages counted once,
as for the other variants). The tensors that the
operations inside a block save are packed by checkpoint's own, innermost hooks,
which keep no tensor: they are not counted, rightly, in the forward. Not
counted, for any variant: tensors alive only transiently (a layer's output
that nobody saves, the gradients, and for checkpoint the activations of the
block being recomputed during backward, a peak of one block's saved tensors on
top of the figure here).

Allocator: as in bench_cpu.py, freed memory is kept in the process (glibc
mallopt) unless --system-malloc, for all variants alike.

Note: in training mode a checkpointed block runs its BatchNorms twice per step,
so their running statistics take two momentum updates per step (timing is
unaffected).

    PYTHONPATH=. python benchmarks/bench_models.py                 # defaults: a few minutes on 2 cores
    PYTHONPATH=. python benchmarks/bench_models.py --quick         # tiny sizes, seconds (smoke test)
    PYTHONPATH=. python benchmarks/bench_models.py --models resnet50 --repeats 30 --json /tmp/models.json
    PYTHONPATH=. python benchmarks/bench_models.py --breakdown     # and where stock's and converted's step time goes
    PYTHONPATH=. python benchmarks/bench_models.py --quick --breakdown 2
    PYTHONPATH=. python benchmarks/bench_models.py --compile --models resnet50   # all variants compiled

Breakdown (``--breakdown [STEPS]``, 3 steps unless given): after the timed steps, STEPS
steps of the stock and converted variants (not checkpoint) run under torch.profiler,
and every event's self CPU time is classified as norm+act, conv or other; so do STEPS
calls of the traffic floor of the stock model's norm layers (breakdown.norm_floor_step:
the least a fused layer reads and writes). benchmarks/breakdown.py says what the figures
and the per-model bounds mean.
"""
import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE, os.path.join(_ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import inplace_abn  # noqa: E402
from accuracy_table import cpu_name  # noqa: E402
from bench_cpu import keep_freed_memory  # noqa: E402
from breakdown import norm_floor_step, profile_variants  # noqa: E402
from breakdown import table as breakdown_table  # noqa: E402
from breakdown import header as breakdown_header  # noqa: E402
from inplace_abn.memory import model_saved_bytes  # noqa: E402
from synthetic_scenes import SyntheticScenes  # noqa: E402
from train_segmentation import build_model as build_segmentation  # noqa: E402
from train_segmentation import forward_logits  # noqa: E402

VARIANTS = ("stock", "converted", "checkpoint")
SLOPE = 0.01
MiB = 2.0**20


# ---- models --------------------------------------------------------------------------------------


def _resnet50():
    import torchvision

    return torchvision.models.resnet50(weights=None), 1000


def _efficientnet_b0():
    import torchvision

    return torchvision.models.efficientnet_b0(weights=None), 1000


def _deeplabv3_resnet18():
    n = SyntheticScenes.num_classes
    return build_segmentation("deeplabv3_resnet18", n), n


def _timm_efficientnet_b0():
    import timm

    return timm.create_model("efficientnet_b0", pretrained=False), 1000


def _resnet_blocks(model):
    return [(layer, i) for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for i in range(len(layer))]


def _efficientnet_blocks(model):
    return [(model.features, i) for i in range(1, len(model.features) - 1)]  # features[0] stem, [-1] 1x1 head conv


def _timm_blocks(model):
    return [(model.blocks, i) for i in range(len(model.blocks))]  # the MBConv stages


def _deeplab_blocks(model):
    return [(model.backbone, name) for name in ("layer1", "layer2", "layer3", "layer4")]


# name -> (builder returning (model, classes), where checkpoint goes, default batch, default size in px)
MODELS = {
    "resnet50": (_resnet50, _resnet_blocks, 8, 128),
    "efficientnet_b0": (_efficientnet_b0, _efficientnet_blocks, 8, 128),
    "deeplabv3_resnet18": (_deeplabv3_resnet18, _deeplab_blocks, 8, 96),
    "timm_efficientnet_b0": (_timm_efficientnet_b0, _timm_blocks, 8, 128),  # on request: needs timm
}
DEFAULT_MODELS = ("resnet50", "efficientnet_b0", "deeplabv3_resnet18")
QUICK = dict(batch=2, size=32, repeats=2, warmup=1)


class Checkpointed(nn.Module):
    """Runs ``block`` under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def with_checkpoints(model: nn.Module, blocks) -> nn.Module:
    """``model`` (modified) with every ``(parent, key)`` child wrapped in `Checkpointed`."""
    for parent, key in blocks:
        if isinstance(key, int):
            parent[key] = Checkpointed(parent[key])
        else:
            setattr(parent, key, Checkpointed(getattr(parent, key)))
    return model


def build_variants(name: str):
    """{variant: model} from one set of initial weights, and the number of classes."""
    builder, blocks, _, _ = MODELS[name]
    torch.manual_seed(0)
    stock, classes = builder()
    converted = inplace_abn.convert_model(stock, activation="leaky_relu", activation_param=SLOPE)  # a deep copy
    ckpt = copy.deepcopy(stock)
    ckpt = with_checkpoints(ckpt, blocks(ckpt))
    return {"stock": stock, "converted": converted, "checkpoint": ckpt}, classes


# ---- measurement ---------------------------------------------------------------------------------


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Activation bytes saved for backward by one training forward (see the module docstring).

    Running statistics are restored afterwards, so every variant starts timing from the same state.
    """
    model.train()
    state = copy.deepcopy(model.state_dict())
    n = model_saved_bytes(model, x)
    model.load_state_dict(state)
    return n


def make_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward_logits(model, x), target)
        loss.backward()
        opt.step()

    return step


def quartiles(values):
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def paired_ratio(times_s, base_s):
    """(median, low, high): the median over repeats of this variant's step / stock's step in
    the same repeat, and a distribution-free 95% confidence interval of that median.

    The variants take turns within every repeat, so a slow spell of the host slows both
    steps of a pair: the per-repeat ratio is steadier than the ratio of two medians. The
    interval is that of the median of any distribution: the order statistics of ranks
    n/2 -+ 0.98 sqrt(n) (the normal approximation of the binomial; for n = 30 the 10th and
    21st of the sorted ratios, 95.7%); fewer than 6 repeats give the extremes."""
    r = sorted(t / b for t, b in zip(times_s, base_s))
    n = len(r)
    if n < 6:
        return statistics.median(r), r[0], r[-1]
    half = 0.98 * math.sqrt(n)
    return statistics.median(r), r[max(0, math.floor(n / 2 - half))], r[min(n - 1, math.ceil(n / 2 + half) - 1)]


def ratio_cell(times_s, base_s) -> str:
    """The paired ratio as a table cell: "0.981 [0.962, 0.995]"."""
    med, lo, hi = paired_ratio(times_s, base_s)
    return f"{med:.3f} [{lo:.3f}, {hi:.3f}]"


BREAKDOWN_VARIANTS = ("stock", "converted")


def bench_model(name: str, batch: int, size: int, repeats: int, warmup: int, progress=True, profile_steps=0,
                compile=False):
    """Timings (seconds per step) and saved bytes of the three variants of one model, and with
    ``profile_steps`` the breakdown of stock and converted (under the key "breakdown"). With
    ``compile`` every variant is run through torch.compile (inductor; the saved bytes are those of
    the eager model) and its first step, which compiles, is timed apart ("compile_s")."""
    models, classes = build_variants(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g)
    seg = name.startswith(("deeplab", "fcn"))
    target = torch.randint(0, classes, (batch, size, size) if seg else (batch,), generator=g)
    mem = {v: saved_bytes(m, x) for v, m in models.items()}
    steps = {v: make_step(torch.compile(m) if compile else m, x, target) for v, m in models.items()}
    first = {}
    if compile:
        for v, step in steps.items():
            t0 = time.perf_counter()
            step()
            first[v] = time.perf_counter() - t0
    times = time_interleaved(steps, repeats, warmup, f"{name} b{batch} {size}px", progress)
    out = {v: {"times_s": times[v], "saved_bytes": mem[v], **({"compile_s": first[v]} if compile else {})}
           for v in VARIANTS}
    if profile_steps:
        floor = norm_floor_step(models["stock"], x)
        out["breakdown"] = profile_variants({**{v: steps[v] for v in BREAKDOWN_VARIANTS}, "floor": floor},
                                            profile_steps)
        del floor
    del models, steps
    gc.collect()
    return out


def time_interleaved(steps, repeats: int, warmup: int, desc: str, progress=True):
    """{variant: [seconds of each timed call]} of the callables ``steps`` ({variant: step}),
    run in turns: every repeat runs each once, the order rotating from one repeat to the next."""
    from tqdm import tqdm

    names = list(steps)
    times = {v: [] for v in names}
    bar = tqdm(range(warmup + repeats), desc=desc, file=sys.stderr, disable=not progress, dynamic_ncols=True,
               leave=False)
    for r in bar:
        k = r % len(names)
        for v in names[k:] + names[:k]:  # every variant takes every position in turn
            t0 = time.perf_counter()
            steps[v]()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[v].append(dt)
        if r < warmup:
            bar.set_postfix_str("warm-up")
        else:
            bar.set_postfix_str(", ".join(f"{v} {statistics.median(times[v]) * 1e3:.0f} ms" for v in names))
    bar.close()
    return times


# ---- report --------------------------------------------------------------------------------------


def header(args, allocator: str) -> str:
    backend = "native" if inplace_abn.HAS_NATIVE else "python"
    mode = ("torch.compile (inductor; each variant's first step, which compiles, before the warm-up)"
            if getattr(args, "compile", False) else "eager")  # (bench_unet.py's arguments have no --compile)
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_name()}, "
            f"ISA {torch.backends.cpu.get_cpu_capability()}, float32, {mode}, inplace_abn backend={backend}, "
            f"allocator: {allocator}, {args.repeats} repeats after {args.warmup} warm-up steps")


def table(rows) -> str:
    lines = ["| model | batch x px | variant | step ms (median) | IQR ms | step / stock | paired step / stock [95% CI] "
             "| saved MiB | saved / stock |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base = row["variants"]["stock"]
        base_med = quartiles(base["times_s"])[1]
        for v in VARIANTS:
            r = row["variants"][v]
            q1, med, q3 = quartiles(r["times_s"])
            lines.append(f"| {row['model']} | {row['batch']} x {row['size']} | {v} | {med * 1e3:.1f} | "
                         f"{(q3 - q1) * 1e3:.1f} | {med / base_med:.3f} | "
                         f"{ratio_cell(r['times_s'], base['times_s'])} | "
                         f"{r['saved_bytes'] / MiB:.1f} | {r['saved_bytes'] / base['saved_bytes']:.3f} |")
    for row in rows:
        if "compile_s" in row["variants"]["stock"]:
            lines.append(f"\n{row['model']}: first step (compiling) " + ", ".join(
                f"{v} {row['variants'][v]['compile_s']:.1f} s" for v in VARIANTS))
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODELS), metavar="MODEL",
                    help=f"any of: {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})")
    ap.add_argument("--batch", type=int, default=None, help="batch size for every model (default: 8 each)")
    ap.add_argument("--size", type=int, default=None,
                    help="image size in px for every model (default: 128, deeplabv3_resnet18 96)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant, at least 2 (default: 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default: 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: batch {QUICK['batch']}, {QUICK['size']} px, {QUICK['repeats']} repeats, "
                         f"{QUICK['warmup']} warm-up")
    ap.add_argument("--system-malloc", action="store_true", help="keep glibc's default allocation heuristics")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results (all step times) here")
    ap.add_argument("--compile", action="store_true",
                    help="run every variant through torch.compile (inductor); memory figures stay the eager ones")
    ap.add_argument("--breakdown", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                    help="then profile STEPS steps (default 3) of stock and converted: norm+act / conv / other")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch = args.batch or QUICK["batch"]
        args.size = args.size or QUICK["size"]
    for key, default in (("repeats", 20), ("warmup", 3)):
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else default)
    if args.repeats < 2:
        ap.error("--repeats must be at least 2 (for the interquartile range)")
    if args.warmup < 0:
        ap.error("--warmup must not be negative")
    if args.breakdown < 0:
        ap.error("--breakdown takes a positive number of steps")
    return args


def main(argv=None):
    args = parse_args(argv)
    kept = False if args.system_malloc else keep_freed_memory()
    allocator = "freed memory kept (mallopt)" if kept else "system defaults"
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        _, _, batch, size = MODELS[name]
        batch, size = args.batch or batch, args.size or size
        variants = bench_model(name, batch, size, args.repeats, args.warmup, progress=not args.no_progress,
                               profile_steps=args.breakdown, compile=args.compile)
        row = {"model": name, "batch": batch, "size": size}
        if args.breakdown:
            row["breakdown"] = variants.pop("breakdown")
        rows.append({**row, "variants": variants})
    head = header(args, allocator)
    print(head)
    print(table(rows), flush=True)
    if args.breakdown:
        print()
        print(breakdown_header(args.breakdown))
        print(breakdown_table([(f"{r['model']} {r['batch']} x {r['size']}", r["breakdown"]) for r in rows]),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "cpu": cpu_name(), "isa": torch.backends.cpu.get_cpu_capability(), "allocator": allocator,
                       "repeats": args.repeats, "warmup": args.warmup, "results": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
