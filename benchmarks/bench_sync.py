"""InPlaceABNSync against a straightforward differentiable sync BatchNorm, on gloo.

Measures forward + backward time per step of one layer (leaky_relu, float32,
unless --activation / --dtype / --channels-last say otherwise) on W ranks, and
the bytes each method hands to collectives per layer and step:

- ``InPlaceABNSync``: this package (docs/DESIGN.md section 4): one float64
  all_reduce of 11 + 2C + 1 values forward (an 11-value header that checks C and
  the precision, then the statistics), one of 2C values (the sums' dtype)
  backward.
- ``naive``: per-channel [sum x, sum x^2, count] all-reduced through autograd
  (torch.distributed.nn.functional.all_reduce), then stock BatchNorm math and
  the activation with autograd (its backward all-reduces the 2C + 1 gradients).
- ``ABNSync``: this package's non-in-place layer (what convert_sync makes of
  ABN): same protocol, stock memory.

Then prints the per-layer communication of the protocols for world sizes
2-1024, computed from their definitions, beside an all_gather-based protocol
(torch.nn.SyncBatchNorm: all_gather of [mean, invstd, count] per rank forward,
all_reduce of 2C backward), whose volume grows with the world size.

    python benchmarks/bench_sync.py [--world 2] [--shape 8,64,32,32] [--iters 15]
                                    [--activation silu] [--dtype bfloat16] [--channels-last]
    torchrun --nproc-per-node 2 benchmarks/bench_sync.py      # same, launched by torchrun

On a CPU machine this measures the backend the package picked (native kernels
when built, else the pure-PyTorch backend); on CUDA pass --device cuda (NCCL).
"""
import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))
from collectives import CountCollectives  # noqa: E402  (shared with the tests)
import inplace_abn  # noqa: E402
from inplace_abn import InPlaceABN, InPlaceABNSync  # noqa: E402
from inplace_abn.sync import ABNSync  # noqa: E402


ACTIVATIONS = {"leaky_relu": (lambda y: F.leaky_relu(y, 0.01), lambda: nn.LeakyReLU(0.01, inplace=True)),
               "silu": (F.silu, lambda: nn.SiLU(inplace=True))}


class NaiveSyncBN(nn.Module):
    """Sync BatchNorm + activation written the obvious way, differentiable end to end
    (statistics in float32, whatever the input's dtype)."""

    def __init__(self, C, eps=1e-5, activation="leaky_relu", group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))
        self.eps, self.act, self.group = eps, ACTIVATIONS[activation][0], group

    def forward(self, x):
        from torch.distributed.nn.functional import all_reduce

        C = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()
        count = torch.full((1,), x.numel() // C, dtype=xf.dtype, device=x.device)
        s = all_reduce(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]), group=self.group)
        n = s[-1]
        mean = s[:C] / n
        var = (s[C:2 * C] / n - mean * mean).clamp(min=0)
        shape = (1, C) + (1,) * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape) * self.weight.view(shape) \
            + self.bias.view(shape)
        return self.act(y.to(x.dtype))


def make_layers(C, device, activation, dtype):
    kw = dict(activation=activation, activation_param=0.01 if activation == "leaky_relu" else 0.0)
    return {
        "InPlaceABNSync": InPlaceABNSync(C, **kw).to(device, dtype),
        "naive": NaiveSyncBN(C, activation=activation).to(device),
        "ABNSync": ABNSync(C, **kw).to(device, dtype),
        # not synchronised: the compute alone, to tell it from the synchronisation's cost
        "InPlaceABN local": InPlaceABN(C, **kw).to(device, dtype),
        "stock BN+act local": nn.Sequential(nn.BatchNorm2d(C), ACTIVATIONS[activation][1]()).to(device, dtype),
    }


def step(layer, x0, dy):
    x = x0.clone()
    y = layer(x)
    y.backward(dy)


