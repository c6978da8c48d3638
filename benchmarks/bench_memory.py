#!/usr/bin/env python
"""Whole-model activation memory: stock torchvision models against the same
models converted with ``inplace_abn.convert_model`` (issue #5).

Measures (docs/DESIGN.md section 5):

* everywhere: the bytes of distinct storages autograd saves for backward in
  one training-mode forward (``inplace_abn.memory.model_saved_bytes``,
  parameters and buffers left out). Deterministic, and affine in the batch
  size: a per-image part plus a constant (the per-channel statistics, which
  do not depend on the resolution either). So it is measured once at full
  size (``--batch``, default 2) and the constant at 32x32 (batches 2 and 4),
  and the plot draws per-image x batch + constant;
* on CUDA, when available: ``torch.cuda.max_memory_allocated()`` over one
  training step (forward, backward, SGD step) minus what was allocated before
  it, at each plotted batch size, and the largest batch that fits under
  ``--cuda-limit-gib`` (doubling, then bisection to 5%).

Prints a table (bytes and ratio) and saves a plot of memory against batch
size (default ``docs/memory.png``).

    PYTHONPATH=. INPLACE_ABN_BACKEND=python python benchmarks/bench_memory.py
    python benchmarks/bench_memory.py --quick --out /tmp/memory.png   # 64x64, for tests
"""
import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import inplace_abn  # noqa: E402
from inplace_abn import convert_model  # noqa: E402
from inplace_abn.memory import model_saved_bytes  # noqa: E402

MODELS = ("resnet50", "resnet101", "deeplabv3_resnet50", "efficientnet_b0")
PLOT_BATCHES = (1, 2, 4, 8)
MiB = 2.0**20


def build(name):
    """A torchvision model by name, or a timm model as ``timm:NAME`` (random weights)."""
    torch.manual_seed(0)
    if name.startswith("timm:"):
        import timm

        return timm.create_model(name[len("timm:"):], pretrained=False)
    import torchvision

    if name.startswith(("deeplabv3", "fcn")):
        return getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
    return getattr(torchvision.models, name)(weights=None)


def _output(out):
    return out["out"] if isinstance(out, dict) else out


def saved_bytes(model, batch, res, device="cpu"):
    model.train()
    x = torch.randn(batch, 3, res, res, device=device)
    return model_saved_bytes(model, x)


# ---- CUDA ---------------------------------------------------------------------------------


