"""Quick start: the same small CNN with stock BatchNorm + LeakyReLU and with
InPlaceABN, trained a few steps on random data; prints activation memory
saved for backward and the losses.

    python examples/quickstart.py [--steps 20] [--batch 16]
"""
import argparse
import time

import torch
import torch.nn as nn

from inplace_abn import InPlaceABN
from inplace_abn.memory import model_saved_bytes


def make_net(norm_act, width=32, depth=6, classes=10):
    layers = [nn.Conv2d(3, width, 3, padding=1, bias=False)]
    for i in range(depth):
        layers += [norm_act(width), nn.Conv2d(width, width, 3, padding=1, bias=False)]
    layers += [norm_act(width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)]
    return nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=32)
    args = ap.parse_args()
    nets = {
        "stock BN + LeakyReLU": lambda c: nn.Sequential(nn.BatchNorm2d(c), nn.LeakyReLU(0.01, inplace=True)),
        "InPlaceABN": lambda c: InPlaceABN(c, activation="leaky_relu", activation_param=0.01),
    }
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    target = torch.randint(0, 10, (args.batch,), generator=g)
    results = {}
    for name, norm_act in nets.items():
        torch.manual_seed(0)
        net = make_net(norm_act)
        saved = model_saved_bytes(net, x)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        t0 = time.perf_counter()
        losses = []
        for _ in range(args.steps):
            loss = nn.functional.cross_entropy(net(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        results[name] = (saved, losses[0], losses[-1], time.perf_counter() - t0)
    base = results["stock BN + LeakyReLU"][0]
    print(f"{'model':<22} {'saved for backward':>20} {'ratio':>6} {'first loss':>10} {'last loss':>10} {'time s':>7}")
    for name, (saved, l0, l1, t) in results.items():
        print(f"{name:<22} {saved / 2**20:>17.2f} MiB {saved / base:>6.3f} {l0:>10.4f} {l1:>10.4f} {t:>7.2f}")


if __name__ == "__main__":
    main()
