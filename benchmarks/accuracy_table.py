"""Error table: the in-place layer ("ours"), the stock BatchNorm + activation
path at the same precision ("stock") and the in-place floor ("floor": the exact
float64 backward from our output as rounded to the dtype, tests/reference.py
inplace_floor), each against stock BatchNorm + activation in float64
(autograd) on the same rounded input. Norm-wise relative errors, the worst
over the seeds: dx, the parameter gradients (worse of dweight and dbias) and
the forward (worse of y and the running statistics). Two row sets: ordinary
data, and a small gamma next to beta (gamma = 0.01, beta = 1), where
rebuilding xhat = (z - beta) / gamma from the rounded output amplifies its
rounding by |beta| / |gamma| (docs/DESIGN.md section 8).

    python benchmarks/accuracy_table.py [--backend native|python] [--hostile] [--shape N,C,H,W] [--seeds 3]
"""
import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from cases import PARAM, errors, floor, make_case, run  # noqa: E402

import inplace_abn  # noqa: E402
from inplace_abn._activation import is_invertible  # noqa: E402

ACTIVATIONS = ["identity", "leaky_relu", "elu", "silu", "relu"]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
GROUPS = {"dx": ("dx",), "dw,db": ("dw", "db"), "y,stats": ("y", "rm", "rv")}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def worst(err, keys):
    return max(err[k] for k in keys if k in err)


def row_set(title, shape, seeds, hostile, small_gamma):
    fmt = torch.contiguous_format
    print(f"\n{title}")
    head = " ".join(f"{g + ': ours':>13} {'stock':>8} {'floor':>8}" for g in ("dx", "dw,db"))
    print(f"{'activation':<11} {'dtype':<9} {head} {'y,stats: ours':>14} {'stock':>8}")
    for act in ACTIVATIONS:
        for dt in DTYPES:
            acc = {(g, w): 0.0 for g in GROUPS for w in ("ours", "stock", "floor")}
            has_floor = dt != torch.float64 and is_invertible(act, PARAM[act])
            for seed in range(seeds):
                case = make_case(shape, dt, seed=seed, mean_scale=1e4 if hostile else 1.0)
                if small_gamma:
                    case["w"] = torch.full_like(case["w"], 0.01)
                    case["b"] = torch.full_like(case["b"], 1.0)
                args = (fmt, True, act, "abs", False)
                ref = run(case, "stock", *args, dtype=torch.float64)
                ours = run(case, "ours", *args)
                found = {"ours": errors(ours, ref), "stock": errors(run(case, "stock", *args), ref)}
                if has_floor:
                    found["floor"] = errors(floor(case, ours, True, act, "abs", False), ref)
                for w, err in found.items():
                    for g, keys in GROUPS.items():
                        if any(k in err for k in keys):
                            acc[g, w] = max(acc[g, w], worst(err, keys))
            cells = []
            for g in ("dx", "dw,db"):
                fl = f"{acc[g, 'floor']:8.1e}" if has_floor else f"{'-':>8}"
                cells.append(f"{acc[g, 'ours']:13.1e} {acc[g, 'stock']:8.1e} {fl}")
            name = str(dt).replace("torch.", "")
            print(f"{act:<11} {name:<9} {' '.join(cells)} {acc['y,stats', 'ours']:14.1e} "
                  f"{acc['y,stats', 'stock']:8.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=["auto", "native", "python"])
    ap.add_argument("--hostile", action="store_true", help="channel means of 1e4 with unit variance")
    ap.add_argument("--shape", default="8,16,14,14")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    shape = tuple(int(s) for s in args.shape.split(","))
    print(f"inplace_abn backend={args.backend} (native available: {inplace_abn.HAS_NATIVE}) torch {torch.__version__}")
    print(f"CPU: {cpu_name()}; kernel ISA: {torch.backends.cpu.get_cpu_capability()}")
    print(f"shape={shape} seeds={args.seeds} hostile={args.hostile} training, abs weights; "
          "errors are norm-wise relative to float64 stock, worst over seeds")
    with inplace_abn.use_backend(args.backend):
        data = "channel means 1e4" if args.hostile else "ordinary data"
        row_set(f"{data}: weight ~ U(0.25, 1.75) (30% negative), bias ~ N(0, 0.5)", shape, args.seeds,
                args.hostile, False)
        row_set(f"{data}, small gamma next to beta: gamma = 0.01, beta = 1", shape, args.seeds, args.hostile, True)


if __name__ == "__main__":
    main()
