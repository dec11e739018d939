"""A training task: what the trainer needs to know about the model family and its data.

The trainer's loop (micro-batches, no_sync, clipping, checkpoints, reports) is the same for
every model; what differs lives here, behind one small interface:

- the model: `build_model(seed)` (the whole model, from the seed, on every rank) and
  `num_params`;
- the data: `load()` gives the train and validation splits and a fingerprint that every rank
  compares; `batch(split, indices, step)` stacks samples (and augments them, for images);
- the objective: `loss_fn(model)` gives loss(outputs, targets, reduction=...);
  `eval_sums(outputs, targets, loss_fn)` gives what evaluation adds up over ranks;
- the units a sample is counted in (tokens, images) and `prediction(...)`: what
  `plait estimate` can say of this model.

`LanguageTask` is plait's GPT on a byte corpus; `HFTask` (plait.train.hf_task) a Hugging
Face model from a local directory; `ImageTask` (plait.train.image_task) is a ResNet on
images. `plait.train.tasks.task_for(config)` picks one from `--model`. A language task also gives the text
codec and the sampler of the closing sample; any task may name files a checkpoint carries
beside its tensors (`attachments`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from plait.models.config import get_preset
from plait.models.gpt import build_gpt
from plait.parallel.tensor.plan import tp_loss_fn
from plait.train.config import TrainConfig
from plait.train.data import corpus_digest, load_corpus, train_val_split
from plait.train.tokens import TextCodec, text_codec


class Task(Protocol):
    """See the module docstring; `kind` is "lm" or "image"."""

    kind: str
    unit: str  # what throughput counts: "tokens" or "images"
    num_params: int

    def build_model(self, seed: int) -> nn.Module: ...
    def load(self) -> tuple[Any, Any, int]: ...
    def batch(self, split: Any, indices: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def loss_fn(self, model: nn.Module) -> Any: ...
    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any) -> list[float]: ...
    def units_per_sample(self) -> int: ...
    def prediction(self, **layout: Any) -> dict[str, Any]: ...
    def attachments(self) -> dict[str, Path]: ...


class LanguageTask:
    """Next-token prediction with plait's GPT on a byte corpus."""

    kind, unit = "lm", "tokens"

    def __init__(self, config: TrainConfig):
        self.config = config
        self.model_config = get_preset(config.model)
        self.num_params = self.model_config.num_params()

    def build_model(self, seed: int) -> nn.Module:
        return build_gpt(self.model_config, seed)

    def load(self) -> tuple[Any, Any, int]:
        tokens = load_corpus(self.config.data)
        return (*train_val_split(tokens, self.config.seq_len), corpus_digest(tokens))

    def batch(self, split: Any, indices: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return split.batch(indices)

    def loss_fn(self, model: nn.Module) -> Any:
        return tp_loss_fn(model)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any) -> list[float]:
        """[summed loss, tokens]."""
        return [loss_fn(outputs, targets, reduction="sum").item(), float(targets.numel())]

    def units_per_sample(self) -> int:
        return self.config.seq_len

    def prediction(self, **layout: Any) -> dict[str, Any]:
        from plait.estimate import estimate_layout

        return estimate_layout(self.model_config, seq_len=self.config.seq_len, **layout)

    def codec(self) -> TextCodec:
        """Text <-> ids for the prompt and the sample: bytes, or the prepared corpus's tokenizer."""
        return text_codec(self.config.data)

    def generate(self, model: nn.Module, prompt: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
        return model.generate(prompt, count, generator=generator)

    def attachments(self) -> dict[str, Path]:
        """Files a checkpoint carries beside the tensors (a Hugging Face model's config): none."""
        return {}
