"""The gradient norm of the whole model, however it is split; and clipping by it.

One function for every layout, because the norm is one sum whichever strategies split it:
each rank adds the squares of the gradient it holds, then the partial sums are added over
the axes that split the gradient.

    what a rank holds                              summed over
    ZeRO: its shard of every (averaged) gradient   dp
    TP: its slice of each split parameter          tp (split parameters only: the
                                                   others are whole on every tp rank)
    PP: its stages                                 pp

Plain data parallelism holds the whole averaged gradient on every dp rank, so nothing is
summed over dp. A pipeline's copy of a tied embedding is left out (the first stage counts
that weight) but is scaled like the rest, so the copies stay equal. The sums are float64
and each all-reduce is one or two numbers: training traffic, in the ledger like the rest.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.parallel.pipeline.held import pipeline_axis
from plait.parallel.pipeline.split import logical_parameters
from plait.parallel.tensor.plan import tensor_parallel_of
from plait.parallel.tensor.layers import shard_of
from plait.parallel.zero.stages import zero_of
from plait.runtime import comm

Pieces = list[tuple[nn.Parameter, torch.Tensor]]


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Scale every gradient so the whole model's norm is at most `max_norm`; return the norm before.

    The scale is torch's, min(1, max_norm / (norm + 1e-6)); `max_norm = inf` only measures.
    """
    counted, scaled = _gradient_pieces(model)
    norm = global_norm(model, counted)
    if max_norm < math.inf:
        scale = min(1.0, max_norm / (norm + 1e-6))
        for grad in scaled:
            grad.mul_(scale)
    return norm


def global_norm(model: nn.Module, pieces: Pieces) -> float:
    """sqrt of the sum, over all ranks and without double counting, of the pieces' squares."""
    sync, info, pp_axis = zero_of(model), tensor_parallel_of(model), pipeline_axis(model)
    tp_axis = info.axis if info is not None and info.axis.size > 1 else None
    # A rank may hold no gradient (its ZeRO shards all padding); its zeros still join in.
    device = pieces[0][1].device if pieces else next(model.parameters()).device
    # [squares of tp-split gradients, squares of the rest]; one number when nothing is split.
    squares = torch.zeros(2 if tp_axis else 1, dtype=torch.float64, device=device)
    for param, grad in pieces:
        squares[0 if tp_axis and shard_of(param) else -1] += grad.detach().double().pow(2).sum()
    if sync is not None and sync.axis.size > 1:
        comm.all_reduce(squares, sync.axis)
    if tp_axis is not None:
        comm.all_reduce(squares[:1], tp_axis)
    if pp_axis is not None and pp_axis.size > 1:
        comm.all_reduce(squares, pp_axis)
    return math.sqrt(squares.sum().item())


def _gradient_pieces(model: nn.Module) -> tuple[Pieces, list[torch.Tensor]]:
    """The (parameter, gradient) pieces this rank counts in the norm, and every tensor to scale."""
    sync = zero_of(model)
    if sync is not None:
        pieces = sync.owned_grad_pieces()
        return [(p, g) for p, g in pieces if p not in sync.replicas], sync.owned_grads()
    held = [(param, replica) for _, param, replica in logical_parameters(model) if param.grad is not None]
    return [(p, p.grad) for p, replica in held if not replica], [p.grad for p, _ in held]
