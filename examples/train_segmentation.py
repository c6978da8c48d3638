"""Train a torchvision segmentation model with In-Place ABN.

The model (DeepLabV3 or FCN on a ResNet backbone) is converted with
`inplace_abn.convert_model` (BatchNorm + activation -> in-place layers,
BatchNorm + residual add + activation -> fused residual layers) and, when
several processes run, with `inplace_abn.convert_sync` so batch statistics
are synchronised across them.

    python examples/train_segmentation.py                       # one process
    torchrun --nproc_per_node 2 examples/train_segmentation.py  # gloo on CPU, NCCL on GPU
    python examples/train_segmentation.py --compare-stock       # also run the unconverted model

By default it trains on built-in synthetic scenes (no download). With
--data-root it reads image/mask pairs from a folder (see synthetic_scenes.py).
"""
import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic_scenes import IGNORE_INDEX, FolderSegmentation, SyntheticScenes  # noqa: E402

MODELS = ("deeplabv3_resnet18", "fcn_resnet18", "deeplabv3_resnet50", "fcn_resnet50", "deeplabv3_resnet101",
          "fcn_resnet101")


# ---- model -----------------------------------------------------------------------

def build_model(name: str, num_classes: int) -> nn.Module:
    """A torchvision segmentation model, randomly initialised (no download).

    ``*_resnet18`` are DeepLabV3 / FCN heads on a dilated ResNet-18 backbone,
    assembled from torchvision parts: small enough to train on a laptop CPU.
    """
    import torchvision.models as tvm
    import torchvision.models.segmentation as seg

    if name not in MODELS:
        raise SystemExit(f"unknown --model {name!r}; choose one of: {', '.join(MODELS)}")
    if name.endswith("resnet18"):
        from torchvision.models._utils import IntermediateLayerGetter
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead, DeepLabV3
        from torchvision.models.segmentation.fcn import FCN, FCNHead

        backbone = tvm.resnet18(weights=None)
        _dilate_last_stage(backbone)
        backbone = IntermediateLayerGetter(backbone, return_layers={"layer4": "out"})
        if name.startswith("deeplabv3"):
            # atrous rates for a 6x6 map (96 px at output stride 16), not VOC's 12/24/36
            return DeepLabV3(backbone, DeepLabHead(512, num_classes, atrous_rates=(2, 4, 6)))
        return FCN(backbone, FCNHead(512, num_classes))
    builder = getattr(seg, name)
    return builder(weights=None, weights_backbone=None, num_classes=num_classes, aux_loss=False)


def _dilate_last_stage(resnet: nn.Module) -> None:
    """Output stride 16: layer4 without its stride, its 3x3 convolutions dilated by 2.

    torchvision's BasicBlock refuses dilation at construction, but its
    convolutions take it; this is what replace_stride_with_dilation does for
    the Bottleneck ResNets (the first block keeps dilation 1 in its first conv).
    At 96 px the head then sees 6x6 instead of 3x3 features, which small and
    thin shapes need.
    """
    for i, block in enumerate(resnet.layer4):
        if i == 0:
            block.conv1.stride = (1, 1)
            if block.downsample is not None:
                block.downsample[0].stride = (1, 1)
            convs = (block.conv2,)
        else:
            convs = (block.conv1, block.conv2)
        for conv in convs:
            conv.dilation, conv.padding = (2, 2), (2, 2)


def forward_logits(model, images):
    out = model(images)
    return out["out"] if isinstance(out, dict) else out


# ---- distributed ---------------------------------------------------------------------

