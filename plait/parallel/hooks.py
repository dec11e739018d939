"""What a strategy or a model adds to each training step, without the loop knowing which.

The executor (plait.parallel.executor) runs every applied strategy's hooks around a step:
context parallelism keeps this cp rank's tokens of each batch and switches its attention on
for forward and backward; a mixture of experts scales its balancing loss as the main loss
is scaled, counts its routing into the step's record, and sums it up for the run. A hook
overrides only what it needs: every method here does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class StepHooks:
    """One strategy's (or model's) part in each step; the defaults leave the step as it is."""

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch as this rank runs it."""
        return inputs, targets

    def begin_step(self, loss_scale: float, micro_batches: int) -> None:
        """Before the step's first forward: the main loss is scaled by loss_scale / micro_batches."""

    @contextlib.contextmanager
    def engaged(self) -> Iterator[None]:
        """Around the step's forwards and backwards (recomputation included)."""
        yield

    def end_step(self, step_comm: dict[str, Any]) -> dict[str, Any]:
        """After the optimizer step: entries for the step's record (`step_comm`: its bytes by axis)."""
        return {}

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Entries for the run's summary, from every step's record."""
        return {}
