"""Train a small diffusers UNet2DModel (noise prediction, DDPM) stock and converted.

`inplace_abn.convert_model` rewrites every diffusers ResnetBlock2D
(GroupNorm -> SiLU twice per block) and the UNet's output GroupNorm -> SiLU
into in-place activated GroupNorms (`InPlaceAGN`, docs/DESIGN.md section 9.1).
The script trains the stock model and the converted one from the same
initial weights on the same batches (procedurally generated scenes,
examples/synthetic_scenes.py, noised at random DDPM timesteps), shows both
losses falling alike, and prints the activation memory each one saves for
backward (inplace_abn.memory) and their ratio.

    pip install diffusers                     # an example extra, not a dependency of inplace_abn
    python examples/train_diffusion_unet.py --threads 1   # 300 steps of 4 x 32x32 px, under 3 min
    python examples/train_diffusion_unet.py --steps 20 --batch-size 2   # seconds
    python examples/train_diffusion_unet.py --image-size 64 --channels 32 64 64 128 --layers-per-block 2
                                                        # the UNet of benchmarks/bench_unet.py

The default size is small so that the example runs in minutes on a CPU
(InPlaceAGN runs native kernels, docs/DESIGN.md section 10; the convolutions
dominate the step). On a CPU shared with other jobs, --threads 1 avoids the
thread pool's waiting.
"""
import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic_scenes import SyntheticScenes  # noqa: E402

import inplace_abn  # noqa: E402
from inplace_abn.memory import model_saved_bytes  # noqa: E402

TIMESTEPS = 1000


def build_unet(size: int = 64, channels=(32, 64, 64, 128), layers_per_block: int = 2, groups: int = 8):
    """A small UNet2DModel with the layout of diffusers' unconditional-training
    UNets: ResNet blocks at every resolution, self-attention only at a low one
    (here the third level, size/4), where it is affordable."""
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=size, in_channels=3, out_channels=3, block_out_channels=tuple(channels),
                       layers_per_block=layers_per_block, norm_num_groups=groups,
                       down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"))


def alphas_cumprod(device=None) -> torch.Tensor:
    """DDPM's linear beta schedule (1e-4 .. 0.02 over 1000 steps), cumulative products of 1 - beta."""
    betas = torch.linspace(1e-4, 0.02, TIMESTEPS, dtype=torch.float64, device=device)
    return torch.cumprod(1 - betas, 0).float()


def make_batches(steps: int, batch: int, size: int, seed: int, pool: int = 128):
    """The training batches (clean images, noise, timesteps), drawn once so both models see the same.
    Images come from a pool of ``pool`` scenes (drawing a scene takes ~50 ms), randomly flipped."""
    pool = min(pool, steps * batch)
    data = SyntheticScenes(pool, size=size, seed=seed)
    images = torch.stack([data[i][0] for i in range(pool)]) * 0.25  # roughly unit range
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        clean = images[torch.randint(0, pool, (batch,), generator=g)]
        flip = torch.rand(batch, generator=g) < 0.5
        clean = torch.where(flip.view(-1, 1, 1, 1), clean.flip(-1), clean)
        yield clean, torch.randn(clean.shape, generator=g), torch.randint(0, TIMESTEPS, (batch,), generator=g)


def noise_loss(model, clean, noise, t, abar):
    """Mean squared error of the predicted noise at timesteps t."""
    a = abar[t].view(-1, 1, 1, 1)
    noisy = a.sqrt() * clean + (1 - a).sqrt() * noise
    return F.mse_loss(model(noisy, t).sample, noise)


def train(models: dict, batches, lr: float, progress: bool = True):
    """Train every model on the same batches in turn; {name: [loss per step]} and {name: seconds}."""
    from tqdm import tqdm

    abar = alphas_cumprod()
    opts = {k: torch.optim.AdamW(m.parameters(), lr=lr) for k, m in models.items()}
    losses = {k: [] for k in models}
    seconds = {k: 0.0 for k in models}
    bar = tqdm(list(batches), desc="training", dynamic_ncols=True, disable=not progress)
    for clean, noise, t in bar:
        for k, m in models.items():
            t0 = time.perf_counter()
            opts[k].zero_grad(set_to_none=True)
            loss = noise_loss(m, clean, noise, t, abar)
            loss.backward()
            opts[k].step()
            seconds[k] += time.perf_counter() - t0
            losses[k].append(loss.item())
        bar.set_postfix_str(", ".join(f"{k} {v[-1]:.4f}" for k, v in losses.items()))
    return losses, seconds


def saved_mib(model, batch: int, size: int) -> float:
    """Activation MiB one training forward saves for backward (parameters excluded)."""
    model.train()
    x = torch.randn(batch, 3, size, size)
    t = torch.randint(0, TIMESTEPS, (batch,))
    return model_saved_bytes(model, x, t) / 2**20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=32, help="a multiple of 8 (three 2x downsamplings)")
    ap.add_argument("--channels", type=int, nargs=4, default=(16, 32, 32, 64), metavar="C",
                    help="block_out_channels (benchmarks/bench_unet.py measures 32 64 64 128, 2 layers per block)")
    ap.add_argument("--layers-per-block", type=int, default=1)
    ap.add_argument("--groups", type=int, default=8, help="GroupNorm groups (norm_num_groups)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--log-json", default=None, help="write the losses, memories and times to this JSON file")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.batch_size < 1:
        ap.error("--steps must be at least 2 and --batch-size at least 1")
    if args.image_size % 8:
        ap.error(f"--image-size must be a multiple of 8, got {args.image_size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import diffusers  # noqa: F401
    except ImportError:
        raise SystemExit("this example needs diffusers: pip install diffusers")
    torch.manual_seed(args.seed)
    stock = build_unet(args.image_size, args.channels, args.layers_per_block, args.groups)
    converted, report = inplace_abn.convert_model(copy.deepcopy(stock), return_report=True)
    print(report.summary())
    models = {"stock": stock, "converted": converted}
    mem = {k: saved_mib(m, args.batch_size, args.image_size) for k, m in models.items()}
    start = time.perf_counter()
    losses, seconds = train(models, make_batches(args.steps, args.batch_size, args.image_size, args.seed), args.lr,
                            progress=not args.no_progress)
    k = max(1, min(20, args.steps // 5))
    print(f"{args.steps} steps of batch {args.batch_size} at {args.image_size}x{args.image_size} px, "
          f"{time.perf_counter() - start:.0f} s in all")
    print("model      | loss, first steps | loss, last steps | s / step | saved for backward")
    for name in models:
        first, last = sum(losses[name][:k]) / k, sum(losses[name][-k:]) / k
        print(f"{name:<10} | {first:17.4f} | {last:16.4f} | {seconds[name] / args.steps:8.3f} | "
              f"{mem[name]:.1f} MiB")
    print(f"(losses averaged over the first and last {k} steps)")
    print(f"converted / stock: saved memory {mem['converted'] / mem['stock']:.3f}, "
          f"time per step {seconds['converted'] / seconds['stock']:.3f}")
    result = {"losses": losses, "saved_mib": mem, "seconds": seconds}
    if args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