def setup_distributed(device_arg: str):
    """(rank, world, device). torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; gloo on CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, device


# ---- metrics ------------------------------------------------------------------------------

def confusion(pred, target, n):
    keep = target != IGNORE_INDEX
    return torch.bincount(target[keep] * n + pred[keep], minlength=n * n).view(n, n)


def scores(conf):
    conf = conf.double()
    tp = conf.diag()
    union = conf.sum(0) + conf.sum(1) - tp
    present = union > 0
    miou = (tp[present] / union[present]).mean().item() if present.any() else 0.0
    acc = (tp.sum() / conf.sum().clamp(min=1)).item()
    return miou, acc


@torch.no_grad()
def evaluate(model, loader, num_classes, device, args, world):
    model.eval()
    conf = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for images, masks in loader:
        images, masks = to_device(images, masks, device, args.channels_last)
        with autocast(device, args.amp):
            logits = forward_logits(model, images)
        conf += confusion(logits.argmax(1).flatten(), masks.flatten(), num_classes)
    if world > 1:
        dist.all_reduce(conf)
    model.train()
    return scores(conf)


# ---- training ------------------------------------------------------------------------------

def autocast(device, amp):
    if not amp:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if device.type == "cpu" or amp == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def to_device(images, masks, device, channels_last):
    images = images.to(device, non_blocking=True)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, masks.to(device, non_blocking=True)


def make_loaders(args, rank, world):
    if args.data_root:
        train_set = FolderSegmentation(args.data_root, "train", args.image_size)
        val_split = "val" if os.path.exists(os.path.join(args.data_root, "val.txt")) or os.path.exists(
            os.path.join(args.data_root, "ImageSets", "Segmentation", "val.txt")) else "train"
        val_set = FolderSegmentation(args.data_root, val_split, args.image_size)
        num_classes = args.num_classes
        if num_classes is None:
            raise SystemExit("--data-root needs --num-classes (the number of classes in the masks)")
    else:
        n_train = args.steps_per_epoch * args.batch_size
        train_set = SyntheticScenes(n_train, args.image_size, seed=args.seed, split="train")
        val_set = SyntheticScenes(args.val_size, args.image_size, seed=args.seed, split="val")
        num_classes = args.num_classes or SyntheticScenes.num_classes
    g = torch.Generator().manual_seed(args.seed)
    if world > 1:
        train_sampler = torch.utils.data.DistributedSampler(train_set, world, rank, shuffle=True, seed=args.seed)
        val_sampler = torch.utils.data.DistributedSampler(val_set, world, rank, shuffle=False)
    else:
        train_sampler, val_sampler = torch.utils.data.RandomSampler(train_set, generator=g), None
    common = dict(num_workers=args.workers, pin_memory=torch.cuda.is_available(), persistent_workers=args.workers > 0)
    train = torch.utils.data.DataLoader(train_set, args.local_batch, sampler=train_sampler, drop_last=True, **common)
    val = torch.utils.data.DataLoader(val_set, args.local_batch, sampler=val_sampler, **common)
    return train, val, num_classes


def prepare_model(args, num_classes, device, world, convert):
    """Build, convert (unless stock), move to device; returns (model, conversion summary)."""
    torch.manual_seed(args.seed)  # same initial weights on every rank and for both variants
    model = build_model(args.model, num_classes)
    summary = "stock (unconverted)"
    if convert:
        import inplace_abn

        model, report = inplace_abn.convert_model(model, activation="leaky_relu",
                                                 activation_param=args.slope, return_report=True)
        summary = str(report).splitlines()[0] if str(report) else "converted"
        if world > 1:
            model = inplace_abn.convert_sync(model)
    elif world > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    return model, summary


def activation_bytes(model, args, device):
    """Activation bytes saved for backward by one training forward (docs/DESIGN.md section 5)."""
    from inplace_abn.memory import saved_bytes

    x = torch.randn(args.local_batch, 3, args.image_size, args.image_size, device=device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    params = list(model.parameters()) + list(model.buffers())
    state = {k: v.clone() for k, v in model.state_dict().items()}  # the probe must not move running stats
    with autocast(device, args.amp):
        n = saved_bytes(lambda: forward_logits(model, x), exclude=params)
    model.load_state_dict(state)
    return n


def train(args, convert=True, label="in-place ABN"):
    rank, world, device = args.rank, args.world, args.device
    train_loader, val_loader, num_classes = make_loaders(args, rank, world)
    model, summary = prepare_model(args, num_classes, device, world, convert)
    mem = activation_bytes(model, args, device)
    ddp = model
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - min(it, total - 1) / total) ** 0.9)
    scaler = torch.amp.GradScaler(enabled=bool(args.amp) and device.type == "cuda" and args.amp != "bf16")
    start_epoch = 0
    ckpt_path = os.path.join(args.checkpoint_dir, f"{'inplace' if convert else 'stock'}_last.pt")
    if args.resume and convert:
        if not os.path.exists(args.resume):
            raise SystemExit(f"--resume: no checkpoint at {args.resume!r}")
        ck = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    if rank == 0:
        print(f"[{label}] {args.model}, {world} process(es) on {device}, {summary}")
    losses, step_times, miou, acc = [], [], 0.0, 0.0
    for epoch in range(start_epoch, args.epochs):
        if isinstance(train_loader.sampler, torch.utils.data.DistributedSampler):
            train_loader.sampler.set_epoch(epoch)
        bar = progress(train_loader, rank, f"{label} epoch {epoch + 1}/{args.epochs}")
        for images, masks in bar:
            images, masks = to_device(images, masks, device, args.channels_last)
            t0 = time.perf_counter()
            with autocast(device, args.amp):
                loss = F.cross_entropy(forward_logits(ddp, images), masks, ignore_index=IGNORE_INDEX)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{losses[-1]:.3f}", img_s=f"{images.shape[0] * world / step_times[-1]:.1f}")
        miou, acc = evaluate(ddp, val_loader, num_classes, device, args, world)
        if rank == 0:
            print(f"[{label}] epoch {epoch + 1}: loss {sum(losses[-len(train_loader):]) / len(train_loader):.4f}  "
                  f"val mIoU {miou:.3f}  pixel acc {acc:.3f}")
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "epoch": epoch, "miou": miou}, ckpt_path)
    steady = step_times[min(2, len(step_times) - 1):] or step_times
    return dict(losses=losses, miou=miou, acc=acc, step=sum(steady) / max(len(steady), 1), mem=mem)


def progress(loader, rank, desc):
    if rank != 0:
        return loader
    try:
        from tqdm import tqdm

        return tqdm(loader, desc=desc, leave=False, dynamic_ncols=True, disable=None)  # None: off when not a terminal
    except ImportError:
        return loader


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deeplabv3_resnet18", help=f"one of: {', '.join(MODELS)}")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps-per-epoch", type=int, default=40, help="synthetic data: steps per epoch")
    ap.add_argument("--batch-size", type=int, default=16,
                    help="global batch per step, split evenly across the processes (with InPlaceABNSync the "
                         "batch statistics are those of the whole global batch)")
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--val-size", type=int, default=64)
    ap.add_argument("--num-classes", type=int, default=None)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--slope", type=float, default=0.01, help="leaky_relu slope replacing ReLU")
    ap.add_argument("--data-root", default=None, help="folder of image/mask pairs (default: synthetic scenes)")
    ap.add_argument("--checkpoint-dir", default="checkpoints")
    ap.add_argument("--resume", default=None, help="checkpoint to resume from (loaded with weights_only=True)")
    ap.add_argument("--amp", nargs="?", const="auto", default=None, choices=["auto", "bf16", "fp16"],
                    help="mixed precision: bfloat16 on CPU, float16 (or bf16) on GPU")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    ap.add_argument("--compare-stock", action="store_true", help="also train the unconverted model and compare")
    ap.add_argument("--log-json", default=None, help="write losses and scores to this JSON file (rank 0)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.model not in MODELS:
        raise SystemExit(f"unknown --model {args.model!r}; choose one of: {', '.join(MODELS)}")
    if args.data_root and not os.path.isdir(args.data_root):
        raise SystemExit(f"--data-root {args.data_root!r}: no such folder")
    args.rank, args.world, args.device = setup_distributed(args.device)
    if args.batch_size % args.world:
        raise SystemExit(f"--batch-size {args.batch_size} is the global batch and must be divisible by the "
                         f"{args.world} processes")
    args.local_batch = args.batch_size // args.world
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device.type == "cpu" and args.world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world))
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    ours = train(args, convert=True)
    t_ours = time.perf_counter() - t0
    if args.rank == 0:
        print(f"in-place ABN: final loss {ours['losses'][-1]:.4f}, val mIoU {ours['miou']:.3f}, "
              f"pixel acc {ours['acc']:.3f}, {t_ours:.1f} s")
    if args.log_json and args.rank == 0:
        import json

        with open(args.log_json, "w") as f:
            json.dump({"losses": ours["losses"], "miou": ours["miou"], "acc": ours["acc"], "seconds": t_ours}, f)
    if args.compare_stock:
        stock = train(args, convert=False, label="stock")
        if args.rank == 0:
            print()
            print(f"| {args.model}, batch {args.local_batch}x{args.world}, {args.image_size}px | stock | in-place ABN "
                  "| ratio |")
            print("|---|---|---|---|")
            print(f"| activation memory saved for backward (MiB) | {stock['mem'] / 2**20:.1f} | "
                  f"{ours['mem'] / 2**20:.1f} | {ours['mem'] / stock['mem']:.3f} |")
            print(f"| step time (ms) | {stock['step'] * 1e3:.0f} | {ours['step'] * 1e3:.0f} | "
                  f"{ours['step'] / stock['step']:.2f} |")
            print(f"| final val mIoU | {stock['miou']:.3f} | {ours['miou']:.3f} | |")
    if args.world > 1:
        # every rank reaches the end (rank 0 may still be writing its checkpoint)
        # before any tears the group down: one CI run saw a rank abort at exit
        # ("terminate called without an active exception") when it left first
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
