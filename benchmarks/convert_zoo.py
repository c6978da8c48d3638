#!/usr/bin/env python
"""convert_model across a model zoo: timm (one model per architecture family) or torchvision.

timm: for each family of ``timm.list_models()`` (the name up to its first digit
or underscore; its shortest model name is taken), at the model's own input
size. torchvision: every classification, segmentation and video model of
``torchvision.models.list_models()`` (detection models use FrozenBatchNorm2d,
optical flow takes image pairs: not these), at its weights' crop size (video:
16 frames; segmentation: 128 px), batch 2 (video 1).

For each model that holds a BatchNorm or GroupNorm: build it with random
weights, run a training step of the stock model (models whose stock step fails
there are listed apart), convert it with ``inplace_abn.convert_model``, and run
a training step (forward, backward) of the converted model in training mode.
Prints one row per model (layers converted and left, seconds) and the totals;
exits with status 1 if any conversion or converted step raised.

    python benchmarks/convert_zoo.py                      # timm, every family (~4 min on 2 cores)
    python benchmarks/convert_zoo.py --families resnet efficientnet
    python benchmarks/convert_zoo.py --zoo torchvision    # (~10 min)
"""
import argparse
import copy
import logging
import os
import re
import signal
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from inplace_abn import convert_model  # noqa: E402
from inplace_abn._convert_analysis import is_norm  # noqa: E402


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def family(name):
    return re.split(r"[_\d]", name)[0]


def timm_models(only=None):
    """{name: builder of (model, example input)}: the shortest model name of each timm family."""
    import timm

    picked = {}
    for name in timm.list_models():
        fam = family(name)
        if (not only or fam in only) and (fam not in picked or len(name) < len(picked[fam])):
            picked[fam] = name

    def build(name):
        model = timm.create_model(name, pretrained=False, num_classes=10)
        return model, torch.randn(2, *model.pretrained_cfg.get("input_size", (3, 224, 224)))

    return {name: build for _, name in sorted(picked.items())}


def torchvision_models(only=None):
    """{name: builder of (model, example input)}: torchvision's classification, segmentation and video models."""
    import torchvision
    from torchvision.models import get_model, get_model_weights, list_models

    def build(name):
        video = name in list_models(module=torchvision.models.video)
        segmentation = name in list_models(module=torchvision.models.segmentation)
        kwargs = dict(weights_backbone=None) if segmentation else {}
        model = get_model(name, weights=None, **kwargs)
        crop = getattr(get_model_weights(name).DEFAULT.transforms(), "crop_size", None) or [128]
        size = (crop[0], crop[-1])
        return model, torch.randn(1, 3, 16, *size) if video else torch.randn(2, 3, *size)

    modules = (torchvision.models, torchvision.models.segmentation, torchvision.models.video)
    names = sorted(n for m in modules for n in list_models(module=m))
    return {name: build for name in names if not only or family(name) in only}


def has_norm(model):
    return any(is_norm(m) for m in model.modules())


def step(model, x):
    """Forward and backward in training mode."""
    model.train()
    y = model(x.clone().requires_grad_())
    y = y["out"] if isinstance(y, dict) else getattr(y, "logits", y)  # segmentation; Inception's aux outputs
    (y[0] if isinstance(y, (tuple, list)) else y).float().square().mean().backward()


def check(name, build, limit_s):
    """(status, converted, left, seconds) for one model; status "ok", "no norm", "stock fails" or an error."""
    t = time.time()
    signal.alarm(limit_s)
    try:
        torch.manual_seed(0)
        model, x = build(name)
        if not has_norm(model):
            return "no norm", 0, 0, time.time() - t
        try:
            step(model, x)
        except Exception as e:  # the stock model itself does not run at its input size: not ours to judge
            return f"stock fails ({type(e).__name__})", 0, 0, time.time() - t
        conv, report = convert_model(copy.deepcopy(model), return_report=True)
        step(conv, x)
        return "ok", len(report.converted), len(report.left), time.time() - t
    except _Timeout:
        return f"timeout ({limit_s} s)", 0, 0, time.time() - t
    except Exception as e:
        return f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", 0, 0, time.time() - t
    finally:
        signal.alarm(0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zoo", choices=("timm", "torchvision"), default="timm")
    p.add_argument("--families", nargs="+", help="only these families (the name up to a digit or '_')")
    p.add_argument("--limit-s", type=int, default=120, help="per-model time limit in seconds (default 120)")
    args = p.parse_args(argv)
    from tqdm import tqdm

    warnings.filterwarnings("ignore")
    logging.getLogger("inplace_abn.convert").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, _alarm)
    only = set(args.families) if args.families else None
    picked = timm_models(only) if args.zoo == "timm" else torchvision_models(only)
    zoo = __import__(args.zoo)
    rows = []
    for name, build in (bar := tqdm(picked.items(), desc=args.zoo, unit="model")):
        bar.set_postfix_str(name)
        rows.append((name, *check(name, build, args.limit_s)))
    print(f"{args.zoo} {zoo.__version__}, torch {torch.__version__}, {len(picked)} models")
    print(f"{'model':<32} {'status':<24} {'converted':>9} {'left':>5} {'s':>6}")
    for name, status, conv, left, secs in rows:
        if status != "no norm":
            print(f"{name:<32} {status:<24} {conv:>9} {left:>5} {secs:>6.1f}")
    ok = [r for r in rows if r[1] == "ok"]
    failed = [r for r in rows if r[1].startswith(("ERROR", "timeout"))]
    print(f"\n{len(ok)} models with a BatchNorm or GroupNorm converted and trained a step: "
          f"{sum(r[2] for r in ok)} layers converted, {sum(r[3] for r in ok)} left; "
          f"{sum(r[1] == 'no norm' for r in rows)} without norms; "
          f"{sum(r[1].startswith('stock fails') for r in rows)} whose stock model fails; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
