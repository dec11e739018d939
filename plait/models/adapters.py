"""Which adapter (plait.parallel.seam) serves a model plait did not build.

plait's own models declare theirs on the class (`plait_adapter`), which the strategies read
directly. A model from transformers cannot, so the top-level `plait.parallelize`
(plait/api.py) asks here and passes the adapter down; `plait.parallel` never imports this
package:

- a transformers model that declares a tensor- or pipeline-parallel plan (`tp_plan`,
  `pp_plan`: every Llama-like causal LM of transformers 5) gets `DeclaredPlanAdapter`, which
  answers from those declarations alone (plait/models/hf/plans.py);
- GPT-2, which declares nothing, gets its hand-written adapter (plait/models/hf/gpt2.py);
- one that declares nothing but is laid out as its siblings that do (an embedding, one list
  of layers, a final norm, a head) gets `DeclaredPlanAdapter` too: its cut and its tp plan
  are inferred (plait/models/hf/stages.py, plait/models/hf/inferred.py), then probed;
- anything else gets None: the generic answers (data parallelism and ZeRO for any module).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

HAND_WRITTEN = {"GPT2LMHeadModel": "plait.models.hf.gpt2:GPT2Adapter"}  # transformers class -> adapter


def transformers_classes(model: nn.Module) -> list[type]:
    """The classes of `model`'s type that transformers defines, most derived first: none for a
    model transformers did not build."""
    return [cls for cls in type(model).__mro__ if cls.__module__.startswith("transformers.")]


def adapter_for(model: nn.Module) -> Any | None:
    """The adapter of a transformers `model` (see the module docstring), or None."""
    classes = transformers_classes(model)
    if not classes:
        return None
    from plait.models.hf.plans import DeclaredPlanAdapter, declares_plans, laid_out_as_declared

    if declares_plans(model):
        return DeclaredPlanAdapter()
    for cls in classes:
        if cls.__name__ in HAND_WRITTEN:
            module, name = HAND_WRITTEN[cls.__name__].split(":")
            return getattr(importlib.import_module(module), name)()
    return DeclaredPlanAdapter() if laid_out_as_declared(model) else None
