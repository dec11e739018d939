"""`parallelize`: apply the strategies a `ParallelConfig` asks for, in one fixed order.

The order is the one every strategy assumes of the others: split the model into pipeline
stages, shard layers across tensor-parallel ranks, then replicate or shard what is left
across data-parallel ranks. Today the data-parallel step is the only one; later strategies
add fields to `ParallelConfig` and a step here, keeping these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.data import apply_data_parallel, grad_sync
from plait.runtime.mesh import Mesh


@dataclass(frozen=True)
class ParallelConfig:
    """How to spread a model over the mesh (the degrees themselves live in the mesh)."""

    bucket_mb: float = 25.0  # size of a gradient bucket: one all-reduce per bucket

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise PlaitError(f"--bucket-mb must be positive, got {self.bucket_mb}")


def parallelize(model: nn.Module, mesh: Mesh, config: ParallelConfig | None = None) -> nn.Module:
    """Move `model` to this rank's device and apply the configured strategies, in place."""
    config = config or ParallelConfig()
    model.to(mesh.device)
    apply_data_parallel(model, mesh.axis("dp"), bucket_mb=config.bucket_mb)
    return model


def build_optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                    **kwargs: Any) -> torch.optim.Optimizer:
    """Build `optimizer_class` over `model`'s parameters, the way the strategies need it.

    When `weight_decay` is given, one-dimensional parameters (norm scales, biases) are put in
    a group without decay, as is usual for transformers. With data parallelism, zero_grad
    clears the gradient buckets in place instead of dropping them, saving a copy per step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups: Any = params
    if kwargs.get("weight_decay"):
        groups = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    optimizer = optimizer_class(groups, **kwargs)
    sync = grad_sync(model)
    if sync is not None:
        _zero_buckets_instead(optimizer, sync)
    return optimizer


def _zero_buckets_instead(optimizer: torch.optim.Optimizer, sync: Any) -> None:
    """Replace zero_grad with one memset per bucket; .grad stays a view into its bucket."""

    def zero_grad(set_to_none: bool = True) -> None:  # noqa: ARG001 - same signature as torch
        sync.zero_grad()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
