"""Time of each native CPU operator alone, at 1 and 2 threads (kernel work).

Calls torch.ops.inplace_abn.{batch_stats, forward_, backward_reduce,
backward_input} directly on prepared inputs, so the figures exclude Python,
autograd and allocation of the layer's input; next to them, one clone of the
input (2 passes over memory) as a yardstick. forward_ overwrites its input,
so it is timed on a fresh copy (copy + forward, minus the copy). The 2-thread
column is what shows whether the kernels really run in parallel. For SiLU,
the last two columns time the path the layer takes on the CPU
(docs/DESIGN.md section 7.2): backward_reduce keeping z, and
backward_input_from_z_ (timed on a fresh copy of z, minus the copy).
Freed memory is kept in the process, as in bench_cpu.py: backward_input and
clone allocate a tensor of the input's size per call, which with glibc's
defaults may pay a page fault per 4 KiB on first touch in some calls and not
in others.

    python benchmarks/bench_cpu_ops.py [--repeats 30]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inplace_abn  # noqa: E402,F401  (registers torch.ops.inplace_abn)
from bench_cpu import keep_freed_memory  # noqa: E402
from inplace_abn import _activation  # noqa: E402

SHAPES = [((16, 64, 56, 56), False), ((16, 64, 56, 56), True), ((16, 512, 7, 7), False), ((4096, 512), False)]


def _median_ms(fn, repeats, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(shape, channels_last, act, repeats):
    """Milliseconds of (batch_stats, forward_, backward_reduce, backward_input, clone, and for SiLU
    backward_reduce keeping z and backward_input_from_z_, else None twice)."""
    ops = torch.ops.inplace_abn
    C, code, p = shape[1], _activation.CODES[act], 0.01
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    dy = torch.randn(shape, generator=g).contiguous(memory_format=torch.channels_last if channels_last
                                                    else torch.contiguous_format)
    w, b = torch.ones(C), torch.zeros(C)
    mean, var = ops.batch_stats(x)
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, None, 1e-5, code, p, False)
    sg, sgx = ops.backward_reduce(y, dy, mask, w, b, None, 1e-5, code, p, False)
    work = x.clone()
    t_copy = _median_ms(lambda: work.copy_(x), repeats)
    z_path = (None, None)
    if act == "silu":
        z, zwork = torch.empty_like(y), torch.empty_like(y)
        ops.backward_reduce(y, dy, mask, w, b, None, 1e-5, code, p, False, z)
        z_path = (
            _median_ms(lambda: ops.backward_reduce(y, dy, mask, w, b, None, 1e-5, code, p, False, zwork), repeats),
            _median_ms(lambda: ops.backward_input_from_z_(zwork.copy_(z), y, dy, var, w, b, None, sg, sgx, 1e-5, code,
                                                          p, False, False), repeats) - t_copy,
        )
    return (
        _median_ms(lambda: ops.batch_stats(x), repeats),
        _median_ms(lambda: ops.forward_(work.copy_(x), mean, var, w, b, None, 1e-5, code, p, False), repeats)
        - t_copy,
        _median_ms(lambda: ops.backward_reduce(y, dy, mask, w, b, None, 1e-5, code, p, False), repeats),
        _median_ms(lambda: ops.backward_input(y, dy, mask, var, w, b, None, sg, sgx, 1e-5, code, p, False, False),
                   repeats),
        _median_ms(lambda: x.clone(), repeats),
    ) + z_path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    kept = keep_freed_memory()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, float32, "
          f"median of {args.repeats}, milliseconds, allocator: "
          f"{'freed memory kept (mallopt)' if kept else 'system defaults'}")
    print("| shape | activation | layout | threads | batch_stats | forward_ | backward_reduce | backward_input | "
          "clone | reduce keeping z | input from z |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, cl in SHAPES:
        for act in ("leaky_relu", "silu"):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                t = measure(shape, cl, act, args.repeats)
                layout = "channels_last" if cl else "contiguous"
                print(f"| {'x'.join(map(str, shape))} | {act} | {layout} | {threads} | "
                      + " | ".join("-" if v is None else f"{v:.2f}" for v in t) + " |", flush=True)


if __name__ == "__main__":
    main()
