#!/usr/bin/env python
"""A diffusers UNet2DModel, stock against converted: activation memory and training-step time (issue 14).

The model is the one of ``examples/train_diffusion_unet.py`` (`build_unet`):
64x64 px, block_out_channels (32, 64, 64, 128), two ResnetBlock2D per level,
GroupNorm with 8 groups, self-attention only at the third level (16x16 px),
the layout of diffusers' unconditional-training UNets (attention where the
resolution is low, ResNet blocks everywhere). Variants, from the same weights:

  stock       : the diffusers model;
  converted   : ``inplace_abn.convert_model(model)``: every ResnetBlock2D's
                norm1 -> SiLU and norm2 -> SiLU, and the output
                conv_norm_out -> conv_act, become InPlaceAGN layers; norm1
                has preserve_input=True (the shortcut reads the block input):
                its output goes to a new tensor;
  norm1 on a clone : the same, with norm1 overwriting a clone of the block
                input instead (how the conversion did it before
                preserve_input: one more pass over the block input);
  norm1 kept  : the same rewrite with norm1 left a stock GroupNorm + SiLU
                (the alternative that converts less, docs/DESIGN.md 9.1).

Memory: bytes saved for backward by one training forward
(``inplace_abn.memory.model_saved_bytes``, docs/DESIGN.md section 5), and the
upper bound of any conversion of the GroupNorm -> activation pairs, computed
on the stock model (`pair_bound`): every storage the stock forward saves,
except those saved only by the GroupNorm or the activation of a pair (the
GroupNorm's input, the activation's input), plus each pair's output, which
an in-place layer has to keep. That is what "each pair keeps one tensor"
costs; a real layer adds its 1-bit SiLU mask and (N, G) variances.

Time: one training step (noise-prediction MSE, forward, backward, AdamW),
the variants in turns within every repeat (bench_models.time_interleaved),
median and ratio to stock.

    PYTHONPATH=. python benchmarks/bench_unet.py            # ~2 min on 2 cores
    PYTHONPATH=. python benchmarks/bench_unet.py --quick    # seconds
    PYTHONPATH=. python benchmarks/bench_unet.py --breakdown              # and where the step time goes
    PYTHONPATH=. python benchmarks/bench_unet.py --quick --breakdown 2

Breakdown (``--breakdown [STEPS]``, 3 steps unless given): after the timed steps, STEPS
steps of stock and converted (not "norm1 kept") run under torch.profiler, every event's
self CPU time classified as norm+act, conv or other (benchmarks/breakdown.py, which says
what the figures and the bound mean).
"""
import argparse
import copy
import json
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# bench_models puts the repository and examples/ on the path too
from bench_models import (BREAKDOWN_VARIANTS, MiB, header, keep_freed_memory, quartiles, ratio_cell,  # noqa: E402
                          time_interleaved)
from breakdown import header as breakdown_header  # noqa: E402
from breakdown import profile_variants  # noqa: E402
from breakdown import table as breakdown_table  # noqa: E402

import inplace_abn  # noqa: E402
from inplace_abn._convert_analysis import module_activation  # noqa: E402
from inplace_abn.memory import _storage_key, model_saved_bytes  # noqa: E402
from train_diffusion_unet import TIMESTEPS, alphas_cumprod, build_unet, noise_loss  # noqa: E402

VARIANTS = ("stock", "converted", "norm1 on a clone", "norm1 kept")
QUICK = dict(batch=2, size=32, repeats=2, warmup=1)


def build_variants(size: int):
    """{variant: model} from one set of initial weights, and the conversion report."""
    from inplace_abn import _convert_diffusers
    from inplace_abn.convert import ConversionReport

    torch.manual_seed(0)
    stock = build_unet(size)
    converted, report = inplace_abn.convert_model(stock, return_report=True)  # a deep copy
    cloned = copy.deepcopy(converted)
    for block in cloned.modules():
        if isinstance(block, _convert_diffusers.InPlaceResnetBlock2D) and block.fused_norm1:
            block.norm1.preserve_input = False
            block.norm1 = _OnClone(block.norm1)
    kept = copy.deepcopy(stock)
    _convert_diffusers.rewrite(kept, ("leaky_relu", 0.01), ConversionReport(), set(), fuse_norm1=False)
    return {"stock": stock, "converted": converted, "norm1 on a clone": cloned, "norm1 kept": kept}, report


