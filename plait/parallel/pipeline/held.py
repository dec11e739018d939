"""The stages a rank holds carry their pp axis, so that code below the runner (the gradient
norm, the loss) can tell a pipeline's stages from a whole model without importing it."""

from __future__ import annotations

from torch import nn

from plait.runtime.comm import Axis

PIPELINE_ATTR = "_plait_pipeline"


def pipeline_axis(module: nn.Module) -> Axis | None:
    """The pp axis of a module that `apply_pipeline` returned (None for a whole model)."""
    return getattr(module, PIPELINE_ATTR, None)
