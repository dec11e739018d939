"""Image classification: a ResNet on digits or an image folder, cross-entropy, top-1 accuracy.

The counterpart of `LanguageTask` (plait.families.gpt.task) for the seeds' worked example. The
model's input channels and classes come from the data, so the data is read before the
model is built (every rank reads the same files; the fingerprint check catches a node that
did not).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.estimate.layout import Workload
from plait.models.resnet.model import build_resnet
from plait.models.resnet.config import get_resnet
from plait.parallel.precision import param_dtype
from plait.train.config.settings import TrainConfig
from plait.train.data.images import ImageSplit, image_digest, image_splits, load_images


class ClassificationTask:
    """What every image classifier's task shares: a batch of images, cross-entropy, every
    held-out image scored once (loss and top-1 accuracy), images/s. A subclass brings its
    model, its data and its prediction (ImageTask below; tests/toy_family.py's MLP too)."""

    unit = "images"
    eval_columns = ("loss", "images", "correct")
    metric_labels = {"val_loss": ("held-out", ".3f"), "val_accuracy": ("top-1 accuracy", ".1%")}
    config: TrainConfig

    def adapter(self, model: nn.Module) -> Any:
        return None  # the model's own (plait_adapter), else plait's generic one

    def batch(self, split: ImageSplit, indices: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = split.batch(indices, step)
        return images.to(param_dtype(self.config.precision)), labels

    def loss_fn(self, executor: Any) -> Any:
        return lambda logits, labels, reduction="mean": F.cross_entropy(logits.float(), labels, reduction=reduction)

    def units_per_sample(self) -> int:
        return 1

    def batch_text(self, global_batch: int) -> str:
        return f"{global_batch} {self.unit}"

    def eval_count(self, val: ImageSplit) -> int:
        """Every held-out image, once."""
        return val.num_samples

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        """Per image: its loss, 1, and whether the top-1 class is right."""
        losses = loss_fn(outputs, targets, reduction="none").double()
        correct = (outputs.argmax(-1) == targets).double()
        return torch.stack([losses, torch.ones_like(losses), correct], dim=1)

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return {"val_loss": totals["loss"] / totals["images"], "val_accuracy": totals["correct"] / totals["images"]}

    def sample(self, next_logits: Any, device: torch.device) -> str:
        return ""  # a classifier has no text to show

    def calibration_shape(self) -> None:
        """No decoder to time: the calibration's smallest preset gives the machine's rates."""
        return None

    def attachments(self) -> dict[str, Any]:
        return {}  # its checkpoint is its tensors alone


class ImageTask(ClassificationTask):
    """A ResNet `--model` on `--data digits` or an image-folder directory."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.data = load_images(config.data)
        self.model_config = get_resnet(config.model, in_channels=self.data.channels,
                                       num_classes=len(self.data.classes))
        self.num_params = sum(p.numel() for p in build_resnet(self.model_config, 0).parameters())

    def build_model(self, seed: int) -> nn.Module:
        return build_resnet(self.model_config, seed)

    def load(self) -> tuple[ImageSplit, ImageSplit, int]:
        return (*image_splits(self.data, self.config.augment, self.config.seed), image_digest(self.data))

    def prediction(self, work: Workload, hardware: Any) -> dict[str, Any]:
        """`plait estimate`'s answer for this ResNet on these images (plait/estimate/vision.py):
        states and traffic from the parameter count, activations and time from its convolutions."""
        from plait.estimate.vision import estimate_cnn

        _, _, height, width = self.data.images.shape
        return estimate_cnn(self.model_config, work, params=self.num_params, height=height, width=width,
                            hardware=hardware, sync_bn=self.config.sync_bn)
