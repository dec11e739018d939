"""Activation recomputation: trade a second forward of some layers for their saved activations.

* **full** (Megatron's "full", torch's `checkpoint`): keep each block's input, run the block
  again in backward. A block then holds its input only (b·s·h values for a transformer
  block; a sequence shard of it under SP) instead of everything its backward reads. Which
  modules are blocks is the model's adapter's answer (plait.parallel.seam), so any family
  with blocks recomputes the same way. A marked block's class becomes a small subclass
  whose forward wraps the original one in non-reentrant `torch.utils.checkpoint`, inside
  the block's own call, so that hooks on the block run once per forward: ZeRO-3 gathers a
  unit's weights before its backward anyway (`GatherForBackward`), and the recomputed
  forward reads them there. Tensor-parallel collectives inside the block run again in the
  recomputed forward: 2 more per block and micro-batch (plait estimate counts them); a
  SyncBatchNorm's all-reduce runs again too. The second forward must not count as a second
  batch: BatchNorm layers inside the block would update their running statistics twice, so
  their buffers are put back as they were once the recomputation ends.
* **selective** (Korthikanti et al. 2022): keep everything but the attention core, the
  softmax and its two score products, and rerun only that in backward. `SelectiveCore`
  runs the core inside non-reentrant `torch.utils.checkpoint`, which keeps q, k and v and
  nothing the core makes, and reruns the core in backward; gradients are bit-identical to
  no recomputation (the core draws no random numbers; CUDA's fp32 SDPA backward is itself
  bit-stable only under `torch.use_deterministic_algorithms`). Checkpoint,
  not a hand-written autograd Function, because torch.compile traces it as one higher-
  order op: a compiled block (`--compile`) stays one graph, where a Function whose
  backward calls `torch.autograd.grad` breaks it in two. A model offers its core as an
  `attention_core` attribute (plait's GPT does); this module wraps it. The core has no
  weights and no collectives, so every strategy composes with it unchanged. SDPA already
  recomputes the a·s² matrix itself, so what selective saves here is SDPA's output and
  log-sum-exp (plait estimate's numbers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from plait.errors import PlaitError
from plait.parallel.seam import ModelAdapter, adapter_of
from plait.rules import RECOMPUTE

POLICIES = RECOMPUTE  # one home: plait.rules
CORE_ATTR = "attention_core"
_SUBCLASSES: dict[type, type] = {}
STATS_ATTR = "plait_running_stats"  # whether a recomputing block holds BatchNorm statistics


class SelectiveCore:
    """A model's attention core that recomputes itself in backward (when grad is on).

    Forward: the core under checkpoint, which saves its inputs (q, k, v) only. Backward: the
    core again, differentiated. No RNG state is kept for the rerun (a copy of the generators'
    state per call, for nothing): the core must draw no random numbers, and SDPA without
    dropout draws none.
    """

    def __init__(self, core: Callable[..., torch.Tensor]):
        self.core = core

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return checkpoint(self.core, *inputs, use_reentrant=False, preserve_rng_state=False)
        return self.core(*inputs)


def apply_recompute(model: nn.Module, policy: str = "full", adapter: ModelAdapter | None = None) -> int:
    """Mark every block (full; the adapter says which) or wrap every attention core (selective)
    of `model`; returns how many."""
    if policy not in POLICIES:
        raise PlaitError(f"unknown --recompute {policy!r}", hint=f"choose one of: {', '.join(POLICIES)}")
    if policy == "selective":
        return _apply_selective(model)
    blocks = adapter_of(model, adapter).blocks(model)
    if policy == "full" and not blocks:
        raise PlaitError(f"{type(model).__name__} has no blocks that can recompute their activations",
                         hint="give it an adapter naming its blocks (plait.parallel.seam), or put them in "
                              "an nn.ModuleList")
    for block in blocks:
        if type(block) not in _SUBCLASSES.values():
            block.__class__ = _recomputing(type(block))
        block.recompute = policy == "full"
        setattr(block, STATS_ATTR, any(isinstance(m, _NormBase) for m in block.modules()))
    return len(blocks)


def _apply_selective(model: nn.Module) -> int:
    cores = [m for m in model.modules() if callable(getattr(m, CORE_ATTR, None))]
    if not cores:
        raise PlaitError(f"{type(model).__name__} offers no attention core to recompute",
                         hint=f"give its attention modules an {CORE_ATTR!r} callable, or use --recompute full")
    for module in cores:
        core = getattr(module, CORE_ATTR)
        if not isinstance(core, SelectiveCore):
            setattr(module, CORE_ATTR, SelectiveCore(core))
    return len(cores)


def _recomputing(cls: type) -> type:
    """`cls` with a forward that checkpoints itself while `self.recompute` is set."""
    if cls not in _SUBCLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.recompute and torch.is_grad_enabled():
                # Only a block with running statistics needs them put back (and torch.compile
                # traces checkpoint only without a context_fn: transformer blocks have none).
                keep = {"context_fn": lambda: (contextlib.nullcontext(), _keep_running_stats(self))} \
                    if getattr(self, STATS_ATTR, True) else {}
                return checkpoint(cls.forward, self, *args, use_reentrant=False, **keep, **kwargs)
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
