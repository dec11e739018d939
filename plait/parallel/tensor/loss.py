"""Cross-entropy over vocabulary-sharded logits, without ever building the full logits.

With a vocab-parallel output head each rank holds logits for V/t tokens. The loss
log Σ_v exp(z_v) − z_target needs only three numbers per token from the other ranks: the
max (for a stable exp), the sum of exps, and the target's logit (which lives on one rank).
So the ranks exchange 3 floats per token instead of V/t·(t−1) logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from plait.parallel.packed import IGNORE
from plait.runtime import comm
from plait.runtime.comm import Axis
from plait.parallel.tensor.ops import all_gather_stacked


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from (tokens, V/t) logit shards.

    forward: all-reduce(max) of each token's largest logit, then one all-reduce(sum) of
    [Σ exp, target logit]; saves this rank's softmax slice (tokens × V/t).
    backward: softmax − one-hot(target) on this rank's slice, times the incoming gradient;
    no communication, since each rank owns the gradient of its own logits.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, axis: Axis) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        peak = logits.detach().max(dim=-1).values
        comm.all_reduce(peak, axis, op="max")
        exp = (logits - peak.unsqueeze(-1)).exp_()  # the max cancels out of the loss
        local = targets - axis.rank * local_vocab
        mine = (local >= 0) & (local < local_vocab)
        local = local.masked_fill(~mine, 0)
        target_logit = (logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - peak).masked_fill(~mine, 0.0)
        stats = torch.stack((exp.sum(-1), target_logit))
        comm.all_reduce(stats, axis)
        sum_exp, target_logit = stats[0], stats[1]
        exp.div_(sum_exp.unsqueeze(-1))  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, local, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, axis: Axis,
                                 reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy for logits (tokens, V/t) sharded over `axis` by vocabulary rows.

    `targets` holds global token ids (tokens,), IGNORE (-100) where a token carries no loss.
    `reduction` is "mean" (over the loss-carrying tokens), "sum" or "none", as in torch. With one
    rank on the axis this is exactly F.cross_entropy.
    """
    if axis.size == 1:
        return torch.nn.functional.cross_entropy(local_logits, targets, reduction=reduction)
    carries = targets != IGNORE  # as torch's ignore_index: no loss, no gradient
    losses = _VocabParallelCrossEntropy.apply(local_logits, targets.masked_fill(~carries, 0), axis)
    losses = losses.masked_fill(~carries, 0.0)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / carries.sum()


def gather_vocab(local_logits: torch.Tensor, axis: Axis, purpose: str = "eval") -> torch.Tensor:
    """The whole vocabulary's logits on every rank, from (..., V/t) shards; no autograd.

    Only for sampling, where the next token needs every probability; training never calls it.
    """
    if axis.size == 1:
        return local_logits
    stacked = all_gather_stacked(local_logits.movedim(-1, 0), axis, purpose)
    return stacked.flatten(0, 1).movedim(0, -1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, *, axis: Axis | None = None,
            reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of (batch, seq, V or V/tp) logits against (batch, seq) ids."""
    flat, ids = logits.flatten(0, -2).float(), targets.flatten()
    if axis is None or axis.size == 1:
        return F.cross_entropy(flat, ids, reduction=reduction)
    return vocab_parallel_cross_entropy(flat, ids, axis, reduction)
