"""Activation recomputation: trade a second forward of some layers for their saved activations.

* **full** (Megatron's "full", torch's `checkpoint`): keep each transformer block's input,
  run the block again in backward. A block then holds b·s·h values (its input; a sequence
  shard of it under SP) instead of everything its backward reads. Non-reentrant
  `torch.utils.checkpoint` does the work; the block marks where (`Block.recompute` in
  plait.models.gpt), inside its own call, so that hooks on the block run once per forward:
  ZeRO-3 gathers a unit's weights before its backward anyway (`GatherForBackward`), and the
  recomputed forward reads them there. Tensor-parallel collectives inside the block run
  again in the recomputed forward: 2 more per block and micro-batch (plait estimate counts
  them).
* **selective** (Korthikanti et al. 2022): keep everything but the attention core, the
  softmax and its two score products, and rerun only that in backward. `RecomputeCore`
  saves q, k and v and nothing the core makes; its backward reruns the core and
  differentiates it, so gradients are bit-identical to no recomputation (the core is
  deterministic). A model offers its core as an `attention_core` attribute (plait's GPT
  does); this module wraps it. The core has no weights and no collectives, so every
  strategy composes with it unchanged. SDPA already recomputes the a·s² matrix itself, so
  what selective saves here is SDPA's output and log-sum-exp (plait estimate's numbers).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from plait.errors import PlaitError
from plait.rules import RECOMPUTE

POLICIES = RECOMPUTE  # one home: plait.rules
CORE_ATTR = "attention_core"


class RecomputeCore(torch.autograd.Function):
    """Forward: the core's output, saving only its inputs. Backward: the core again, differentiated."""

    @staticmethod
    def forward(ctx: Any, core: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.core = core
        ctx.save_for_backward(*inputs)
        return core(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.core(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, *(next(grads) if t.requires_grad else None for t in inputs))


class SelectiveCore:
    """A model's attention core that recomputes itself in backward (when grad is on)."""

    def __init__(self, core: Callable[..., torch.Tensor]):
        self.core = core

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return RecomputeCore.apply(self.core, *inputs)
        return self.core(*inputs)


def apply_recompute(model: nn.Module, policy: str = "full") -> int:
    """Mark every block (full) or wrap every attention core (selective) of `model`; returns how many."""
    if policy not in POLICIES:
        raise PlaitError(f"unknown --recompute {policy!r}", hint=f"choose one of: {', '.join(POLICIES)}")
    if policy == "selective":
        return _apply_selective(model)
    blocks = [m for m in model.modules() if hasattr(m, "recompute") and isinstance(m.recompute, bool)]
    if policy == "full" and not blocks:
        raise PlaitError(f"{type(model).__name__} has no blocks that can recompute their activations",
                         hint="plait's GPT blocks can; wrap other layers in torch.utils.checkpoint yourself")
    for block in blocks:
        block.recompute = policy == "full"
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
