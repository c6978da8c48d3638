"""Instructions per training step of a small layer, ours against stock, counted by callgrind;
or, with --operators, per iteration of the four operators of a step, this build against another.

At small shapes (2x32x7x7) a layer's step is host work (Python, autograd,
dispatcher, the operators' front ends) more than kernel work, and wall-clock
ratios there move by 10% from one run to the next on a shared machine.
Instruction counts do not: valgrind's callgrind counts every instruction the
process executes, the same for the same binary and inputs whatever else the
machine does. Each variant runs twice, with --steps A and B training steps
(forward + backward, 1 thread, after the same set-up); (count(B) - count(A)) /
(B - A) is the cost of one step, without the import and set-up. Python's hash
seed is fixed so that the two runs start alike.

    python benchmarks/count_instructions.py [--shape 2x32x7x7[,256x64,...]] [--channels-last]
                                            [--activation identity] [--steps 20 520]

  ours  : InPlaceABN (the native C++ autograd path) on a fresh clone of the input
  stock : nn.BatchNorm2d + the activation (eager, bench_cpu.py's stock layer; BatchNorm alone
          for identity) on a clone too
(both steps include one clone, float32, contiguous or, with --channels-last, channels-last for
4-D shapes; other shapes stay contiguous). Run to run, the counts per step vary by about 1%
(Python's garbage collector and the allocator's state are part of a step).

--operators counts the operators' own cost instead, without the layer and autograd
around them: one iteration is the four operators of a training step as the local
layer ran them before bn_backward (the synchronised layer still does), called
alone from Python under torch.no_grad(), identity activation, on a clone of the
input (in its layout): batch_stats (moving running statistics, momentum 0.1),
forward_ into the clone, backward_reduce, backward_input on the raw sums with
sums_scale = 1 / count (--steps default 10 110 iterations). --compare OLD_ROOT
counts the same iterations with another build of the package (a checkout whose
inplace_abn/ holds its own built _C, e.g. a git worktree of an older commit):
this script runs in both, with PYTHONPATH at each checkout in turn, and prints
new, old and new / old per shape, and whether the two builds' results of one
iteration are bitwise the same. Each worker reports the inplace_abn it imported;
one from another checkout is an error.

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/count_instructions.py --operators --compare OLD_ROOT \\
        --shape 2x64,256x64 [--channels-last]

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

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


def memory_format(shape, channels_last):
    """torch.channels_last for a 4-D shape with --channels-last, else contiguous."""
    import torch

    return torch.channels_last if channels_last and len(shape) == 4 else torch.contiguous_format


def layout_name(shape, channels_last):
    return "channels-last" if channels_last and len(shape) == 4 else "contiguous"


def layers(shape, activation):
    """The two layers for ``shape``: {"ours": InPlaceABN, "stock": bench_cpu.py's BatchNorm + activation}."""
    import bench_cpu

    ours, bn, stock = bench_cpu.layers(shape, activation)
    # identity: BatchNorm alone (bench_cpu.py's nn.Sequential(bn, nn.Identity()) adds two
    # module calls, ~17k instructions a step)
    return {"ours": ours, "stock": bn if activation == "identity" else stock}


def worker(variant, shape, activation, steps, channels_last=False):
    """``steps`` training steps of one layer, after checking that both layers compute the same
    gradients (bench_cpu.check_same_grads); prints the CPU capability."""
    import torch

    from bench_cpu import check_same_grads

    torch.manual_seed(0)
    both = layers(shape, activation)
    fmt = memory_format(shape, channels_last)
    src = torch.randn(shape).contiguous(memory_format=fmt).requires_grad_()
    dy = torch.randn(shape).contiguous(memory_format=fmt)
    # clone keeps the layout (preserve_format)
    grads = {k: torch.autograd.grad(m(src.clone()), [src, *m.parameters()], dy) for k, m in both.items()}
    check_same_grads(grads["ours"], grads["stock"], f"{shape} {activation}")
    layer = both[variant]
    for _ in range(steps):
        layer(src.clone()).backward(dy)
    print(f"ISA {torch.backends.cpu.get_cpu_capability()}")


def operators_worker(shape, iterations, channels_last=False):
    """``iterations`` iterations of the four operators of an identity layer's training step, as
    the layer called them before bn_backward, after one more whose results it digests;
    prints the folder of the inplace_abn it imported, the digest and the CPU capability."""
    import hashlib

    import torch

    import inplace_abn

    print(f"IABN {os.path.dirname(os.path.abspath(inplace_abn.__file__))}")
    if not inplace_abn.HAS_NATIVE:  # no _C built there: torch.ops.inplace_abn has no kernels to count
        raise RuntimeError(f"inplace_abn at {inplace_abn.__file__} has no native extension built")
    ops = torch.ops.inplace_abn
    torch.manual_seed(0)
    fmt = memory_format(shape, channels_last)
    src = torch.randn(shape).contiguous(memory_format=fmt)
    dy = torch.randn(shape).contiguous(memory_format=fmt)
    C = shape[1]
    weight, bias = torch.rand(C) + 0.5, torch.randn(C)
    running_mean, running_var = torch.zeros(C), torch.ones(C)
    eps, identity, scale = 1e-5, 0, C / src.numel()  # sums_scale = 1 / count, count = numel / C

    def iteration():
        x = src.clone()  # the layer's input, overwritten by forward_ (preserve_format: src's layout)
        mean, var = ops.batch_stats(x, running_mean, running_var, 0.1)
        mask = ops.forward_(x, mean, var, weight, bias, None, eps, identity, 0.0, False)
        sum_gz, sum_gzx = ops.backward_reduce(x, dy, mask, weight, bias, None, eps, identity, 0.0, False)
        dx, _ = ops.backward_input(x, dy, mask, var, weight, bias, None, sum_gz, sum_gzx, eps, identity, 0.0, False,
                                   False, scale)
        return mean, var, x, sum_gz, sum_gzx, dx, running_mean, running_var

    with torch.no_grad():
        # one iteration in both runs of a build (its cost cancels): the results the builds compare
        digest = hashlib.sha256()
        for t in iteration():
            digest.update(t.contiguous().numpy().tobytes())
        for _ in range(iterations):
            iteration()
    print(f"DIGEST {digest.hexdigest()[:16]}")
    print(f"ISA {torch.backends.cpu.get_cpu_capability()}")


def count(worker_args, root=None):
    """(instructions, the worker's KEY value lines as a dict) of one worker run under callgrind.
    ``root``: run with PYTHONPATH and the working directory at that checkout."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable,
               os.path.abspath(__file__), *worker_args]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        if root:
            env.update(PYTHONPATH=root, INPLACE_ABN_BACKEND="native")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    m = re.search(r"Collected : (\d+)", r.stderr)
    out = dict(re.findall(r"^(ISA|IABN|DIGEST) (.+)$", r.stdout, re.M))
    if r.returncode != 0 or not m or "ISA" not in out:
        raise RuntimeError(f"callgrind run failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    if root and os.path.realpath(out.get("IABN", "?")) != os.path.realpath(os.path.join(root, "inplace_abn")):
        raise RuntimeError(f"the worker meant for {root} imported inplace_abn from {out.get('IABN')} "
                           f"({' '.join(cmd)})")
    return int(m.group(1)), out


def run_all(runs, jobs):
    """{key: count(*args)} for runs = {key: args}, ``jobs`` callgrind runs at a time."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    res = {}
    with ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(count, *args): key for key, args in runs.items()}
        bar = tqdm(total=len(runs), desc="callgrind runs (minutes each)") if tqdm else None
        for f in futures:
            res[futures[f]] = f.result()
            if bar:
                bar.update()
        if bar:
            bar.close()
    return res


