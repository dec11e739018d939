"""Activation recomputation: keep each transformer block's input, run the block again in backward.

Full recomputation (Megatron's "full", torch's `checkpoint`) trades one more forward of every
block for its saved activations: a block then holds b·s·h values (its input; a sequence
shard of it under SP) instead of everything its backward reads. Non-reentrant
`torch.utils.checkpoint` does the work; the block marks where (`Block.recompute` in
plait.models.gpt), inside its own call, so that hooks on the block run once per forward:
ZeRO-3 gathers a unit's weights before its backward anyway (`GatherForBackward`), and the
recomputed forward reads them there. Tensor-parallel collectives inside the block run again
in the recomputed forward: 2 more per block and micro-batch (plait estimate counts them).

The selective policy of Korthikanti et al. (recompute only the attention core) buys little
for this model: SDPA already recomputes the attention matrix. It is not implemented; the
estimator's formulas for it wait until it is added to `plait.rules.RECOMPUTE`.
"""

from __future__ import annotations

from torch import nn

from plait.errors import PlaitError
from plait.rules import RECOMPUTE

POLICIES = RECOMPUTE  # one home: plait.rules


def apply_recompute(model: nn.Module, policy: str = "full") -> int:
    """Mark every block of `model` that supports it; returns how many were marked."""
    if policy not in POLICIES:
        raise PlaitError(f"unknown --recompute {policy!r}", hint=f"choose one of: {', '.join(POLICIES)}")
    blocks = [m for m in model.modules() if hasattr(m, "recompute") and isinstance(m.recompute, bool)]
    if policy == "full" and not blocks:
        raise PlaitError(f"{type(model).__name__} has no blocks that can recompute their activations",
                         hint="plait's GPT blocks can; wrap other layers in torch.utils.checkpoint yourself")
    for block in blocks:
        block.recompute = policy == "full"
    return len(blocks)
