"""What the transformers adapters (plans.py, gpt2.py) share: hooks and a check; no
transformers import."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.packed import forward_parameters
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


# What a block is handed whole by the sequence, beside its hidden states, and reads whole
# under SP (its attention, gathered, reads the whole sequence's mask and angles).
READ_WHOLE = ("attention_mask", "position_embeddings", "position_ids")


def split_sequence_around(blocks: list[nn.Module], axis: Axis) -> None:
    """Sequence parallelism around a run of blocks: the first keeps this rank's slice of its
    input, the last gathers its output again, so the model's own code around them
    (positions, masks, the final norm, the head) sees the whole sequence. Each block also
    gets this rank's slice of what else it is handed along the whole sequence (Gemma 4's
    per-layer inputs, DeepSeek-V4's token ids for its hash router), as its hidden states."""
    blocks[0].register_forward_pre_hook(hidden_in(lambda x: regions.scatter_to_sequence(x, axis)),
                                        with_kwargs=True)
    for block in blocks:  # after the first block's own split: its hidden states are a slice then
        block.register_forward_pre_hook(lambda module, args, kwargs: _slice_the_rest(module, args, kwargs, axis),
                                        with_kwargs=True)
    blocks[-1].register_forward_hook(lambda module, args, out: map_hidden(
        out, lambda x: regions.gather_to_replicated(x, axis)))


def _slice_the_rest(module: nn.Module, args: tuple, kwargs: dict, axis: Axis) -> tuple[tuple, dict]:
    """A block's inputs other than its hidden states (and READ_WHOLE) that hold the whole
    sequence, (batch, seq, ...), cut to this rank's slice (their gradient gathered back)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 3:
        return args, kwargs
    whole = (hidden.shape[0], hidden.shape[1] * axis.size)

    def sliced(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == whole:
            return regions.scatter_to_sequence(value, axis)
        return value

    names = forward_parameters(type(module))[1:]  # RecurrentGemma hands its positions by position
    rest = tuple(value if i == 0 or (i < len(names) and names[i] in READ_WHOLE) else sliced(value)
                 for i, value in enumerate(args))
    return rest, {key: value if key == "hidden_states" or key in READ_WHOLE else sliced(value)
                  for key, value in kwargs.items()}


def check_splits(model: nn.Module, tp: int, sizes: list[tuple[str, int]]) -> None:
    """One error naming the first config value tp does not divide (heads, MLP width...)."""
    for what, size in sizes:
        if size % tp:
            raise PlaitError(f"{type(model).__name__}: {what} = {size} is not divisible by tp={tp}",
                             hint=f"choose tp among {divisors(size)}")
