"""A model family in one file: a small MLP that classifies scikit-learn's digits.

Everything `plait train` needs to train a model it has never heard of: how `--model` names
it (`mlp`, `mlp,hidden=64,depth=3`), its checks, and its task (model, data, loss,
evaluation, prediction). Nothing in plait changes for it:

    plait train --imports tests.toy_family --model mlp --data digits --nproc 2

imports this module on every rank, which registers the family (tests/test_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.families import Family, register
from plait.train.images import image_digest, image_splits, load_images


@dataclass(frozen=True)
class MLPConfig:
    hidden: int = 32
    depth: int = 2
    inputs: int = 64  # 8×8 digits
    classes: int = 10


def parse(model: str) -> MLPConfig:
    """"mlp" or "mlp,hidden=64,depth=3"; one error naming a wrong field."""
    fields: dict[str, int] = {}
    for item in filter(None, model.split(",")[1:]):
        key, _, value = item.partition("=")
        if key not in ("hidden", "depth") or not value.isdigit() or int(value) < 1:
            raise PlaitError(f"--model {model}: {item!r} is not hidden=N or depth=N", hint="e.g. --model mlp,hidden=64")
        fields[key] = int(value)
    return MLPConfig(**fields)


class MLP(nn.Module):
    """Images -> class logits: `depth` blocks of Linear + ReLU, then a linear head."""

    def __init__(self, config: MLPConfig):
        super().__init__()
        widths = [config.inputs] + [config.hidden] * config.depth
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(config.hidden, config.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DigitsTask:
    """The task: MLP, digits, cross-entropy, top-1 accuracy (plait.train.task.Task)."""

    unit = "images"
    eval_columns = ("loss", "images", "correct")
    metric_labels = {"val_loss": ("held-out", ".3f"), "val_accuracy": ("top-1 accuracy", ".1%")}

    def __init__(self, config: Any):
        self.config, self.data = config, load_images(config.data)
        self.model_config = parse(config.model)
        self.num_params = sum(p.numel() for p in MLP(self.model_config).parameters())

    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MLP(self.model_config)

    def adapter(self, model: nn.Module) -> Any:
        return None  # plait's generic adapter: the module list's children are the blocks

    def load(self) -> tuple[Any, Any, int]:
        return (*image_splits(self.data, "none", self.config.seed), image_digest(self.data))

    def batch(self, split: Any, indices: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return split.batch(indices, step)

    def loss_fn(self, model: nn.Module) -> Any:
        return lambda logits, labels, reduction="mean": F.cross_entropy(logits, labels, reduction=reduction)

    def units_per_sample(self) -> int:
        return 1

    def batch_text(self, global_batch: int) -> str:
        return f"{global_batch} digits"

    def eval_count(self, val: Any) -> int:
        return val.num_samples

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        losses = loss_fn(outputs, targets, reduction="none").double()
        correct = (outputs.argmax(-1) == targets).double()
        return torch.stack([losses, torch.ones_like(losses), correct], dim=1)

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return {"val_loss": totals["loss"] / totals["images"], "val_accuracy": totals["correct"] / totals["images"]}

    def sample(self, next_logits: Any, device: torch.device) -> str:
        return ""

    def prediction(self, work: Any, hardware: Any) -> dict[str, Any]:
        from plait.estimate import estimate_layout

        return estimate_layout(None, params=self.num_params, hardware=hardware, dp=work.dp, zero=work.zero,
                               offload=work.offload, precision=work.precision, micro_batch=work.micro_batch,
                               grad_accum=work.grad_accum, reduce_dtype=work.reduce_dtype)

    def attachments(self) -> dict[str, Any]:
        return {}


def check(config: Any) -> None:
    parse(config.model)
    if config.tp > 1 or config.pp > 1:
        raise PlaitError("--model mlp trains data-parallel only", hint="drop --tp and --pp")
    if config.data != "digits":
        raise PlaitError(f"--model mlp classifies --data digits, not {config.data!r}", hint="give --data digits")


FAMILY = register(Family(name="mlp", models="mlp: a toy MLP on digits (mlp,hidden=N,depth=N)",
                         matches=lambda model: model.partition(",")[0] == "mlp", task=DigitsTask, check=check))
