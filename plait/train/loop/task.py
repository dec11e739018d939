"""A training task: everything the loop needs to know about a model family and its data.

The trainer's loop (micro-batches, no_sync, the step guard, checkpoints, metrics) is the
same for every model; what differs lives behind this one interface, and neither the trainer
nor the report ever asks which task it has:

- the model: `build_model(seed)` (the whole model, from the seed, on every rank),
  `adapter(model)` (what the strategies ask of it: plait.parallel.seam; None lets
  `plait.parallelize` find it) and `num_params`;
- the data: `load()` gives the train and validation splits and a fingerprint every rank
  compares; `batch(split, indices, step)` stacks samples (and augments them, for images);
- the objective: `loss_fn(executor)` gives loss(outputs, targets, reduction=...) (the executor,
  plait.parallel.executor, offers the next-token loss under any layout: `token_loss`);
- evaluation: `eval_count(val)` held-out samples, `eval_sums(outputs, targets, loss_fn)`
  one row of `eval_columns` per sample (the evaluator adds the rows of every rank, whatever
  the layout), `eval_metrics(totals)` the metrics it reports (`metric_labels` names them
  for the report);
- what throughput counts (`unit`, `units_per_sample`), how a batch reads (`batch_text`),
  a closing `sample(next_logits)` (a language task's text; "" for others), the prediction
  `plait estimate` makes of it, the files a checkpoint carries (`attachments`), and the decoder
  shape and sequence length the machine's calibration times GEMMs at (`calibration_shape`; None:
  the smallest preset's, e.g. for a CNN, which reads only the machine's bandwidths and fixed costs);
- optionally, `explain_failure(exc)`: a first step's failure as the input's fault (a PlaitError
  naming it), or None; the trainer asks only a task that has it, and only then.

`LanguageTask` (plait.families.gpt.task) is plait's GPT on a corpus; `HFTask`
(plait.families.hf.task) a Hugging Face model; `ImageTask` (plait.families.resnet.task) a ResNet. Which one trains `--model` is its
family's record (plait.families).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from plait.estimate.layout import Workload

NextLogits = Callable[[torch.Tensor, int], torch.Tensor]  # (ids (1, t), V) -> whole-vocabulary logits (1, V) after them


class Task(Protocol):
    """See the module docstring."""

    unit: str  # what throughput counts: "tokens", "images"...
    num_params: int
    model_config: Any  # the family's shape of the model
    eval_columns: tuple[str, ...]  # what evaluation sums per sample
    metric_labels: dict[str, tuple[str, str]]  # {metric: (what reports call it, format spec)}, "val_loss" first

    def build_model(self, seed: int) -> nn.Module: ...
    def adapter(self, model: nn.Module) -> Any: ...
    def load(self) -> tuple[Any, Any, int]: ...
    def batch(self, split: Any, indices: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def loss_fn(self, executor: Any) -> Any: ...
    def units_per_sample(self) -> int: ...
    def batch_text(self, global_batch: int) -> str: ...
    def eval_count(self, val: Any) -> int: ...
    def eval_sums(self, outputs: Any, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor: ...
    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]: ...
    def sample(self, next_logits: NextLogits, device: torch.device) -> str: ...
    def prediction(self, work: Workload, hardware: Any) -> dict[str, Any]: ...
    def attachments(self) -> dict[str, Path]: ...
    def calibration_shape(self) -> tuple[Any, int] | None: ...
