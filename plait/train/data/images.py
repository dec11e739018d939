"""Image data that needs no download: scikit-learn's digits, or a folder of class folders.

- `digits`: the 1,797 handwritten digits scikit-learn ships inside its package, 8×8 pixels
  of 0-16, one channel, ten classes.
- A directory laid out as ImageNet is kept: `root/<class name>/*.png|jpg|jpeg`, decoded with
  Pillow, made RGB and resized to `FOLDER_SIZE`² pixels. Classes are the sorted folder names.

The split is fixed: one permutation drawn from `SPLIT_SEED` (not the run's seed, so every run
of every layout evaluates on the same images), its last `VAL_FRACTION` held out. Training
samples then go through the same layout-free `StepSampler` as text.

Augmentation (random crop after zero padding, horizontal flip) is drawn per sample from
(seed, step, sample index) alone: a sample seen at a given step is augmented alike whichever
rank, micro-batch or layout holds it, so parity with one process still holds.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.errors import PlaitError
from plait.rules import AUGMENTS

DIGITS = "digits"
SPLIT_SEED = 0
VAL_FRACTION = 0.1
FOLDER_SIZE = 32
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


@dataclass(frozen=True)
class ImageSet:
    """All images of a dataset, normalised, and their labels."""

    images: torch.Tensor  # (N, C, H, W) float32, per-channel zero mean and unit variance
    labels: torch.Tensor  # (N,) int64
    classes: tuple[str, ...]
    default_augment: str

    @property
    def channels(self) -> int:
        return self.images.shape[1]


def load_images(source: str) -> ImageSet:
    """`digits`, or an image-folder directory."""
    if source == DIGITS:
        return _digits()
    path = Path(source)
    if not path.is_dir():
        raise PlaitError(f"image data {source!r} is neither 'digits' nor a directory",
                         hint="give --data digits, or a folder of class folders (root/cat/*.png)")
    return _folder(path)


def _optional(module: str, package: str, what: str) -> Any:
    """Import an optional extra's module, or say in one line how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PlaitError(f"{what} needs the {package} package, which is not installed",
                         hint="pip install 'plait[vision]' (scikit-learn and Pillow)") from None


def _digits() -> ImageSet:
    table = _digits_table()
    images = torch.tensor(table[:, :-1], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    # Flipping a digit makes another glyph: only crops for digits.
    return ImageSet(_normalise(images), torch.tensor(table[:, -1], dtype=torch.int64),
                    tuple(str(c) for c in range(10)), "crop")


def _digits_table() -> Any:
    """The (1797, 65) table of scikit-learn's digits, 64 pixels then the label a row: read
    from the file its package ships, as its `load_digits` reads it, without importing
    scikit-learn, which costs every rank of a run 1.8 s; `load_digits` itself if that file
    has moved."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        _optional("sklearn", "scikit-learn", "--data digits")  # the one-line refusal
    shipped = [Path(p) / "datasets" / "data" / "digits.csv.gz" for p in spec.submodule_search_locations or ()]
    for path in shipped:
        if path.is_file():
            return np.loadtxt(path, delimiter=",")
    bunch = _optional("sklearn.datasets", "scikit-learn", "--data digits").load_digits()
    return np.column_stack([bunch.data, bunch.target])


def _folder(root: Path) -> ImageSet:
    Image = _optional("PIL.Image", "Pillow", "an image folder")  # noqa: N806 - the module, as PIL names it

    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    files = [(f, k) for k, name in enumerate(classes) for f in sorted((root / name).iterdir())
             if f.suffix.lower() in IMAGE_SUFFIXES]
    if len(classes) < 2 or not files:
        raise PlaitError(f"{root} has {len(classes)} class folder(s) and {len(files)} image(s)",
                         hint="lay it out as root/<class>/*.png|jpg, with at least two classes")
    pixels = []
    for path, _ in files:
        try:
            with Image.open(path) as image:
                resized = image.convert("RGB").resize((FOLDER_SIZE, FOLDER_SIZE), Image.BILINEAR)
        except OSError as exc:
            raise PlaitError(f"cannot decode image {path}: {exc}", hint="remove or replace the file") from None
        pixels.append(torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8))
    images = torch.stack(pixels).view(len(files), FOLDER_SIZE, FOLDER_SIZE, 3).permute(0, 3, 1, 2).float() / 255
    return ImageSet(_normalise(images), torch.tensor([k for _, k in files]), tuple(classes), "crop,flip")


def _normalise(images: torch.Tensor) -> torch.Tensor:
    """Per-channel zero mean and unit variance over the whole set (the same on every rank)."""
    mean = images.mean(dim=(0, 2, 3), keepdim=True, dtype=torch.float64).float()
    std = images.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return ((images - mean) / std).contiguous()


def image_digest(data: ImageSet) -> int:
    """A 62-bit fingerprint of pixels and labels, compared across ranks."""
    digest = hashlib.sha256(data.images.numpy().tobytes() + data.labels.numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


@dataclass(frozen=True)
class ImageSplit:
    """A subset of an ImageSet; `batch` stacks samples, augmenting them when asked."""

    data: ImageSet
    indices: torch.Tensor
    augment: str = "none"
    seed: int = 0

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def batch(self, indices: list[int], step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.indices[indices]
        images = self.data.images[rows]
        if self.augment != "none":
            images = torch.stack([augment(img, self.augment, sample_rng(self.seed, step, i))
                                  for img, i in zip(images, indices)])
        return images, self.data.labels[rows]


def sample_rng(seed: int, step: int, index: int) -> random.Random:
    """The augmentation draws of one sample at one step, whatever the layout."""
    return random.Random((seed * 1_000_003 + step) * 1_000_033 + index)


def augment(image: torch.Tensor, kinds: str, rng: random.Random) -> torch.Tensor:
    """Random crop of the image padded by 1/8 of its side (zeros), then maybe a flip."""
    _, height, width = image.shape
    pad = max(1, height // 8)
    padded = torch.nn.functional.pad(image, (pad, pad, pad, pad))
    dy, dx = rng.randint(0, 2 * pad), rng.randint(0, 2 * pad)
    out = padded[:, dy:dy + height, dx:dx + width]
    if "flip" in kinds and rng.random() < 0.5:
        out = out.flip(-1)
    return out


def image_splits(data: ImageSet, augment_kind: str, seed: int) -> tuple[ImageSplit, ImageSplit]:
    """The fixed train/validation split; only training samples are augmented."""
    if augment_kind not in (*AUGMENTS, "auto"):
        raise PlaitError(f"unknown --augment {augment_kind!r}", hint=f"choose one of: auto, {', '.join(AUGMENTS)}")
    kind = data.default_augment if augment_kind == "auto" else augment_kind
    order = torch.randperm(len(data.labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    held = max(1, int(len(order) * VAL_FRACTION))
    return ImageSplit(data, order[:-held], kind, seed), ImageSplit(data, order[-held:])
