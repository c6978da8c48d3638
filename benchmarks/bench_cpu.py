"""Forward+backward speed of InPlaceABN on the CPU, as ratios measured in one run.

For each case it times, median over repeats (the four take turns):
  ours  : InPlaceABN forward + input/weight/bias gradients
  stock : nn.BatchNorm2d + activation (eager) forward + the same gradients
  floor : 4 x.clone() calls (8 passes over memory, docs/DESIGN.md section 6)
The in-place layer needs a fresh non-leaf input each step; that clone is
timed separately and subtracted. Its input gradient is taken with respect to
the clone's source: the layer overwrites the clone with its output, so a
gradient with respect to the clone itself is dy, and the layer would skip
its input-gradient pass (until 2026-12-01 this script did that, and its
ratios left out backward_input). Before timing, every case checks that ours
and stock give the same input and parameter gradients.

Allocator: with glibc's default heuristics a freed 10+ MB tensor is often
handed back to the kernel, and the next step pays a page fault per 4 KiB on
first touch; which step pays depends on the order of earlier allocations,
not on the kernels (measured here: 5,300 faults and +10 ms per step for one
layer, 0 for another, in the same process). By default the script therefore
keeps freed memory in the process (glibc mallopt, the behaviour of
jemalloc/tcmalloc, which CPU training setups commonly preload), for all three
measurements alike; --system-malloc keeps glibc's defaults and prints the
page faults per step.

    python benchmarks/bench_cpu.py [--threads 2] [--repeats 20] [--quick] [--system-malloc] [--dtype bfloat16]
                                   [--shapes 16x64x56x56,...] [--activations silu,...]

--compare OLD_ROOT times "ours" for this checkout's build against another
build of the package (a checkout whose inplace_abn/ holds its own built _C,
e.g. a git worktree of an older commit), in one run: both register the same
torch.ops, so each runs in its own subprocesses, taking turns (new, old, old,
new, ...) for --rounds rounds of --repeats steps each; the table gives the
median over rounds per shape and the ratio new / old, with the CPU ISA.
"""
import argparse
import copy
import ctypes
import ctypes.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn as nn

import inplace_abn
from inplace_abn import InPlaceABN

ACT = {"identity": nn.Identity, "leaky_relu": lambda: nn.LeakyReLU(0.01, inplace=True),
       "elu": lambda: nn.ELU(1.0, inplace=True), "silu": lambda: nn.SiLU(inplace=True),
       "relu": lambda: nn.ReLU(inplace=True)}
PARAM = {"leaky_relu": 0.01, "elu": 1.0}  # activation_param of ours, as stock's above


