"""Activation recomputation: keep each block's input, run the block again in backward.

Full recomputation (Megatron's "full", torch's `checkpoint`) trades one more forward of every
block for its saved activations: a block then holds its input only (b·s·h values for a
transformer block; a sequence shard of it under SP) instead of everything its backward
reads. Which modules are blocks is the model's adapter's answer (plait.parallel.seam), so
any family with blocks recomputes the same way.

A marked block's class becomes a small subclass whose forward wraps the original one in
non-reentrant `torch.utils.checkpoint`, inside the block's own call, so that hooks on the
block run once per forward: ZeRO-3 gathers a unit's weights before its backward anyway
(`GatherForBackward`), and the recomputed forward reads them there. Tensor-parallel
collectives inside the block run again in the recomputed forward: 2 more per block and
micro-batch (plait estimate counts them); a SyncBatchNorm's all-reduce runs again too.

The second forward must not count as a second batch: BatchNorm layers inside the block
would update their running statistics twice. Their buffers are put back as they were once
the recomputation ends.

The selective policy of the estimate (recompute only the attention core) buys nothing for
plait's GPT: SDPA already recomputes the attention matrix, so it is not offered for training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from plait.errors import PlaitError
from plait.parallel.seam import ModelAdapter, adapter_of

POLICIES = ("none", "full")
_SUBCLASSES: dict[type, type] = {}


def apply_recompute(model: nn.Module, policy: str = "full", adapter: ModelAdapter | None = None) -> int:
    """Mark every block of `model` (its adapter says which) to recompute or not; returns how many."""
    if policy not in POLICIES:
        raise PlaitError(f"unknown --recompute {policy!r}", hint=f"choose one of: {', '.join(POLICIES)}")
    blocks = adapter_of(model, adapter).blocks(model)
    if policy == "full" and not blocks:
        raise PlaitError(f"{type(model).__name__} has no blocks that can recompute their activations",
                         hint="give it an adapter naming its blocks (plait.parallel.seam), or put them in "
                              "an nn.ModuleList")
    for block in blocks:
        if type(block) not in _SUBCLASSES.values():
            block.__class__ = _recomputing(type(block))
        block.recompute = policy == "full"
    return len(blocks)


def _recomputing(cls: type) -> type:
    """`cls` with a forward that checkpoints itself while `self.recompute` is set."""
    if cls not in _SUBCLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.recompute and torch.is_grad_enabled():
                return checkpoint(cls.forward, self, *args, use_reentrant=False,
                                  context_fn=lambda: (contextlib.nullcontext(), _keep_running_stats(self)),
                                  **kwargs)
            return cls.forward(self, *args, **kwargs)

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    return _SUBCLASSES[cls]


@contextlib.contextmanager
def _keep_running_stats(block: nn.Module) -> Iterator[None]:
    """Around the recomputed forward: the norms' running statistics end as they began."""
    saved = [(b, b.clone()) for m in block.modules() if isinstance(m, _NormBase) for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
