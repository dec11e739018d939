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
from torch import nn

from plait.errors import PlaitError
from plait.families import Family, register
from plait.families.resnet.task import ClassificationTask
from plait.train.data.images import image_digest, image_splits, load_images


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


class DigitsTask(ClassificationTask):
    """The task (plait.train.loop.task.Task): the MLP on digits; a classifier's batch, loss and
    evaluation (top-1 accuracy) come with plait's ClassificationTask."""

    def __init__(self, config: Any):
        self.config, self.data = config, load_images(config.data)
        self.model_config = parse(config.model)
        self.num_params = sum(p.numel() for p in MLP(self.model_config).parameters())

    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MLP(self.model_config)

    def load(self) -> tuple[Any, Any, int]:
        return (*image_splits(self.data, "none", self.config.seed), image_digest(self.data))

    def prediction(self, work: Any, hardware: Any) -> dict[str, Any]:
        """States and dp traffic from the parameter count (no activations or time for an MLP)."""
        from plait.estimate import estimate_by_size

        return estimate_by_size(self.num_params, work, hardware=hardware)


def check(config: Any) -> None:
    parse(config.model)
    if config.tp > 1 or config.pp > 1:
        raise PlaitError("--model mlp trains data-parallel only", hint="drop --tp and --pp")
    if config.data != "digits":
        raise PlaitError(f"--model mlp classifies --data digits, not {config.data!r}", hint="give --data digits")


FAMILY = register(Family(name="mlp", models="mlp: a toy MLP on digits (mlp,hidden=N,depth=N)",
                         matches=lambda model: model.partition(",")[0] == "mlp", task=DigitsTask, check=check))
