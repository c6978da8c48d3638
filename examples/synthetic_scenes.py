"""Synthetic segmentation scenes and a folder dataset of image/mask pairs.

SyntheticScenes draws, on the fly and deterministically from (seed, split,
index), a textured background and several overlapping shapes (disc,
rectangle, triangle, ring), each class with its own texture, random colours,
occlusion by drawing order, and pixel noise. No download needed.

FolderSegmentation reads image/mask pairs laid out as
    ROOT/images/NAME.{jpg,png}    ROOT/masks/NAME.png        (generic), or
    ROOT/JPEGImages/NAME.jpg      ROOT/SegmentationClass/NAME.png   (Pascal VOC)
with optional ROOT/{train,val}.txt (or VOC's ImageSets/Segmentation/*.txt)
listing the names of each split; masks hold class indices, 255 = ignore.
"""
import math
import os

import torch
import torch.nn.functional as F

CLASSES = ("background", "disc", "rectangle", "triangle", "ring")
IGNORE_INDEX = 255


def _texture(kind: int, h: int, w: int, g: torch.Generator) -> torch.Tensor:
    """A (h, w) pattern in [0, 1] whose statistics identify the class."""
    yy, xx = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                            indexing="ij")
    phase = torch.rand((), generator=g).item() * 2 * math.pi
    if kind == 0:  # background: smooth low-frequency noise
        coarse = torch.rand(1, 1, max(h // 16, 2), max(w // 16, 2), generator=g)
        return F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0, 0]
    if kind == 1:  # disc: fine diagonal stripes
        return 0.5 + 0.5 * torch.sin((xx + yy) * 0.9 + phase)
    if kind == 2:  # rectangle: checkerboard
        return (((xx // 4) + (yy // 4)) % 2).float()
    if kind == 3:  # triangle: horizontal stripes
        return 0.5 + 0.5 * torch.sin(yy * 1.3 + phase)
    return 0.5 + 0.5 * torch.cos(torch.sqrt((xx - w / 2) ** 2 + (yy - h / 2) ** 2) * 1.1 + phase)  # ring: circles


def _shape_mask(kind: int, h: int, w: int, g: torch.Generator) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                            indexing="ij")
    r = lambda a, b: a + (b - a) * torch.rand((), generator=g).item()  # noqa: E731
    cy, cx, s = r(0.15, 0.85) * h, r(0.15, 0.85) * w, r(0.12, 0.3) * min(h, w)
    if kind == 1:
        return (yy - cy) ** 2 + (xx - cx) ** 2 <= s**2
    if kind == 2:
        return ((yy - cy).abs() <= s * r(0.5, 1.0)) & ((xx - cx).abs() <= s * r(0.5, 1.0))
    if kind == 3:
        # upward triangle: inside three half-planes
        top, base = cy - s, cy + s
        half = (yy - top) / (2 * s) * s
        return (yy >= top) & (yy <= base) & ((xx - cx).abs() <= half)
    d2 = (yy - cy) ** 2 + (xx - cx) ** 2
    return (d2 <= s**2) & (d2 >= (0.55 * s) ** 2)


class SyntheticScenes(torch.utils.data.Dataset):
    """(image float32 (3, H, W) normalised, mask int64 (H, W)) pairs, generated on the fly."""

    num_classes = len(CLASSES)

    def __init__(self, length: int, size: int = 96, seed: int = 0, split: str = "train", max_shapes: int = 4,
                 noise: float = 0.08):
        self.length, self.size, self.max_shapes, self.noise = length, size, max_shapes, noise
        self.base_seed = seed * 1_000_003 + (0 if split == "train" else 500_009)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.base_seed + index)
        h = w = self.size
        color = torch.rand(3, 1, 1, generator=g)
        image = _texture(0, h, w, g) * color + (1 - color) * 0.3
        mask = torch.zeros(h, w, dtype=torch.int64)
        for _ in range(int(torch.randint(1, self.max_shapes + 1, (), generator=g))):
            kind = int(torch.randint(1, len(CLASSES), (), generator=g))
            region = _shape_mask(kind, h, w, g)
            col = torch.rand(3, 1, 1, generator=g) * 0.8 + 0.2
            tex = _texture(kind, h, w, g)
            image = torch.where(region, tex * col + (1 - tex) * col * 0.25, image)  # later shapes occlude
            mask[region] = kind
        image = image + self.noise * torch.randn(3, h, w, generator=g)
        return (image - 0.45) / 0.25, mask


class FolderSegmentation(torch.utils.data.Dataset):
    """Image/mask pairs from a folder (see module docstring), resized to ``size``."""

    def __init__(self, root: str, split: str = "train", size: int = 96):
        import torchvision.io as io

        self._io = io
        if not os.path.isdir(root):
            raise FileNotFoundError(f"--data-root {root!r} is not a folder")
        if os.path.isdir(os.path.join(root, "JPEGImages")):
            img_dir, mask_dir = os.path.join(root, "JPEGImages"), os.path.join(root, "SegmentationClass")
            list_file = os.path.join(root, "ImageSets", "Segmentation", f"{split}.txt")
        else:
            img_dir, mask_dir = os.path.join(root, "images"), os.path.join(root, "masks")
            list_file = os.path.join(root, f"{split}.txt")
        for d in (img_dir, mask_dir):
            if not os.path.isdir(d):
                raise FileNotFoundError(
                    f"{d!r} is missing: --data-root must hold images/ and masks/ (or VOC's JPEGImages/ and "
                    "SegmentationClass/)")
        images = {os.path.splitext(f)[0]: f for f in os.listdir(img_dir) if f.lower().endswith((".jpg", ".jpeg", ".png"))}
        if os.path.exists(list_file):
            with open(list_file) as f:
                names = [line.strip() for line in f if line.strip()]
        else:
            names = sorted(n for n in images if os.path.exists(os.path.join(mask_dir, n + ".png")))
        missing = [n for n in names if n not in images or not os.path.exists(os.path.join(mask_dir, n + ".png"))]
        if missing:
            raise FileNotFoundError(f"{len(missing)} images or masks missing in {root!r}, e.g. {missing[0]!r}")
        if not names:
            raise FileNotFoundError(f"no image/mask pairs found in {root!r}")
        self.items = [(os.path.join(img_dir, images[n]), os.path.join(mask_dir, n + ".png")) for n in names]
        self.size = size
        self.num_classes = None  # unknown: pass --num-classes

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        img_path, mask_path = self.items[index]
        image = self._io.read_image(img_path, mode=self._io.ImageReadMode.RGB).float() / 255
        mask = self._io.read_image(mask_path, mode=self._io.ImageReadMode.UNCHANGED)[0].long()
        image = F.interpolate(image[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        mask = F.interpolate(mask[None, None].float(), size=(self.size, self.size), mode="nearest")[0, 0].long()
        return (image - 0.45) / 0.25, mask
