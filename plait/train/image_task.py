"""Image classification: a ResNet on digits or an image folder, cross-entropy, top-1 accuracy.

The counterpart of `LanguageTask` (plait.train.task) for the seeds' worked example. The
model's input channels and classes come from the data, so the data is read before the
model is built (every rank reads the same files; the fingerprint check catches a node that
did not).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.models.resnet import build_resnet
from plait.models.resnet_config import get_resnet
from plait.parallel.precision import param_dtype
from plait.runtime import comm
from plait.train.config import TrainConfig
from plait.train.images import DIGITS, ImageSplit, image_digest, image_splits, load_images


class ImageTask:
    """A ResNet `--model` on `--data digits` or an image-folder directory."""

    kind, unit = "image", "images"

    def __init__(self, config: TrainConfig):
        self.config = config
        if config.data == "stdlib":
            raise PlaitError(f"--model {config.model} classifies images, and --data is the text corpus 'stdlib'",
                             hint=f"give --data {DIGITS}, or a folder of class folders (root/cat/*.png)")
        self.data = load_images(config.data)
        self.model_config = get_resnet(config.model, in_channels=self.data.channels,
                                       num_classes=len(self.data.classes))
        self.num_params = sum(p.numel() for p in build_resnet(self.model_config, 0).parameters())

    def build_model(self, seed: int) -> nn.Module:
        return build_resnet(self.model_config, seed)

    def load(self) -> tuple[ImageSplit, ImageSplit, int]:
        return (*image_splits(self.data, self.config.augment, self.config.seed), image_digest(self.data))

    def batch(self, split: ImageSplit, indices: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = split.batch(indices, step)
        return images.to(param_dtype(self.config.precision)), labels

    def loss_fn(self, model: nn.Module) -> Any:
        return lambda logits, labels, reduction="mean": F.cross_entropy(logits.float(), labels, reduction=reduction)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any) -> list[float]:
        """[summed loss, images, correct top-1]."""
        correct = (outputs.argmax(-1) == targets).sum().item()
        return [loss_fn(outputs, targets, reduction="sum").item(), float(targets.numel()), float(correct)]

    def units_per_sample(self) -> int:
        return 1

    def attachments(self) -> dict[str, Any]:
        return {}  # a ResNet checkpoint is its tensors alone

    def batchnorm_channels(self) -> list[int]:
        model = build_resnet(self.model_config, 0)
        return [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)]

    def prediction(self, **layout: Any) -> dict[str, Any]:
        """Model states and dp traffic from the parameter count, plus BatchNorm's traffic.

        Not predicted for a CNN: activations and step time (the estimator's formulas are a
        transformer's), ZeRO-3's gathered blocks, and recomputation's repeated SyncBN forward.
        """
        from plait.estimate import estimate_layout
        from plait.estimate.vision import batchnorm_traffic

        for name in ("tp", "pp", "sp", "schedule", "virtual_stages", "recompute", "hardware"):
            layout.pop(name, None)
        result = estimate_layout(None, params=self.num_params, hardware="cpu", **layout)
        extra = batchnorm_traffic(self.batchnorm_channels(), layout["dp"], layout["grad_accum"], self.config.sync_bn)
        for op, wire in extra.get("dp", {}).items():
            ops = result["comm"].setdefault("dp", {})
            ops[op] = ops.get(op, 0.0) + wire
        return result

    @torch.no_grad()
    def evaluate(self, trainer: Any) -> tuple[float, float]:
        """(mean loss, top-1 accuracy) over every validation image once, in eval mode
        (running statistics). Rank r takes every dp-th image from r; all ranks run the same
        number of batches (under ZeRO-3 a forward is collective), the shorter ones padding
        with image 0 and leaving its sums out."""
        mesh, micro, split = trainer.mesh, trainer.config.micro_batch, trainer.val_split
        count, dp_size = split.num_samples, mesh.size("dp")
        mine = list(range(mesh.rank("dp"), count, dp_size))
        rounds = -(-count // dp_size)
        totals = torch.zeros(3, dtype=torch.float64, device=mesh.device)
        trainer.model.eval()
        try:
            for i in range(0, rounds, micro):
                real = mine[i: i + micro]
                inputs, targets = trainer._batch(split, real + [0] * (min(micro, rounds - i) - len(real)))
                outputs = trainer.model(inputs)[:len(real)]
                if real:
                    totals += torch.tensor(self.eval_sums(outputs, targets[:len(real)], trainer.loss_fn),
                                           dtype=torch.float64, device=mesh.device)
        finally:
            trainer.model.train()
        comm.all_reduce(totals, mesh.axis("dp"), purpose=comm.TELEMETRY)
        return (totals[0] / totals[1]).item(), (totals[2] / totals[1]).item()
