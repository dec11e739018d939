"""The stages a rank holds carry their pp axis in their applied record, so that code below
the runner (the gradient norm, the loss) can tell a pipeline's stages from a whole model
without importing it."""

from __future__ import annotations

from torch import nn

from plait.parallel.applied import applied_of
from plait.runtime.comm import Axis


def pipeline_axis(module: nn.Module) -> Axis | None:
    """The pp axis of a module that `apply_pipeline` returned (None for a whole model)."""
    return applied_of(module).pipeline
