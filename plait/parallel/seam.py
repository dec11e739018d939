"""The model seam: what a strategy may ask of a model, without knowing which model it is.

Strategies live in `plait/parallel/` and import nothing from `plait/models/`. A model
family answers their questions through a small adapter kept beside the model (plait's GPT:
`plait.models.gpt.GPTAdapter`; ResNets: `plait.models.resnet.ResNetAdapter`). The adapter
is found on the model class as `plait_adapter`, or passed to `parallelize` by a caller that
knows better (a wrapper for someone else's model). A model without one gets
`GenericAdapter`, which answers from the module tree alone, so any `nn.Module` keeps data
parallelism and ZeRO.

What is asked today, and by whom:
- `blocks(model)`: the repeated blocks, in forward order. ZeRO-3 gathers and frees one
  block at a time (its units); recomputation reruns a block in backward.

The protocol is structural: an adapter needs no import of this module to satisfy it. It
grows by one method per question a strategy learns to ask instead of naming a model: the
tensor-parallel plan in the model's own module names, tied weights, the embedding and head
for the pipeline cut (today still plait's GPT in tensor.py and pipeline_split.py). What a
sample is, the loss and the metrics are the training task's (plait.train.task), not the
strategies'.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from plait.parallel.zero.shard import find_units


@runtime_checkable
class ModelAdapter(Protocol):
    """What one model family tells the strategies (see the module docstring)."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks of `model`, in the order its forward runs them."""
        ...


class GenericAdapter:
    """For a model plait knows nothing about: the children of its module lists and
    Sequentials are its blocks."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return find_units(model)


def adapter_of(model: nn.Module, adapter: ModelAdapter | None = None) -> ModelAdapter:
    """`adapter` when given, else the one the model's class declares, else the generic one."""
    if adapter is not None:
        return adapter
    declared = getattr(type(model), "plait_adapter", None)
    return declared if declared is not None else GenericAdapter()
