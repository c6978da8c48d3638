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

    python benchmarks/bench_groupnorm.py [--threads 2] [--repeats 20] [--quick] [--dtype bfloat16]
    python benchmarks/bench_groupnorm.py --unet [--repeats 20]

--unet: instead, the GroupNorm + SiLU layers of bench_unet.py's converted UNet
(needs diffusers), one row per distinct (shape, layout, groups) with its count
in the model, and the count-weighted sum of both: what the UNet's step spends
in these layers, measured layer by layer.
"""
from collections import Counter
import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inplace_abn  # noqa: E402
from bench_cpu import _interleaved, add_dtype_arg, check_same_grads, keep_freed_memory  # noqa: E402
from inplace_abn import InPlaceAGN  # noqa: E402
from inplace_abn._pure import is_channels_last  # noqa: E402

ACT = {"silu": nn.SiLU, "leaky_relu": lambda: nn.LeakyReLU(0.01)}
GROUPS = 32


def bench(shape, activation, channels_last, repeats, groups=GROUPS, dtype=torch.float32):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    C = shape[1]
    src = torch.randn(shape, dtype=dtype).contiguous(memory_format=fmt)
    dy = torch.randn(shape, dtype=dtype).contiguous(memory_format=fmt)
    leaf = src.clone().requires_grad_()
    ours = InPlaceAGN(groups, C, activation=activation, weight_mode="signed").to(dtype)
    gn = nn.GroupNorm(groups, C).to(dtype)
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


def unet_layers():
    """Counter of (shape, channels_last, groups, activation) over the InPlaceAGN calls of one
    training forward of bench_unet.py's converted UNet."""
    import bench_unet  # noqa: F401  (puts examples/ on the path)
    from train_diffusion_unet import build_unet

    torch.manual_seed(0)
    model = inplace_abn.convert_model(build_unet())
    seen = Counter()

    def hook(mod, args):
        x = args[0]
        seen[(tuple(x.shape), is_channels_last(x), mod.num_groups, mod.activation)] += 1

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, InPlaceAGN)]
    model(torch.randn(8, 3, 64, 64), torch.randint(0, 1000, (8,)))
    for h in handles:
        h.remove()
    return seen


def main_unet(repeats, dtype):
    print("| shape | layout | groups | activation | count | ours ms | stock ms | ours/stock |")
    print("|---|---|---|---|---|---|---|---|")
    total_ours = total_stock = 0.0
    for (shape, cl, groups, activation), count in sorted(unet_layers().items(), key=lambda kv: -kv[1]):
        t_ours, t_stock = bench(shape, activation, cl, repeats, groups, dtype)
        total_ours += count * t_ours
        total_stock += count * t_stock
        print(f"| {'x'.join(map(str, shape))} | {'channels_last' if cl else 'contiguous'} | {groups} | {activation} | "
              f"{count} | {t_ours * 1e3:.3f} | {t_stock * 1e3:.3f} | {t_ours / t_stock:.2f} |", flush=True)
    print(f"count-weighted sum: ours {total_ours * 1e3:.2f} ms, stock {total_stock * 1e3:.2f} ms, "
          f"ours/stock {total_ours / total_stock:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant (default 20; 3 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="two small shapes; without --repeats also 3 repeats (a smoke test)")
    ap.add_argument("--unet", action="store_true", help="the GroupNorm + SiLU layers of bench_unet.py's UNet")
    add_dtype_arg(ap)
    args = ap.parse_args()
    kept = keep_freed_memory()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = ([(2, 64, 8, 8), (2, 32, 16, 16)] if args.quick else
              [(8, 64, 64, 64), (8, 128, 32, 32), (8, 256, 16, 16), (8, 512, 8, 8)])
    repeats = args.repeats if args.repeats is not None else 3 if args.quick else 20
    backend = "native" if inplace_abn.HAS_NATIVE else "python"
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} "
          f"threads, {args.dtype}, {'the model' + chr(39) + 's' if args.unet else GROUPS} groups, backend={backend}, "
          f"median of {repeats}, allocator: "
          f"{'freed memory kept (mallopt)' if kept else 'system defaults'}")
    if args.unet:
        return main_unet(repeats, dtype)
    print("| shape | activation | layout | ours ms | stock ms | ours/stock |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        for activation in ("silu", "leaky_relu"):
            for cl in (False, True):
                t_ours, t_stock = bench(shape, activation, cl, repeats, dtype=dtype)
                layout = "channels_last" if cl else "contiguous"
                print(f"| {'x'.join(map(str, shape))} | {activation} | {layout} | {t_ours * 1e3:.2f} | "
                      f"{t_stock * 1e3:.2f} | {t_ours / t_stock:.2f} |", flush=True)


if __name__ == "__main__":
    main()
