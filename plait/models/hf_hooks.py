"""Hooks shared by the transformers adapters (hf_llama.py, hf_gpt2.py); no transformers import."""

from __future__ import annotations

from typing import Any

from torch import nn


def hidden_in(change: Any) -> Any:
    """A forward pre-hook applying `change` to a layer's hidden states, by position or keyword
    (transformers' decoder layers take them either way)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if args:
            return (change(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}

    return hook
