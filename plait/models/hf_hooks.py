"""What the transformers adapters (hf_llama.py, hf_gpt2.py) share: hooks and a check; no
transformers import."""

from __future__ import annotations

from typing import Any

import torch
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


def gather_logits(local: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(batch, seq, V/tp) logits of a vocabulary-split head -> (batch, seq, V) on every rank.

    Differentiable: backward keeps this rank's slice of the gradient, which is exact because
    every rank computes the same loss from the same whole logits."""
    return regions.gather_to_replicated(local.transpose(1, 2), axis).transpose(1, 2).contiguous()


def check_splits(model: nn.Module, tp: int, sizes: list[tuple[str, int]]) -> None:
    """One error naming the first config value tp does not divide (heads, MLP width...)."""
    for what, size in sizes:
        if size % tp:
            raise PlaitError(f"{type(model).__name__}: {what} = {size} is not divisible by tp={tp}",
                             hint=f"choose tp among {divisors(size)}")
