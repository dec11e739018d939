"""What the transformers adapters (plans.py, gpt2.py) share: hooks and a check; no
transformers import."""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.errors import PlaitError
from plait.rules import divisors
from plait.parallel.tensor import regions
from plait.runtime.comm import Axis


def hidden_in(change: Any) -> Any:
    """A forward pre-hook applying `change` to a layer's hidden states, by position or keyword
    (transformers' decoder layers take them either way)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if args:
            return (change(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}

    return hook


def map_hidden(out: Any, change: Any) -> Any:
    """`change` applied to a layer's output hidden states (alone, or first of a tuple)."""
    return (change(out[0]), *out[1:]) if isinstance(out, tuple) else change(out)


def split_sequence_around(blocks: list[nn.Module], axis: Axis) -> None:
    """Sequence parallelism around a run of blocks: the first keeps this rank's slice of its
    input, the last gathers its output again, so the model's own code around them
    (positions, masks, the final norm, the head) sees the whole sequence."""
    blocks[0].register_forward_pre_hook(hidden_in(lambda x: regions.scatter_to_sequence(x, axis)),
                                        with_kwargs=True)
    blocks[-1].register_forward_hook(lambda module, args, out: map_hidden(
        out, lambda x: regions.gather_to_replicated(x, axis)))


def check_splits(model: nn.Module, tp: int, sizes: list[tuple[str, int]]) -> None:
    """One error naming the first config value tp does not divide (heads, MLP width...)."""
    for what, size in sizes:
        if size % tp:
            raise PlaitError(f"{type(model).__name__}: {what} = {size} is not divisible by tp={tp}",
                             hint=f"choose tp among {divisors(size)}")