def commit(root):
    """The checkout's short commit (+ "dirty" with uncommitted changes to tracked files), for the output."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def main_layers(args, shapes):
    a, b = args.steps
    cl = ["--channels-last"] if args.channels_last else []
    runs = {(s, v, n): ([f"--worker={v}", "--shape", s, "--activation", args.activation, "--steps", str(n), str(n),
                         *cl],)
            for s in shapes for v in ("ours", "stock") for n in (a, b)}
    res = run_all(runs, args.jobs)
    for s, shape in shapes.items():
        per_step = {v: (res[(s, v, b)][0] - res[(s, v, a)][0]) / (b - a) for v in ("ours", "stock")}
        isa = {res[(s, v, n)][1]["ISA"] for v in ("ours", "stock") for n in (a, b)}
        layout = " channels-last" if args.channels_last and len(shape) == 4 else ""
        print(f"{s}{layout} {args.activation}, 1 thread, ISA under valgrind {'/'.join(sorted(isa))}, "
              f"({b} - {a} steps)")
        print("| variant | instructions per step |")
        print("|---|---|")
        for v in ("ours", "stock"):
            print(f"| {v} | {per_step[v]:,.0f} |")
        print(f"ours / stock: {per_step['ours'] / per_step['stock']:.3f}")


def main_operators(args, shapes):
    a, b = args.steps
    roots = {"new": HERE}
    if args.compare:
        roots["old"] = os.path.abspath(args.compare)
    cl = ["--channels-last"] if args.channels_last else []
    runs = {(s, k, n): (["--worker=operators", "--shape", s, "--steps", str(n), str(n), *cl], root)
            for s in shapes for k, root in roots.items() for n in (a, b)}
    res = run_all(runs, args.jobs)
    per_it = {(s, k): (res[(s, k, b)][0] - res[(s, k, a)][0]) / (b - a) for s in shapes for k in roots}
    for key, (_, out) in res.items():  # one build, one shape: the same results in both runs
        if out["DIGEST"] != res[(key[0], key[1], a)][1]["DIGEST"]:
            raise RuntimeError(f"{key}: the two runs of one build computed different results")
    isa = {out["ISA"] for _, out in res.values()}
    print(f"operators batch_stats, forward_, backward_reduce, backward_input (identity), 1 thread, "
          f"ISA under valgrind {'/'.join(sorted(isa))}, ({b} - {a} iterations)")
    print("; ".join(f"{k}: {root} ({commit(root)})" for k, root in roots.items()))
    if not args.compare:
        print("| shape | layout | instructions per iteration |")
        print("|---|---|---|")
        for s, shape in shapes.items():
            print(f"| {s} | {layout_name(shape, args.channels_last)} | {per_it[(s, 'new')]:,.0f} |")
        return
    print("| shape | layout | new per iteration | old per iteration | new / old |")
    print("|---|---|---|---|---|")
    for s, shape in shapes.items():
        new, old = per_it[(s, "new")], per_it[(s, "old")]
        print(f"| {s} | {layout_name(shape, args.channels_last)} | {new:,.0f} | {old:,.0f} | {new / old:.3f} |")
    differ = [s for s in shapes if res[(s, "new", a)][1]["DIGEST"] != res[(s, "old", a)][1]["DIGEST"]]
    print("results (one iteration's outputs and running statistics) bitwise the same in both builds"
          if not differ else f"results differ between the builds at {', '.join(differ)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2x32x7x7",
                    help="(N, C, ...) shapes, comma-separated: 2x32x7x7,2x64,256x64 (each counted on its own)")
    ap.add_argument("--channels-last", action="store_true",
                    help="the input (and dy) in torch.channels_last; 4-D shapes only, others stay contiguous")
    ap.add_argument("--activation", default="identity", choices=["identity", "leaky_relu", "elu", "silu", "relu"])
    ap.add_argument("--operators", action="store_true",
                    help="count the four operators of a step called alone (identity), not a layer's step")
    ap.add_argument("--compare", metavar="OLD_ROOT",
                    help="with --operators: count them also with the build of the checkout OLD_ROOT (built in place)")
    ap.add_argument("--steps", type=int, nargs=2, default=None, metavar=("A", "B"),
                    help="steps (iterations with --operators) of the two runs; default 20 520 (10 110)")
    ap.add_argument("--jobs", type=int, default=2, help="callgrind runs at a time")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = {s: tuple(int(d) for d in s.split("x")) for s in args.shape.split(",")}
    if args.worker:
        import torch
        torch.set_num_threads(1)
        (shape,) = shapes.values()
        if args.worker == "operators":
            return operators_worker(shape, args.steps[0], args.channels_last)
        return worker(args.worker, shape, args.activation, args.steps[0], args.channels_last)
    if any(len(shape) < 2 for shape in shapes.values()):
        ap.error("--shape: (N, C, ...) shapes, at least 2-D")
    if args.steps is None:
        args.steps = [10, 110] if args.operators else [20, 520]
    a, b = args.steps
    if not b > a >= 1:
        ap.error("--steps A B needs B > A >= 1")
    if args.compare and not args.operators:
        ap.error("--compare compares builds with --operators (a layer's step compares ours with stock)")
    if args.operators and args.activation != "identity":
        ap.error("--operators counts the identity activation's operators")
    if args.compare and os.path.realpath(args.compare) == os.path.realpath(HERE):
        ap.error(f"--compare {args.compare} is this checkout: the same build twice")
    if shutil.which("valgrind") is None:
        sys.exit("count_instructions.py needs valgrind on the PATH (Debian: apt install valgrind)")
    (main_operators if args.operators else main_layers)(args, shapes)


if __name__ == "__main__":
    main()
