"""Forward+backward speed of InPlaceABN on the CPU, as ratios measured in one run.

For each case it times, median over repeats:
  ours  : InPlaceABN forward + input/weight/bias gradients
  stock : nn.BatchNorm2d + activation (eager) forward + the same gradients
  floor : 4 x.clone() calls (8 passes over memory, DESIGN.md section 6)
The in-place layer needs a fresh non-leaf input each step; that clone is
timed separately and subtracted.

    python benchmarks/bench_cpu.py [--threads 2] [--repeats 20] [--quick]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn

import inplace_abn
from inplace_abn import InPlaceABN

ACT = {"leaky_relu": lambda: nn.LeakyReLU(0.01, inplace=True), "silu": lambda: nn.SiLU(inplace=True)}


def _median_time(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(shape, activation, channels_last, repeats, dtype=torch.float32):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    C = shape[1]
    src = torch.randn(shape, dtype=dtype).contiguous(memory_format=fmt)
    dy = torch.randn(shape, dtype=dtype).contiguous(memory_format=fmt)
    leaf = src.clone().requires_grad_()
    ours = InPlaceABN(C, activation=activation, activation_param=0.01).to(dtype)
    bn = nn.BatchNorm2d(C) if len(shape) == 4 else nn.BatchNorm1d(C)
    stock = nn.Sequential(bn, ACT[activation]()).to(dtype)

    def run_ours():
        x = leaf.clone(memory_format=torch.preserve_format)
        y = ours(x)
        torch.autograd.grad(y, [x, ours.weight, ours.bias], dy)

    def run_stock():
        y = stock(leaf)
        torch.autograd.grad(y, [leaf, bn.weight, bn.bias], dy)

    def run_clone():
        leaf.clone(memory_format=torch.preserve_format)

    def run_floor():
        for _ in range(4):
            src.clone(memory_format=torch.preserve_format)

    t_clone = _median_time(run_clone, repeats)
    t_ours = _median_time(run_ours, repeats) - t_clone
    t_stock = _median_time(run_stock, repeats)
    t_floor = _median_time(run_floor, repeats)
    return t_ours, t_stock, t_floor


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats (smoke test)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(16, 64, 56, 56), (16, 512, 7, 7), (4096, 512)]
    if args.quick:
        shapes, args.repeats = [(4, 16, 14, 14), (2, 32, 7, 7), (256, 64)], 3
    backend = "native" if inplace_abn.HAS_NATIVE else "python"
    print(f"torch {torch.__version__}, {args.threads} threads, float32, backend={backend}, median of {args.repeats}")
    print(f"| shape | activation | layout | ours ms | stock ms | 4-clone ms | ours/floor | ours/stock |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        for activation in ("leaky_relu", "silu"):
            for cl in (False, True):
                if cl and len(shape) != 4:
                    continue
                t_ours, t_stock, t_floor = bench(shape, activation, cl, args.repeats)
                layout = "channels_last" if cl else "contiguous"
                print(f"| {'x'.join(map(str, shape))} | {activation} | {layout} | {t_ours * 1e3:.2f} | "
                      f"{t_stock * 1e3:.2f} | {t_floor * 1e3:.2f} | {t_ours / t_floor:.2f} | {t_ours / t_stock:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
