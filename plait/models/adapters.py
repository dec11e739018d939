"""Which adapter (plait.parallel.seam) serves a model plait did not build: picked by class.

plait's own models declare theirs on the class (`plait_adapter`), which the strategies read
directly. A model from transformers cannot, so the top-level `plait.parallelize`
(plait/api.py) looks its class up here and passes the adapter down; `plait.parallel` never
imports this package. The table names classes and modules as strings: nothing is imported,
transformers included, until a model of that family is in hand.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# transformers class name -> "module:adapter class" (one adapter per family of one layout)
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "plait.models.hf_llama:LlamaAdapter",
    "MistralForCausalLM": "plait.models.hf_llama:LlamaAdapter",
    "Qwen2ForCausalLM": "plait.models.hf_llama:LlamaAdapter",
    "GPT2LMHeadModel": "plait.models.hf_gpt2:GPT2Adapter",
}


def adapter_for(model: nn.Module) -> Any | None:
    """The adapter of `model`'s family (its class or a base class in FAMILIES), or None."""
    for cls in type(model).__mro__:
        where = FAMILIES.get(cls.__name__)
        if where is not None and cls.__module__.startswith("transformers."):
            module, name = where.split(":")
            return getattr(importlib.import_module(module), name)()
    return None
