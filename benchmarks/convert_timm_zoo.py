#!/usr/bin/env python
"""convert_model across timm's model zoo: one model per architecture family.

For each family of ``timm.list_models()`` (the name up to its first digit or
underscore; its shortest model name is taken) whose model holds a BatchNorm or
GroupNorm: build it with random weights, run a training step of the stock
model at its own input size (families whose stock model fails there are
listed apart), convert it with ``inplace_abn.convert_model``, and run a
training step (forward, backward) of the converted model in training mode.
Prints one row per model (layers converted and left, seconds) and the totals;
exits with status 1 if any conversion or converted step raised.

    python benchmarks/convert_timm_zoo.py                 # every family (~4 min on 2 cores)
    python benchmarks/convert_timm_zoo.py --families resnet efficientnet
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


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def families(timm, only=None):
    """{family: its shortest model name}, sorted by family."""
    out = {}
    for name in timm.list_models():
        fam = re.split(r"[_\d]", name)[0]
        if only and fam not in only:
            continue
        if fam not in out or len(name) < len(out[fam]):
            out[fam] = name
    return dict(sorted(out.items()))


def has_norm(model):
    return any(isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm)) for m in model.modules())


def step(model, x):
    """Forward and backward in training mode."""
    model.train()
    y = model(x.clone().requires_grad_())
    (y[0] if isinstance(y, (tuple, list)) else y).float().square().mean().backward()


def check(name, timm, limit_s):
    """(status, converted, left, seconds) for one model; status "ok", "no norm", "stock fails" or an error."""
    t = time.time()
    signal.alarm(limit_s)
    try:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10)
        if not has_norm(model):
            return "no norm", 0, 0, time.time() - t
        x = torch.randn(2, *model.pretrained_cfg.get("input_size", (3, 224, 224)))
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
    p.add_argument("--families", nargs="+", help="only these families (default: all)")
    p.add_argument("--limit-s", type=int, default=120, help="per-model time limit in seconds (default 120)")
    args = p.parse_args(argv)
    import timm
    from tqdm import tqdm

    warnings.filterwarnings("ignore")
    logging.getLogger("inplace_abn.convert").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, _alarm)
    picked = families(timm, set(args.families) if args.families else None)
    rows = []
    for fam, name in (bar := tqdm(picked.items(), desc="timm families", unit="model")):
        bar.set_postfix_str(name)
        rows.append((name, *check(name, timm, args.limit_s)))
    print(f"timm {timm.__version__}, torch {torch.__version__}, {len(picked)} families")
    print(f"{'model':<32} {'status':<24} {'converted':>9} {'left':>5} {'s':>6}")
    for name, status, conv, left, secs in rows:
        if status != "no norm":
            print(f"{name:<32} {status:<24} {conv:>9} {left:>5} {secs:>6.1f}")
    ok = [r for r in rows if r[1] == "ok"]
    failed = [r for r in rows if r[1].startswith(("ERROR", "timeout"))]
    print(f"\n{len(ok)} families with a BatchNorm or GroupNorm converted and trained a step: "
          f"{sum(r[2] for r in ok)} layers converted, {sum(r[3] for r in ok)} left; "
          f"{sum(r[1] == 'no norm' for r in rows)} without norms; "
          f"{sum(r[1].startswith('stock fails') for r in rows)} whose stock model fails; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