def run(rank, world, args):
    import warnings

    # torch 2.14 deprecates torch.distributed.nn.functional in favour of a private module; it still works
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*distributed.nn.functional.*")
    warnings.filterwarnings("ignore", message=".*native extension not available.*")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = tuple(int(s) for s in args.shape.split(","))
    C = shape[1]
    g = torch.Generator().manual_seed(rank)
    dtype = getattr(torch, args.dtype)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    x0 = (torch.randn(shape, generator=g) * 2 + 1).to(device, dtype).contiguous(memory_format=fmt).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device, dtype).contiguous(memory_format=fmt)
    layers = make_layers(C, device, args.activation, dtype)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    # bytes per layer and step (second step: the group's first call sends its header alone first)
    traffic = {}
    for name, layer in layers.items():
        step(layer, x0, dy)
        with CountCollectives() as cc:
            step(layer, x0, dy)
        traffic[name] = [(n, k, dt, b) for (n, k, dt), b in zip(cc.sizes, cc.nbytes)]

    # time: rounds alternate the methods so that machine noise hits them alike
    times = {name: [] for name in layers}
    for name, layer in layers.items():
        for _ in range(2):
            step(layer, x0, dy)
    for _ in range(args.rounds):
        for name, layer in layers.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(layer, x0, dy)
            sync()
            times[name].append((time.perf_counter() - t0) / args.iters)
    # a step takes as long as its slowest rank
    med = torch.tensor([statistics.median(times[n]) for n in layers], dtype=torch.float64)
    dist.all_reduce(med, dist.ReduceOp.MAX)
    if rank == 0:
        report(args, world, shape, layers, med.tolist(), traffic)


def fmt_bytes(b):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


def report(args, world, shape, layers, med, traffic):
    C = shape[1]
    isa = f" ({torch.backends.cpu.get_cpu_capability()})" if args.device == "cpu" else ""
    print(f"backend={inplace_abn._backend.current()} native={inplace_abn.HAS_NATIVE} device={args.device}{isa} "
          f"world={world} per-rank shape={list(shape)} {args.dtype} {args.activation}"
          f"{' channels-last' if args.channels_last else ''}, {args.threads} thread(s)/rank, "
          f"median of {args.rounds} rounds x {args.iters} steps")
    base = med[list(layers).index("naive")]
    print(f"\n{'method':<19} {'fwd+bwd ms':>10} {'vs naive':>9}   collectives per layer and step (payload)")
    for name, t in zip(layers, med):
        calls = ", ".join(f"{n}[{k} x {dt.replace('torch.', '')}]" for n, k, dt, _ in traffic[name])
        total = sum(c[3] for c in traffic[name])
        print(f"{name:<19} {t * 1e3:>10.2f} {t / base:>8.2f}x   {calls or 'none'} = {total} B")

    print(f"\nCommunication per layer and step, C={C} and C=1024, float32 activations. 'payload': bytes")
    print("each rank hands to the collectives; 'sent': bytes each rank puts on the wire with ring")
    print("algorithms (all_reduce of B bytes: 2(W-1)/W B; all_gather of B bytes per rank: (W-1) B).")
    for c in (C, 1024):
        ours = (11 + 2 * c + 1) * 8 + 2 * c * 4  # fwd float64 header + 2C+1, bwd 2C float32
        naive = (2 * c + 1) * 4 * 2  # fwd and bwd: 2C+1 float32
        gather = (2 * c + 1) * 4 + 2 * c * 4  # all_gather input per rank + backward all_reduce
        print(f"\nC={c}: payload per rank and step: InPlaceABNSync {ours} B, naive {naive} B (both fixed), "
              f"all_gather protocol {gather} B handed in, W x {(2 * c + 1) * 4} B gathered")
        print(f"{'world':>6} {'ours sent':>11} {'naive sent':>11} {'all_gather sent':>16} {'all_gather/ours':>16}")
        for w in [2 ** k for k in range(1, 11)]:
            ring = 2 * (w - 1) / w
            o, nv = ring * ours, ring * naive
            ag = (w - 1) * (2 * c + 1) * 4 + ring * 2 * c * 4
            print(f"{w:>6} {fmt_bytes(o):>11} {fmt_bytes(nv):>11} {fmt_bytes(ag):>16} {ag / o:>15.1f}x")


def worker(rank, world, port, args):
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        run(rank, world, args)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--shape", default="8,64,32,32", help="per-rank input shape N,C,H,W")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--activation", default="leaky_relu", choices=sorted(ACTIVATIONS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--channels-last", action="store_true", help="4-d inputs in channels-last memory")
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=120))
        try:
            run(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world, port, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
