"""What `parallelize` applied to a model (or to this rank's pipeline stages): one record.

Each strategy writes its part here when it is applied, and every consumer reads it: the
loss and the vocabulary gather read the tensor-parallel part, the step hooks the context and
expert parts, the gradient norm the pp axis and ZeRO, the optimizer and `no_sync` what
syncs the gradients, checkpoints the pieces' view. The pipeline cut hands the same record to the
stage list it returns (all its fields at once, with the pp axis), so nothing is copied
field by field and nothing is forgotten. Imports
nothing of the strategies': each field holds that strategy's own object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from plait.errors import PlaitError
from plait.runtime.comm import Axis

ATTR = "_plait_applied"


@dataclass
class Applied:
    """One model's (or stage list's) applied strategies; None where a strategy was not applied."""

    tensor: Any = None  # plait.parallel.tensor.plan.TensorParallel
    context: Any = None  # plait.parallel.context.plan.ContextParallel
    experts: Axis | None = None  # the ep axis the experts modules are split over
    pipeline: Axis | None = None  # the pp axis of a stage list (None: a whole model)
    grad_sync: Any = None  # what syncs the gradients: data/sync.GradSync (ZeRO 0) or zero/stages.ZeroSync (1-3)
    pieces: Callable[..., Any] | None = None  # a strategy's own checkpoint view (ZeRO's), else the placements'


def applied(module: nn.Module) -> Applied:
    """The record of `module`, made empty on first use (a strategy about to write its part)."""
    record = module.__dict__.get(ATTR)
    if record is None:
        record = Applied()
        module.__dict__[ATTR] = record  # not a submodule, not a buffer: plain state
    return record


def applied_of(module: nn.Module) -> Applied:
    """The record of `module` to read: an empty one (nothing applied) if no strategy wrote any."""
    if not isinstance(module, nn.Module):  # e.g. code written for loss_fn(model) given the executor
        raise PlaitError(f"what parallelize applied is recorded on the model, and this is a {type(module).__name__}",
                         hint="a task's loss_fn(executor) gets the executor: its token_loss is the next-token loss "
                              "under any layout (plait.parallel.executor)")
    return module.__dict__.get(ATTR) or Applied()


def hand_over(source: nn.Module, target: nn.Module, pipeline: Axis) -> Applied:
    """`target`, the stage list cut from `source` over `pipeline`, gets `source`'s record with
    its pp axis: every field at once (nothing is copied by hand, nothing forgotten), in a record
    of its own, so that what is applied to the stages later does not mark the whole model."""
    record = replace(applied(source), pipeline=pipeline)
    target.__dict__[ATTR] = record
    return record
