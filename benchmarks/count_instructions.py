"""Instructions per training step of a small layer, ours against stock, counted by callgrind.

At small shapes (2x32x7x7) a layer's step is host work (Python, autograd,
dispatcher, the operators' front ends) more than kernel work, and wall-clock
ratios there move by 10% from one run to the next on a shared machine.
Instruction counts do not: valgrind's callgrind counts every instruction the
process executes, the same for the same binary and inputs whatever else the
machine does. Each variant runs twice, with --steps A and B training steps
(forward + backward, 1 thread, after the same set-up); (count(B) - count(A)) /
(B - A) is the cost of one step, without the import and set-up. Python's hash
seed is fixed so that the two runs start alike.

    python benchmarks/count_instructions.py [--shape 2x32x7x7] [--activation identity] [--steps 20 520]

  ours  : InPlaceABN (the native C++ autograd path) on a fresh clone of the input
  stock : nn.BatchNorm2d + the activation (eager, bench_cpu.py's stock layer; BatchNorm alone
          for identity) on a clone too
(both steps include one clone, float32, contiguous). Run to run, the counts per step vary by
about 1% (Python's garbage collector and the allocator's state are part of a step).

Needs valgrind (Debian: apt install valgrind). Under valgrind the CPU reports
no AVX512: the ISA printed is what both PyTorch and inplace_abn ran. Instructions
are not time (a vector instruction does more work than a scalar one, a cache miss
costs no instruction), so this measures host work at small shapes, not kernels at
large ones (benchmarks/bench_cpu.py).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor


def layers(shape, activation):
    """The two layers for ``shape``: {"ours": InPlaceABN, "stock": bench_cpu.py's BatchNorm + activation}."""
    import bench_cpu

    ours, bn, stock = bench_cpu.layers(shape, activation)
    # identity: BatchNorm alone (bench_cpu.py's nn.Sequential(bn, nn.Identity()) adds two
    # module calls, ~17k instructions a step)
    return {"ours": ours, "stock": bn if activation == "identity" else stock}


def worker(variant, shape, activation, steps):
    """``steps`` training steps of one layer, after checking that both layers compute the same
    gradients (bench_cpu.check_same_grads); prints the CPU capability."""
    import torch

    from bench_cpu import check_same_grads

    torch.manual_seed(0)
    both = layers(shape, activation)
    src = torch.randn(shape, requires_grad=True)
    dy = torch.randn(shape)
    grads = {k: torch.autograd.grad(m(src.clone()), [src, *m.parameters()], dy) for k, m in both.items()}
    check_same_grads(grads["ours"], grads["stock"], f"{shape} {activation}")
    layer = both[variant]
    for _ in range(steps):
        layer(src.clone()).backward(dy)
    print(f"ISA {torch.backends.cpu.get_cpu_capability()}")


def count(variant, shape, activation, steps):
    """(instructions, ISA) of a whole run of ``steps`` steps under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable,
               os.path.abspath(__file__), "--worker", variant, "--shape", "x".join(map(str, shape)),
               "--activation", activation, "--steps", str(steps), str(steps)]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    m = re.search(r"Collected : (\d+)", r.stderr)
    isa = re.search(r"ISA (\w+)", r.stdout)
    if r.returncode != 0 or not m or not isa:
        raise RuntimeError(f"callgrind run failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return int(m.group(1)), isa.group(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2x32x7x7")
    ap.add_argument("--activation", default="identity", choices=["identity", "leaky_relu", "elu", "silu", "relu"])
    ap.add_argument("--steps", type=int, nargs=2, default=[20, 520], metavar=("A", "B"))
    ap.add_argument("--jobs", type=int, default=2, help="callgrind runs at a time")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = tuple(int(d) for d in args.shape.split("x"))
    if args.worker:
        import torch
        torch.set_num_threads(1)
        return worker(args.worker, shape, args.activation, args.steps[0])
    a, b = args.steps
    if not b > a >= 1:
        ap.error("--steps A B needs B > A >= 1")
    if shutil.which("valgrind") is None:
        sys.exit("count_instructions.py needs valgrind on the PATH (Debian: apt install valgrind)")
    runs = [(v, n) for v in ("ours", "stock") for n in (a, b)]
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    res = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(count, v, shape, args.activation, n): (v, n) for v, n in runs}
        bar = tqdm(total=len(runs), desc="callgrind runs (minutes each)") if tqdm else None
        for f in futures:
            res[futures[f]] = f.result()
            if bar:
                bar.update()
        if bar:
            bar.close()
    per_step = {v: (res[(v, b)][0] - res[(v, a)][0]) / (b - a) for v in ("ours", "stock")}
    isa = {res[r][1] for r in runs}
    print(f"{args.shape} {args.activation}, 1 thread, ISA under valgrind {'/'.join(sorted(isa))}, "
          f"({b} - {a} steps)")
    print("| variant | instructions per step |")
    print("|---|---|")
    for v in ("ours", "stock"):
        print(f"| {v} | {per_step[v]:,.0f} |")
    print(f"ours / stock: {per_step['ours'] / per_step['stock']:.3f}")


if __name__ == "__main__":
    main()
