"""The public entry points that need to know model families: above `parallel/` and `models/`.

`plait.parallelize` is `plait.parallel.compose.apply_layout` with the adapter of a model plait
did not build (plait.models.adapters: a transformers model split by the plans it declares,
or GPT-2 by its hand-written adapter), so a user passes their model as it is. A transformers
model's SwiGLU MLPs are given the forward that makes their gated product again for the down
projection's backward (plait.models.hf.gated), as plait's own builds of one are: the same
gradients, bit for bit, and 2f values a token a block less kept. Imports go downward only: this
module reads both packages, neither reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from plait.models.adapters import adapter_for, transformers_classes
from plait.models.hf.gated import remake_gated_products
from plait.parallel import compose
from plait.parallel.pipeline import runner
from plait.runtime.mesh import Mesh

__all__ = ["apply_pipeline", "parallelize"]


def parallelize(model: nn.Module, mesh: Mesh, config: compose.ParallelConfig | None = None,
                adapter: Any = None, source: Any = None) -> nn.Module:
    """Apply the configured strategies to `model`; return what this rank trains (the model,
    or with pp > 1 this rank's pipeline stages). A model on the meta device is filled from
    `source` (a tensor's name -> its values), this rank's part only. See
    plait.parallel.compose.apply_layout."""
    _as_plait_builds(model)
    return compose.apply_layout(model, mesh, config, adapter=adapter or adapter_for(model), source=source)


def apply_pipeline(model: nn.Module, mesh: Mesh, *, virtual_stages: int | None = None,
                   balance: Sequence[int] | None = None, adapter: Any = None) -> nn.ModuleList:
    """This rank's pipeline stages of `model`. See plait.parallel.pipeline.runner.apply_pipeline."""
    _as_plait_builds(model)
    return runner.apply_pipeline(model, mesh, virtual_stages=virtual_stages, balance=balance,
                                 adapter=adapter or adapter_for(model))


def _as_plait_builds(model: nn.Module) -> None:
    """A transformers `model`'s SwiGLU MLPs, changed in place as the layout changes the model,
    make their gated product again (plait.models.hf.gated), as in the model `--model hf:DIR`
    builds and the estimate reads: through parallelize they had kept it, 2f values a token a
    block more than that estimate. Any other model is left as it is."""
    if transformers_classes(model):
        remake_gated_products(model)