def cuda_step_peak(model, batch, res):
    """Peak bytes allocated over one training step beyond what was allocated before it."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 3, res, res, device="cuda")

    def step():
        loss = _output(model(x)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up (cuDNN workspaces, lazy allocations)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _fits(model, batch, res):
    try:
        cuda_step_peak(model, batch, res)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def cuda_largest_batch(model, res, start=8, cap=4096):
    """Largest batch whose training step fits (doubling, then bisection to ~5%)."""
    lo, hi = 0, None
    b = start
    while b <= cap:
        if _fits(model, b, res):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return lo  # the cap fits
    while hi - lo > max(1, lo // 20):
        mid = (lo + hi) // 2
        if _fits(model, mid, res):
            lo = mid
        else:
            hi = mid
    return lo


# ---- main ---------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS),
                   help="torchvision model names, or timm:NAME for a timm model")
    p.add_argument("--res", type=int, default=224, help="input height and width (default 224)")
    p.add_argument("--batch", type=int, default=2, help="batch at which saved bytes are measured (default 2)")
    p.add_argument("--quick", action="store_true", help="64x64 inputs, constant part not measured (for tests)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                                                 "memory.png"), help="plot path (PNG)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--keep-modules", action="store_true",
                   help="convert with keep_modules=True (the model's own class, modules swapped)")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA measurements")
    p.add_argument("--cuda-limit-gib", type=float, default=16.0,
                   help="memory cap for the largest-batch search (default 16 GiB)")
    args = p.parse_args(argv)
    res = 64 if args.quick else args.res
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    warnings.filterwarnings("ignore", category=UserWarning)

    t0 = time.time()
    rows = []
    for name in args.models:
        t = time.time()
        model = build(name)
        conv, report = convert_model(model, keep_modules=args.keep_modules, return_report=True)
        row = dict(name=name, report=report.summary())
        # "pairs": the straightforward per-layer conversion (BN + activation pairs only), for reference
        variants = dict(stock=model, pairs=convert_model(model, residual=False, standalone=False,
                                                         keep_modules=args.keep_modules), ours=conv)
        for key, m in variants.items():
            row[key] = saved_bytes(m, args.batch, res)
            # Saved bytes = batch * per-image bytes + a constant (per-channel statistics, independent of
            # the resolution): the constant from two batches at 32x32, the per-image part from the rest.
            row[f"{key}_const"] = 0 if args.quick else 2 * saved_bytes(m, 2, 32) - saved_bytes(m, 4, 32)
            row[f"{key}_per_image"] = (row[key] - row[f"{key}_const"]) / args.batch
        if use_cuda:
            fraction = min(1.0, args.cuda_limit_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)
            torch.cuda.set_per_process_memory_fraction(fraction)
            for key, m in (("stock", model), ("ours", conv)):
                m.cuda().train()
                row[f"peak_{key}"] = {b: cuda_step_peak(m, b, res) for b in PLOT_BATCHES}
                row[f"max_batch_{key}"] = cuda_largest_batch(m, res)
                m.cpu()
                torch.cuda.empty_cache()
        row["seconds"] = time.time() - t
        rows.append(row)
        del model, conv

    backend = "native" if inplace_abn.HAS_NATIVE and inplace_abn._backend.current() != "python" else "python"
    print(f"Activation bytes saved for backward, training-mode forward, batch {args.batch}, {res}x{res}, "
          f"float32 (backend: {backend}; torch {torch.__version__})")
    head = f"{'model':<26} {'stock bytes':>14} {'converted bytes':>16} {'ratio':>7}   {'stock MiB/img':>13} " \
           f"{'conv MiB/img':>12}   {'pairs-only ratio':>16}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<26} {r['stock']:>14,d} {r['ours']:>16,d} {r['ours'] / r['stock']:>7.3f}   "
              f"{r['stock_per_image'] / MiB:>13.1f} {r['ours_per_image'] / MiB:>12.1f}   "
              f"{r['pairs'] / r['stock']:>16.3f}")
    print("(pairs-only: convert_model(residual=False, standalone=False), BN + activation pairs alone)")
    if not args.quick:
        consts = ", ".join(f"{r['name']} {r['stock_const'] / 1024:.0f} / {r['ours_const'] / 1024:.0f}" for r in rows)
        print(f"(bytes = batch x MiB/img + a constant for the per-channel statistics, KiB stock / converted: "
              f"{consts})")
    for r in rows:
        print(f"  {r['name']}: {r['report']}")
    if use_cuda:
        print(f"\nCUDA ({torch.cuda.get_device_name(0)}): peak allocated over one training step, MiB, {res}x{res}; "
              f"largest batch under {args.cuda_limit_gib:g} GiB")
        print(f"{'model':<20} {'batch':>6} {'stock':>10} {'converted':>10} {'ratio':>7}")
        for r in rows:
            for b in PLOT_BATCHES:
                s, o = r["peak_stock"][b], r["peak_ours"][b]
                print(f"{r['name']:<20} {b:>6} {s / MiB:>10.1f} {o / MiB:>10.1f} {o / s:>7.3f}")
            print(f"{r['name']:<20} {'max':>6} {r['max_batch_stock']:>10d} {r['max_batch_ours']:>10d} "
                  f"{r['max_batch_ours'] / max(1, r['max_batch_stock']):>6.2f}x")
    print(f"\n{time.time() - t0:.0f} s")

    if not args.no_plot:
        plot(rows, args, res, use_cuda)
        print(f"plot: {os.path.normpath(args.out)}")
    return rows


def plot(rows, args, res, use_cuda):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    cols = min(n, 2)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 4.2 * nrows), squeeze=False)
    batches = list(PLOT_BATCHES)
    for ax, r in zip(axes.flat, rows):
        for key, color, label in (("stock", "tab:red", "stock BN + activation"),
                                  ("pairs", "tab:orange", "BN + activation pairs converted only"),
                                  ("ours", "tab:blue", "convert_model")):
            per, const = r[f"{key}_per_image"] / MiB, r[f"{key}_const"] / MiB
            ax.plot(batches, [per * b + const for b in batches], "-", color=color, label=label)
            ax.plot([args.batch], [r[key] / MiB], "o", color=color)  # the measured point
        if use_cuda:
            ax.plot(batches, [r["peak_stock"][b] / MiB for b in batches], "s--", color="tab:red", alpha=0.6,
                    label="stock, CUDA peak per step")
            ax.plot(batches, [r["peak_ours"][b] / MiB for b in batches], "s--", color="tab:blue", alpha=0.6,
                    label="converted, CUDA peak per step")
        ax.set_title(f"{r['name']}: saved for backward {r['ours'] / r['stock']:.2f}x stock")
        ax.set_xlabel(f"batch size ({res}x{res} inputs)")
        ax.set_ylabel("activation memory (MiB)")
        ax.set_xticks(batches)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("Activation memory saved for backward, training mode, float32 "
                 f"(dots: measured at batch {args.batch}; lines: per-image part x batch + constant)", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
