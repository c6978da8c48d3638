"""Forward+backward speed of InPlaceAGN (in-place activated GroupNorm) on the
CPU against stock nn.GroupNorm + activation, as ratios measured in one run.

Shapes are those of a diffusion UNet's GroupNorm layers (32 groups) at batch 8,
from the 64x64 stage to the 8x8 one. For each case, median over repeats with
the variants taking turns (bench_cpu._interleaved):
  ours  : InPlaceAGN forward + input/weight/bias gradients (the clone that
          gives it a fresh non-leaf input each step is timed and subtracted;
          the input gradient is taken with respect to the clone's source, as
          in bench_cpu.py, and checked against stock's before timing)
  stock : nn.GroupNorm + activation (eager), the same gradients

    python benchmarks/bench_groupnorm.py [--threads 2] [--repeats 20] [--quick]
"""
import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inplace_abn  # noqa: E402
from bench_cpu import _interleaved, check_same_grads, keep_freed_memory  # noqa: E402
from inplace_abn import InPlaceAGN  # noqa: E402

ACT = {"silu": nn.SiLU, "leaky_relu": lambda: nn.LeakyReLU(0.01)}
GROUPS = 32


def bench(shape, activation, channels_last, repeats):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    C = shape[1]
    src = torch.randn(shape).contiguous(memory_format=fmt)
    dy = torch.randn(shape).contiguous(memory_format=fmt)
    leaf = src.clone().requires_grad_()
    ours = InPlaceAGN(GROUPS, C, activation=activation, weight_mode="signed")
    gn = nn.GroupNorm(GROUPS, C)
    stock = nn.Sequential(gn, ACT[activation]())

    def run_ours():
        return torch.autograd.grad(ours(leaf.clone(memory_format=torch.preserve_format)),
                                   [leaf, ours.weight, ours.bias], dy)

    def run_stock():
        return torch.autograd.grad(stock(leaf), [leaf, gn.weight, gn.bias], dy)

    check_same_grads(run_ours(), run_stock(), f"{shape} {activation}")

    def run_clone():
        leaf.clone(memory_format=torch.preserve_format)

    (t_clone, t_ours, t_stock), _ = _interleaved([run_clone, run_ours, run_stock], repeats)
    return t_ours - t_clone, t_stock


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant (default 20; 3 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="two small shapes; without --repeats also 3 repeats (a smoke test)")
    args = ap.parse_args()
    kept = keep_freed_memory()
    torch.set_num_threads(args.threads)
    shapes = ([(2, 64, 8, 8), (2, 32, 16, 16)] if args.quick else
              [(8, 64, 64, 64), (8, 128, 32, 32), (8, 256, 16, 16), (8, 512, 8, 8)])
    repeats = args.repeats if args.repeats is not None else 3 if args.quick else 20
    backend = "native" if inplace_abn.HAS_NATIVE else "python"
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} "
          f"threads, float32, {GROUPS} groups, backend={backend}, median of {repeats}, allocator: "
          f"{'freed memory kept (mallopt)' if kept else 'system defaults'}")
    print("| shape | activation | layout | ours ms | stock ms | ours/stock |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        for activation in ("silu", "leaky_relu"):
            for cl in (False, True):
                t_ours, t_stock = bench(shape, activation, cl, repeats)
                layout = "channels_last" if cl else "contiguous"
                print(f"| {'x'.join(map(str, shape))} | {activation} | {layout} | {t_ours * 1e3:.2f} | "
                      f"{t_stock * 1e3:.2f} | {t_ours / t_stock:.2f} |", flush=True)


if __name__ == "__main__":
    main()