def keep_freed_memory() -> bool:
    """Ask glibc malloc to keep freed blocks (no mmap per block, no trimming)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        # 32 MiB is glibc's largest mmap threshold on 64-bit systems
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def check_same_grads(ours, stock, case):
    """Raise unless the timed steps computed the same gradients (so that both do the
    same work): relative error in norm below 1e-3 (float32; 3e-2 in half precision),
    which the effective weight |w| + eps of ours (1e-5 off stock's w) leaves room for.

    At a kink (ReLU, leaky_relu) a z within rounding of 0 may take the other branch in
    one of the two, a whole dy apart in the input gradient and in its channel's weight
    and bias gradients: one such element gave 1.7e-3 at 16x64x56x56 relu (input) and at
    4096x512 leaky_relu (bias, one element of 2M; seeded runs: every error above 1e-4
    came with exactly one z of the other sign). So up to 8 entries that each carry more
    than 0.3 tol of the norm are let through as such; the rest must agree within tol."""
    for name, a, b in zip(("input", "weight", "bias"), ours, stock):
        tol = 1e-3 if a.dtype in (torch.float32, torch.float64) else 3e-2
        d = a.double() - b.double()
        norm = b.double().norm().clamp_min(1e-30)
        kinks = d.abs() > 0.3 * tol * norm
        err = (d.masked_fill(kinks, 0).norm() / norm).item()
        if err >= tol or kinks.sum().item() > 8:
            raise RuntimeError(f"{case}: ours and stock disagree on the {name} gradient (relative error {err:.2e}, "
                               f"{kinks.sum().item()} entries far off)")


def _interleaved(fns, repeats, warmup=10):
    """Median seconds of each function and its minor page faults per call.

    The functions take turns within every repeat, so that all of them see the
    same machine state (other load, cache and allocator state) on average.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    faults = [0] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            f0 = _faults()
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
            faults[i] += _faults() - f0
    return [statistics.median(t) for t in times], [f / repeats for f in faults]


def layers(shape, activation):
    """(ours, bn, stock) for an (N, C, ...) shape, float32: InPlaceABN, and the stock
    BatchNorm (bn) + activation as nn.Sequential(bn, activation), the same layer."""
    C = shape[1]
    ours = InPlaceABN(C, activation=activation, activation_param=PARAM.get(activation, 0.01))
    bn = {4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(len(shape), nn.BatchNorm1d)(C)
    return ours, bn, nn.Sequential(bn, ACT[activation]())


def bench(shape, activation, channels_last, repeats, dtype=torch.float32, ours_only=False, preserve=False):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    src = torch.randn(shape, dtype=dtype).contiguous(memory_format=fmt)
    dy = torch.randn(shape, dtype=dtype).contiguous(memory_format=fmt)
    leaf = src.clone().requires_grad_()
    ours, bn, stock = layers(shape, activation)
    ours, stock = ours.to(dtype), stock.to(dtype)

    def run_ours():
        y = ours(leaf.clone(memory_format=torch.preserve_format))
        return torch.autograd.grad(y, [leaf, ours.weight, ours.bias], dy)

    def run_stock():
        y = stock(leaf)
        return torch.autograd.grad(y, [leaf, bn.weight, bn.bias], dy)

    check_same_grads(run_ours(), run_stock(), f"{shape} {activation}")
    if preserve:
        ours_p = copy.deepcopy(ours)
        ours_p.preserve_input = True

        def run_preserve():  # the leaf itself: preserve_input neither writes nor refuses it
            y = ours_p(leaf)
            return torch.autograd.grad(y, [leaf, ours_p.weight, ours_p.bias], dy)

        check_same_grads(run_preserve(), run_stock(), f"{shape} {activation} preserve_input")

    def run_clone():
        leaf.clone(memory_format=torch.preserve_format)

    def run_floor():
        for _ in range(4):
            src.clone(memory_format=torch.preserve_format)

    if ours_only:
        (t_clone, t_ours), _ = _interleaved([run_clone, run_ours], repeats)
        return t_ours - t_clone
    fns = [run_clone, run_ours, run_stock, run_floor] + ([run_preserve] if preserve else [])
    times, (_, f_ours, f_stock, *_) = _interleaved(fns, repeats)
    t_clone, t_ours, t_stock, t_floor = times[:4]
    # preserve: preserve_input against the copy + in-place layer it replaces (clone included)
    return (t_ours - t_clone, t_stock, t_floor, f_ours, f_stock) + ((times[4] / t_ours,) if preserve else ())


ACTIVATIONS = ("identity", "leaky_relu", "elu", "silu", "relu")


def cases(quick, only=None, activations=None):
    """(shape, activation, channels_last); relu (not invertible: the one-pass z path, docs/DESIGN.md
    section 3) at the first shape only. ``only``: the shapes to time instead of the default ones,
    as "16x64x56x56,8x128x16x16" (any (N, C, ...) shape); ``activations``: these only, as
    "silu,elu" (relu then at every shape)."""
    if only:
        shapes = [tuple(int(d) for d in s.split("x")) for s in only.split(",")]
    else:
        shapes = ([(4, 16, 14, 14), (2, 32, 7, 7), (256, 64)] if quick else
                  [(16, 64, 56, 56), (16, 512, 7, 7), (4096, 512)])
    for k, shape in enumerate(shapes):
        acts = activations.split(",") if activations else ACTIVATIONS[:4] + (("relu",) if k == 0 else ())
        for activation in acts:
            for cl in (False, True):
                if not cl or len(shape) == 4:
                    yield shape, activation, cl


def compare(args):
    """Ours (ms) of this build and of the one at args.compare, interleaved rounds in subprocesses."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = {"new": here, "old": os.path.abspath(args.compare)}
    times = {k: [] for k in roots}
    for r in range(args.rounds):
        for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
            env = dict(os.environ, PYTHONPATH=roots[name], INPLACE_ABN_BACKEND="native")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--threads", str(args.threads),
                   "--repeats", str(args.repeats), "--dtype", args.dtype] + (["--quick"] if args.quick else []) + (
                ["--shapes", args.shapes] if args.shapes else []) + (
                ["--activations", args.activations] if args.activations else [])
            proc = subprocess.run(cmd, env=env, cwd=roots[name], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"bench_cpu.py --compare: the {name} build's worker ({roots[name]}) failed "
                         f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            assert res["file"].startswith(roots[name]), res["file"]
            times[name].append(res["ours"])
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"{args.dtype}, ours (forward + backward) ms: median over {args.rounds} interleaved rounds of {args.repeats} steps")
    print("| shape | activation | layout | new ms | old ms | new/old |")
    print("|---|---|---|---|---|---|")
    for k, (shape, activation, cl) in enumerate(cases(args.quick, args.shapes, args.activations)):
        new = statistics.median(t[k] for t in times["new"])
        old = statistics.median(t[k] for t in times["old"])
        layout = "channels_last" if cl else "contiguous"
        print(f"| {'x'.join(map(str, shape))} | {activation} | {layout} | {new * 1e3:.2f} | {old * 1e3:.2f} | "
              f"{new / old:.3f} |")


def add_dtype_arg(ap):
    """--dtype: the layers' dtype (stock runs in it too); this script's and bench_groupnorm.py's."""
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                    help="the layers' dtype (stock runs in it too)")


def main():
    # a relu layer saves no memory and warns so once; here it is timed all the same
    warnings.filterwarnings("ignore", message="In-place ABN with relu", category=RuntimeWarning)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant (default 20; 3 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="small shapes; without --repeats also few repeats (a smoke test)")
    ap.add_argument("--system-malloc", action="store_true", help="keep glibc's default allocation heuristics")
    ap.add_argument("--compare", metavar="OLD_ROOT", help="time ours against the build in this checkout")
    ap.add_argument("--rounds", type=int, default=6, help="with --compare: interleaved rounds per build")
    ap.add_argument("--shapes", help="these shapes instead of the default ones, e.g. 16x64x56x56,8x128x16x16")
    ap.add_argument("--activations", help="these activations only, e.g. silu,elu (of " + ",".join(ACTIVATIONS) + ")")
    ap.add_argument("--preserve", action="store_true",
                    help="also time the layer with preserve_input=True on an input it must not write, against "
                         "a copy of that input + the in-place layer (the copy included)")
    add_dtype_arg(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.quick else 20
    unknown = set((args.activations or "").split(",")) - set(ACTIVATIONS) - {""}
    if unknown:
        ap.error(f"--activations: unknown {', '.join(sorted(unknown))} (choose from {', '.join(ACTIVATIONS)})")
    kept = False if args.system_malloc else keep_freed_memory()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.compare:
        return compare(args)
    if args.worker:
        ours = [bench(shape, act, cl, args.repeats, dtype, ours_only=True)
                for shape, act, cl in cases(args.quick, args.shapes, args.activations)]
        print(json.dumps({"file": inplace_abn.__file__, "ours": ours}))
        return
    backend = "native" if inplace_abn.HAS_NATIVE else "python"
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, {args.dtype}, backend={backend}, median of {args.repeats}, "
          f"allocator: {'freed memory kept (mallopt)' if kept else 'system defaults'}")
    extra = " preserve_input / (copy + in-place) |" if args.preserve else ""
    print("| shape | activation | layout | ours ms | stock ms | 4-clone ms | ours/floor | ours/stock | "
          "faults/step ours, stock |" + extra)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.preserve else ""))
    for shape, activation, cl in cases(args.quick, args.shapes, args.activations):
        t_ours, t_stock, t_floor, f_ours, f_stock, *pr = bench(shape, activation, cl, args.repeats, dtype,
                                                                preserve=args.preserve)
        layout = "channels_last" if cl else "contiguous"
        print(f"| {'x'.join(map(str, shape))} | {activation} | {layout} | {t_ours * 1e3:.2f} | "
              f"{t_stock * 1e3:.2f} | {t_floor * 1e3:.2f} | {t_ours / t_floor:.2f} | {t_ours / t_stock:.2f} | "
              f"{f_ours:.0f}, {f_stock:.0f} |" + "".join(f" {r:.2f} |" for r in pr), flush=True)


if __name__ == "__main__":
    main()
