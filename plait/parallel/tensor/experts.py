"""A mixture of experts' experts module split by tensor parallelism ("experts" style).

An experts module holds every expert's weights as 3-D parameters (transformers 5: gate|up
(E, 2·d, h) and down (E, h, d); Llama 4: (E, h, 2·d) and (E, d, h)). The plan's parameter
styles cut each expert's hidden units d alike on every tp rank ("param_column:2" for the
packed gate|up, "param_row" for down, or the transposed pair), so each rank runs every
expert on every token it is given, over d / tp of the units: a column layer and a row
layer per expert. The module then needs what a region needs around such a pair:

- its floating-point inputs (the tokens, and the routing weights where the experts scale
  their outputs by them) enter the region: the identity forward, their gradients summed
  over tp in backward, since each rank's units give part of them;
- its output, each rank's partial sum over its units, leaves the region: summed over tp.

Inside a region marked around it (the MoE block of a model under sequence parallelism, which
gathers the whole sequence on entering) the inputs have entered already, and only the output
is summed. An experts module on a sequence slice, outside any region, is refused: its tokens
would have to be gathered along a layout each family chooses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.tensor import regions
from plait.runtime.comm import Axis


def split_experts(module: nn.Module, name: str, axis: Axis, *, enters: bool, sp: bool) -> None:
    """Hooks around `module`'s own forward (its weights are cut by their parameter styles)."""
    if sp and enters:
        raise PlaitError(f"sequence parallelism: {name} ({type(module).__name__}) would run its split experts "
                         "on a slice of the sequence, outside any region",
                         hint="drop --sp, or mark the MoE block holding it \"region\" (docs/tensor.md)")
    if enters:
        module.register_forward_pre_hook(lambda m, args, kwargs: _enter(args, kwargs, axis), with_kwargs=True)
    module.register_forward_hook(lambda m, args, out: _leave(m, name, out, axis))


def _enter(args: tuple, kwargs: dict, axis: Axis) -> tuple[tuple, dict]:
    return (tuple(_entered(value, axis) for value in args),
            {key: _entered(value, axis) for key, value in kwargs.items()})


def _entered(value: Any, axis: Axis) -> Any:
    """A floating-point tensor enters the region; indices and anything else pass as they are."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return regions.copy_to_region(value, axis)
    return value


def _leave(module: nn.Module, name: str, out: Any, axis: Axis) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise PlaitError(f"{name} ({type(module).__name__}) returns {type(out).__name__}, not one tensor, so "
                         "plait cannot sum its split experts' outputs", hint="leave its entries out of the tp plan")
    return regions.reduce_from_region(out, axis)
