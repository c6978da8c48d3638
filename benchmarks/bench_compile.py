"""torch.compile speed: a conv net with InPlaceABN vs the same net with stock
BatchNorm2d + activation, both compiled, forward + backward on the CPU.

    python benchmarks/bench_compile.py                       # defaults below
    python benchmarks/bench_compile.py --backend python      # pure-PyTorch kernels
    python benchmarks/bench_compile.py --batch 32 --channels 64 --size 32 --blocks 4
    python benchmarks/bench_compile.py --groups 32 --channels 64 --activation silu   # InPlaceAGN vs GroupNorm

To compare two builds, run each with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1:
inductor's FX graph cache does not key on the operators' layout tags, so a
graph compiled by the other build may be reused.

Prints one row per variant: compile time (first step), median and best step
time in ms over --iters steps (the variants' steps interleaved, so a busy
machine slows them alike), and their ratios to the compiled stock net. Eager
rows (not compiled) are given for reference. On a shared machine the best
step is the steadier figure. The last two columns are memory: what one forward
saves for backward (docs/DESIGN.md section 5; parameters left out), and the peak
of what one training step allocates (forward + backward: the most bytes live at
once among the tensors allocated during the step, from the profiler's CPU memory
events; the parameters, their gradients of the step before and the input, allocated
earlier, are left out).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
import inplace_abn  # noqa: E402
from inplace_abn import InPlaceABN  # noqa: E402
from inplace_abn.memory import model_saved_bytes  # noqa: E402


def make_net(norm: str, blocks: int, channels: int, activation: str, param: float, groups: int = 0) -> nn.Module:
    """conv3x3 + norm/activation blocks, then a linear head; the norm is BatchNorm2d, or with ``groups``
    GroupNorm (``norm``: "stock" for the torch.nn layers, "inplace_abn" for InPlaceABN / InPlaceAGN)."""
    def norm_act(c):
        if norm == "inplace_abn":
            if groups:
                return [inplace_abn.InPlaceAGN(groups, c, activation=activation, activation_param=param)]
            return [InPlaceABN(c, activation=activation, activation_param=param)]
        act = {"leaky_relu": nn.LeakyReLU(param), "elu": nn.ELU(param), "silu": nn.SiLU(),
               "identity": nn.Identity()}[activation]
        return [nn.GroupNorm(groups, c) if groups else nn.BatchNorm2d(c), act]

    layers = [nn.Conv2d(3, channels, 3, padding=1, bias=False), *norm_act(channels)]
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), *norm_act(channels)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def step(model, x, target):
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    return loss


def measure(models, x, target, iters, warmup):
    """{name: (first step s, median s, best s)}; the steps of all models are interleaved
    (round robin) so that a busy machine slows them alike."""
    first = {}
    for name, model in models.items():
        t0 = time.perf_counter()
        step(model, x, target)  # compiles, for a compiled model
        first[name] = time.perf_counter() - t0
        for _ in range(warmup):
            step(model, x, target)
    times = {name: [] for name in models}
    for _ in range(iters):
        for name, model in models.items():
            t0 = time.perf_counter()
            step(model, x, target)
            times[name].append(time.perf_counter() - t0)
    return {name: (first[name], statistics.median(t), min(t)) for name, t in times.items()}


def step_peak_bytes(model, x, target) -> int:
    """Peak bytes allocated during one training step, counted from its start: the
    largest running total of the profiler's CPU [memory] events (allocations and frees
    of the step; tensors allocated before it are not in the total)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, x, target)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    if not totals:
        raise RuntimeError("the profiler recorded no CPU memory events for the step")
    return max(totals)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--activation", default="leaky_relu", choices=["leaky_relu", "elu", "silu", "identity"])
    ap.add_argument("--groups", type=int, default=0,
                    help="GroupNorm with this many groups (InPlaceAGN against nn.GroupNorm) instead of BatchNorm")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--backend", default="auto", choices=["auto", "native", "python"],
                    help="inplace_abn kernels")
    ap.add_argument("--compiler", default="inductor", help="torch.compile backend")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager reference rows")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    param = {"leaky_relu": 0.01, "elu": 1.0}.get(args.activation, 0.0)

    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    target = torch.randint(0, 10, (args.batch,))
    models = {}
    with inplace_abn.use_backend(args.backend):
        backend = "native" if inplace_abn._backend.ops_for(x) is inplace_abn._backend.NATIVE else "python"
        for norm in ("stock", "inplace_abn"):
            torch.manual_seed(0)
            net = make_net(norm, args.blocks, args.channels, args.activation, param, args.groups)
            if not args.no_eager:
                models[f"{norm} eager"] = net
            models[f"{norm} compiled"] = torch.compile(copy.deepcopy(net), backend=args.compiler)
        rows = measure(models, x, target, args.iters, args.warmup)
        saved = {name: model_saved_bytes(m, x) / 2**20 for name, m in models.items()}
        peak = {name: step_peak_bytes(m, x, target) / 2**20 for name, m in models.items()}

    _, base_med, base_best = rows["stock compiled"]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"ISA {torch.backends.cpu.get_cpu_capability()}, inplace_abn kernels: {backend}, compiler: {args.compiler}")
    norm = f"GroupNorm({args.groups})" if args.groups else "BatchNorm"
    print(f"net: conv3x3 + {norm}/{args.activation} x {args.blocks + 1}, batch {args.batch}, "
          f"{args.channels} channels, {args.size}x{args.size}; forward + backward, {args.iters} steps")
    print(f"{'variant':<22}{'first step (s)':>15}{'median (ms)':>13}{'best (ms)':>11}"
          f"{'median/stock comp.':>20}{'best/stock comp.':>18}{'saved for bwd (MiB)':>21}{'step peak (MiB)':>17}")
    for name, (first, med, best) in rows.items():
        print(f"{name:<22}{first:>15.2f}{med * 1e3:>13.2f}{best * 1e3:>11.2f}{med / base_med:>20.2f}"
              f"{best / base_best:>18.2f}{saved[name]:>21.2f}{peak[name]:>17.2f}")


if __name__ == "__main__":
    main()
