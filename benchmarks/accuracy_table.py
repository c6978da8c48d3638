"""Error table: the in-place layer and the stock BatchNorm + activation path,
each against stock BatchNorm + activation in float64 (autograd) on the same
rounded input. Prints the worst norm-wise relative error over outputs and
gradients (y, dx, dweight, dbias, running stats) per activation and dtype.

    python benchmarks/accuracy_table.py [--backend native|python] [--hostile]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from cases import LAYOUTS, errors, make_case, run  # noqa: E402

import inplace_abn  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=["auto", "native", "python"])
    ap.add_argument("--hostile", action="store_true", help="channel means of 1e4 with unit variance")
    ap.add_argument("--shape", default="8,16,14,14")
    args = ap.parse_args()
    torch.set_num_threads(2)
    shape = tuple(int(s) for s in args.shape.split(","))
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    print(f"backend={args.backend} shape={shape} hostile={args.hostile}")
    print(f"{'activation':<11} {'dtype':<9} {'ours':>9} {'stock':>9} {'ratio':>6}  worst output")
    with inplace_abn.use_backend(args.backend):
        for act in ["identity", "leaky_relu", "elu", "silu", "relu"]:
            for dt in dtypes:
                worst_o, worst_s, key = 0.0, 0.0, ""
                for seed in range(3):
                    case = make_case(shape, dt, seed=seed, mean_scale=1e4 if args.hostile else 1.0)
                    fmt = torch.contiguous_format
                    ref = run(case, "stock", fmt, True, act, "abs", False, dtype=torch.float64)
                    eo = errors(run(case, "ours", fmt, True, act, "abs", False), ref)
                    es = errors(run(case, "stock", fmt, True, act, "abs", False), ref)
                    for k in eo:
                        if eo[k] > worst_o:
                            worst_o, key = eo[k], k
                        worst_s = max(worst_s, es[k])
                ratio = worst_o / worst_s if worst_s else float("nan")
                print(f"{act:<11} {str(dt).replace('torch.', ''):<9} {worst_o:9.2e} {worst_s:9.2e} {ratio:6.2f}  {key}")


if __name__ == "__main__":
    main()