class _OnClone(nn.Module):
    """An in-place layer run on a copy of its input (the "norm1 on a clone" variant)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.clone())


def _keys(value):
    """{storage key: bytes} of the tensors in ``value``."""
    return dict(_storage_key(t) for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def pair_bound(model: nn.Module, *inputs):
    """(stock bytes, bound bytes, number of pairs) for one training forward of ``model``.

    A pair is a GroupNorm call whose output is the input of the next module
    call, a supported activation module. Saved storages are attributed to the
    innermost leaf-module call running when autograd packs them (module hooks);
    those saved only by pair members are dropped, each pair's output is kept.
    """
    params = set(_keys(list(model.parameters()) + list(model.buffers())))
    calls, stack, saved = [], [], {}  # calls: [module, input keys, output keys]; saved: key -> [bytes, callers]

    def pre(module, args):
        stack.append(len(calls))
        calls.append([module, _keys(args), {}])

    def post(module, args, out):
        calls[stack.pop()][2] = _keys(out)

    def pack(t):
        if t.numel() > 0:
            key, nbytes = _storage_key(t)
            if key not in params:
                entry = saved.setdefault(key, [nbytes, set()])
                entry[0] = max(entry[0], nbytes)
                entry[1].add(stack[-1] if stack else -1)
        return t

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [h for m in leaves for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    del out
    pairs = [(i, i + 1) for i, (m, _, out_keys) in enumerate(calls[:-1])
             if type(m) is nn.GroupNorm and module_activation(calls[i + 1][0]) is not None
             and calls[i + 1][1].keys() == out_keys.keys()]
    members = {i for pair in pairs for i in pair}
    kept = {k: n for k, (n, callers) in saved.items() if callers - members}
    for _, j in pairs:
        kept.update(calls[j][2])  # the pair's output: an in-place layer keeps it
    return sum(n for n, _ in saved.values()), sum(kept.values()), len(pairs)


def make_step(model: nn.Module, batch: int, size: int):
    g = torch.Generator().manual_seed(1)
    clean = torch.randn(batch, 3, size, size, generator=g) * 0.5
    noise = torch.randn(clean.shape, generator=g)
    t = torch.randint(0, TIMESTEPS, (batch,), generator=g)
    abar = alphas_cumprod()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        noise_loss(model, clean, noise, t, abar).backward()
        opt.step()

    return step


def bench(batch: int, size: int, repeats: int, warmup: int, progress=True, profile_steps=0):
    models, report = build_variants(size)
    g = torch.Generator().manual_seed(2)
    inputs = (torch.randn(batch, 3, size, size, generator=g), torch.randint(0, TIMESTEPS, (batch,), generator=g))
    stock_bytes, bound, pairs = pair_bound(models["stock"], *inputs)
    mem = {v: model_saved_bytes(m.train(), *inputs) for v, m in models.items()}
    if mem["stock"] != stock_bytes:
        raise RuntimeError(f"pair_bound counted {stock_bytes} bytes for stock, model_saved_bytes {mem['stock']}")
    steps = {v: make_step(m, batch, size) for v, m in models.items()}
    times = time_interleaved(steps, repeats, warmup, f"unet b{batch} {size}px", progress)
    breakdown = profile_variants({v: steps[v] for v in BREAKDOWN_VARIANTS}, profile_steps) if profile_steps else None
    return {"breakdown": breakdown, "batch": batch, "size": size,
            "pairs": pairs, "bound_bytes": bound, "report": report.summary(),
            "variants": {v: {"times_s": times[v], "saved_bytes": mem[v]} for v in VARIANTS}}


def table(row) -> str:
    v = row["variants"]
    base, bound = v["stock"], row["bound_bytes"]
    base_med = quartiles(base["times_s"])[1]
    lines = [f"upper bound ({row['pairs']} GroupNorm -> activation pairs each keeping only its output): "
             f"{bound / MiB:.1f} MiB, {bound / base['saved_bytes']:.3f} x stock",
             "| variant | step ms (median) | IQR ms | step / stock | paired step / stock [95% CI] | saved MiB "
             "| saved / stock | saved / bound |",
             "|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        r = v[name]
        q1, med, q3 = quartiles(r["times_s"])
        lines.append(f"| {name} | {med * 1e3:.1f} | {(q3 - q1) * 1e3:.1f} | {med / base_med:.3f} | "
                     f"{ratio_cell(r['times_s'], base['times_s'])} | {r['saved_bytes'] / MiB:.1f} | "
                     f"{r['saved_bytes'] / base['saved_bytes']:.3f} | {r['saved_bytes'] / bound:.3f} |")
    conv, cloned = (v[n]["times_s"] for n in ("converted", "norm1 on a clone"))
    lines.append(f"preserve_input against a clone for norm1: converted / norm1 on a clone, paired: "
                 f"{ratio_cell(conv, cloned)}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64, help="image size in px, a multiple of 8")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant, at least 2 (default: 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default: 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="smoke test: batch 2, 32 px, 2 repeats, 1 warm-up")
    ap.add_argument("--system-malloc", action="store_true", help="keep glibc's default allocation heuristics")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    ap.add_argument("--breakdown", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                    help="then profile STEPS steps (default 3) of stock and converted: norm+act / conv / other")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.size = QUICK["batch"], QUICK["size"]
    for key, default in (("repeats", 10), ("warmup", 2)):
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else default)
    if args.repeats < 2 or args.warmup < 0 or args.size % 8 or args.breakdown < 0:
        ap.error("--repeats must be at least 2, --warmup and --breakdown not negative, --size a multiple of 8")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        import diffusers  # noqa: F401
    except ImportError:
        raise SystemExit("bench_unet.py needs diffusers: pip install diffusers")
    kept = False if args.system_malloc else keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    row = bench(args.batch, args.size, args.repeats, args.warmup, progress=not args.no_progress,
                profile_steps=args.breakdown)
    head = header(args, "freed memory kept (mallopt)" if kept else "system defaults")
    print(head)
    native = torch._C._dispatch_has_kernel_for_dispatch_key("inplace_abn::gn_forward_", "CPU")
    print(f"UNet2DModel {args.batch} x 3 x {args.size} x {args.size}; InPlaceAGN CPU kernels: "
          f"{'native' if native else 'pure PyTorch (no native GroupNorm kernel registered)'}; {row['report']}")
    print(table(row), flush=True)
    if args.breakdown:
        print()
        print(breakdown_header(args.breakdown))
        print(breakdown_table([(f"unet {args.batch} x {args.size}", row["breakdown"])]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "isa": torch.backends.cpu.get_cpu_capability(), **row}, f, indent=1)
    return row


if __name__ == "__main__":
    main()
