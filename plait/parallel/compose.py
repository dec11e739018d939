"""`parallelize`: apply the strategies a `ParallelConfig` asks for, in one fixed order.

The order is the one every strategy assumes of the others: split the model into pipeline
stages (`apply_pipeline`, before this: the caller keeps this rank's stages), shard layers
across tensor-parallel ranks, then replicate or shard what is left across data-parallel
ranks: plain data parallelism (ZeRO stage 0) or ZeRO stages 1-3. Later strategies add
fields to `ParallelConfig` and a step here, keeping these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.data import apply_data_parallel, grad_sync
from plait.parallel.tensor import apply_tensor_parallel
from plait.parallel.tensor import clip_grad_norm_ as tensor_clip_grad_norm
from plait.parallel.zero import apply_zero, zero_of
from plait.parallel.zero import clip_grad_norm as zero_clip_grad_norm
from plait.parallel.zero_optim import ZeroOptimizer
from plait.runtime.mesh import Mesh

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ParallelConfig:
    """How to spread a model over the mesh (the degrees themselves live in the mesh)."""

    bucket_mb: float = 25.0  # size of a gradient bucket: one all-reduce (or reduce-scatter) per bucket
    zero: int = 0  # 0: replicate everything (DDP); 1: shard optimizer states; 2: + gradients; 3: + parameters
    offload: bool = False  # keep optimizer states, and run the optimizer step, in CPU memory
    sp: bool = False  # sequence parallelism in the tensor-parallel norm regions

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise PlaitError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.zero not in ZERO_STAGES:
            raise PlaitError(
                f"--zero must be 0, 1, 2 or 3, got {self.zero}",
                hint="0: plain data parallelism, 1: shard optimizer states, 2: also gradients, 3: also parameters")
        if self.offload and self.zero == 0:
            raise PlaitError("--offload needs a ZeRO stage: it moves the sharded optimizer to the CPU",
                             hint="add --zero 1 (or 2, 3)")


def parallelize(model: nn.Module, mesh: Mesh, config: ParallelConfig | None = None) -> nn.Module:
    """Move `model` to this rank's device and apply the configured strategies, in place."""
    config = config or ParallelConfig()
    model.to(mesh.device)
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh.axis("tp"), sp=config.sp)
    if config.zero == 0:
        apply_data_parallel(model, mesh.axis("dp"), bucket_mb=config.bucket_mb)
    else:
        apply_zero(model, mesh.axis("dp"), stage=config.zero, offload=config.offload, bucket_mb=config.bucket_mb)
    return model


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the gradient of the whole model, however it is split; return the norm before.

    Each strategy knows which part of the gradient this rank holds: ZeRO a shard of every
    gradient (one all-reduce over dp), tensor parallelism a slice of the split ones (one over
    tp). A pipeline clips through its runner, which sees all stages.
    """
    if zero_of(model) is not None:
        return zero_clip_grad_norm(model, max_norm)
    return float(tensor_clip_grad_norm(model, max_norm))


def build_optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                    **kwargs: Any) -> torch.optim.Optimizer:
    """Build `optimizer_class` over `model`'s parameters, the way the strategies need it.

    When `weight_decay` is given, one-dimensional parameters (norm scales, biases) are put in
    a group without decay, as is usual for transformers. With data parallelism, zero_grad
    clears the gradient buckets in place instead of dropping them, saving a copy per step.
    With ZeRO, the result is a `ZeroOptimizer`: the same groups, over this rank's shards.
    """
    sync = zero_of(model)
    params = sync.params if sync is not None else [p for p in model.parameters() if p.requires_grad]
    groups: Any = params
    if kwargs.get("weight_decay"):
        groups = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    if sync is not None:
        return ZeroOptimizer(sync, optimizer_class, groups if kwargs.get("weight_decay") else [{"params": params}],
                             **kwargs)
    optimizer = optimizer_class(groups, **kwargs)
    ddp = grad_sync(model)
    if ddp is not None:
        _zero_buckets_instead(optimizer, ddp)
    return optimizer


def _zero_buckets_instead(optimizer: torch.optim.Optimizer, sync: Any) -> None:
    """Replace zero_grad with one memset per bucket; .grad stays a view into its bucket."""

    def zero_grad(set_to_none: bool = True) -> None:  # noqa: ARG001 - same signature as torch
        sync.zero_grad()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
