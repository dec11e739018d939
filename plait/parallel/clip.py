"""The gradient norm of the whole model, however it is split; and clipping by it.

One function for every layout, because the norm is one sum whichever strategies split it:
each rank adds the squares of the gradient it holds, then the partial sums are added over
the axes that split the gradient. Which axes those are, each parameter's placement says
(plait/parallel/placement.py): an axis that splits it sums its squares; an axis that
replicates it holds the same averaged gradient on each rank, and is not summed over (that
would count it again), unless ZeRO cuts it there.

    what a rank holds                              summed over
    ZeRO: its shard of every (averaged) gradient   dp (the axis ZeRO cuts each gradient over)
    a split: its part of each parameter split      each axis that splits it (tp: its slice
             over an axis                          of a split layer; ep: its experts; not
                                                   under ZeRO, see below)
    PP: its stages                                 pp

Plain data parallelism holds the whole averaged gradient on every dp rank, so nothing is
summed over dp. Under ZeRO an expert's gradient is cut over the edp ranks holding that
expert, and the ep ranks hold the other experts: the ranks of dp (edp × ep of them) own
every expert's gradient once between them, so the sum over dp covers an axis carved out of
dp (`placement.INSIDE_DATA`) too.

A pipeline's copy of a tied embedding is left out (the first stage counts that weight) but
is scaled like the rest, so the copies stay equal. The sums are float64
and each all-reduce is one or two numbers: training traffic, in the ledger like the rest.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from plait.parallel.expert.plan import expert_axis
from plait.parallel.pipeline.held import pipeline_axis
from plait.parallel.pipeline.split import logical_parameters
from plait.parallel.placement import INSIDE_DATA, placement_of
from plait.parallel.tensor.plan import tensor_parallel_of
from plait.parallel.zero.stages import zero_of
from plait.runtime import comm
from plait.runtime.comm import Axis


@dataclass
class GradientSquares:
    """Each gradient piece this rank holds, squared and summed in fp64: one read of every
    gradient per step, shared by the step guard's finite check (a piece's sum is finite only
    if every element is: squares of 16- or 32-bit values cannot overflow fp64) and the
    clipping norm. `piece_norms` accumulates in fp64 as it reads, without the fp64 copy and
    the squared copy of each gradient that `g.double().pow(2).sum()` makes: on a CPU those
    fresh buffers cost page faults, 3-4x the time of the read itself."""

    names: list[str]  # in the model's order, as `named_grads` gives them
    values: torch.Tensor  # (pieces,) float64
    counted: torch.Tensor  # (pieces,) bool: in the norm (a pipeline's tied copy is not)
    splits: dict[str, torch.Tensor]  # {axis: (pieces,) bool}: the pieces it splits (its other ranks hold the rest)
    scaled: list[torch.Tensor]  # what clipping multiplies


def held_gradients(model: nn.Module) -> list[tuple[str, nn.Parameter, torch.Tensor, bool]]:
    """(name, parameter, gradient, counted in the norm) of each gradient piece this rank
    holds, in the model's order: ZeRO's owned pieces, or every parameter's .grad."""
    sync = zero_of(model)
    if sync is not None:
        return [(sync.names[p], p, g, p not in sync.replicas) for p, g in sync.owned_grad_pieces()]
    return [(name, p, p.grad, not replica) for name, p, replica in logical_parameters(model) if p.grad is not None]


def gradient_squares(model: nn.Module) -> GradientSquares:
    """Sum of squares of each gradient piece this rank holds (see `GradientSquares`)."""
    sync = zero_of(model)
    held = held_gradients(model)
    scaled = sync.owned_grads() if sync is not None else [grad for _, _, grad, _ in held]
    device = held[0][2].device if held else next(model.parameters()).device
    norms = piece_norms([grad.detach() for _, _, grad, _ in held])
    values = torch.stack(norms).square() if norms else torch.zeros(0, dtype=torch.float64, device=device)
    names, counted, splits = _piece_facts(model, held, device)
    return GradientSquares(names, values, counted, splits, scaled)


_FACTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # gone with its model


def _piece_facts(model: nn.Module, held: list[tuple[str, nn.Parameter, torch.Tensor, bool]],
                 device: torch.device) -> tuple[list[str], torch.Tensor, dict[str, torch.Tensor]]:
    """(names, counted, splits) of the held pieces: the same every step while the same
    parameters hold gradients, so made once and kept (by the model, checked against the
    parameters' identities) rather than rebuilt and copied to the device at every clip."""
    key = tuple(id(param) for _, param, _, _ in held)  # unique while the model holds them
    kept = _FACTS.get(model)
    if kept is not None and kept[0] == key and kept[1][1].device == device:
        return kept[1]
    counted = torch.tensor([c for *_, c in held], dtype=torch.bool, device=device)
    axes = split_axes(model)
    placements = [placement_of(p) for _, p, _, _ in held] if axes else []
    splits = {axis: torch.tensor([p.split(axis) is not None for p in placements], dtype=torch.bool, device=device)
              for axis in axes}
    facts = ([name for name, *_ in held], counted, splits)
    _FACTS[model] = (key, facts)
    return facts


def split_axes(model: nn.Module) -> dict[str, Axis]:
    """{name: axis} of the axes the model's strategies split parameters over (a placement
    names them), those of more than one rank: tensor parallelism's, expert parallelism's."""
    info = tensor_parallel_of(model)
    found = [info.axis if info is not None else None, expert_axis(model)]
    return {axis.name: axis for axis in found if axis is not None and axis.size > 1}


def piece_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm in fp64, one multi-tensor launch per dtype on a GPU (a 1 B model
    has ~150 gradient pieces: one reduction each cost more launches than reading). The fp64
    result keeps the check exact (a norm is finite only if every element is) and the norm
    the same whichever way a layout cuts the pieces; on a CPU torch runs it per tensor."""
    norms: list[torch.Tensor | None] = [None] * len(grads)
    by_dtype: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, grad in enumerate(grads):
        by_dtype.setdefault((grad.device, grad.dtype), []).append(i)
    for indices in by_dtype.values():
        for i, norm in zip(indices, torch._foreach_norm([grads[i] for i in indices], 2, dtype=torch.float64)):
            norms[i] = norm
    return norms  # type: ignore[return-value]


def clip_grad_norm(model: nn.Module, max_norm: float, squares: GradientSquares | None = None) -> float:
    """Scale every gradient so the whole model's norm is at most `max_norm`; return the norm before.

    The scale is torch's, min(1, max_norm / (norm + 1e-6)); `max_norm = inf` only measures.
    `squares`: this step's, when the caller has them already (the step guard does).
    """
    squares = squares if squares is not None else gradient_squares(model)
    norm = global_norm(model, squares)
    if max_norm < math.inf:
        scale = min(1.0, max_norm / (norm + 1e-6))
        for grad in squares.scaled:
            grad.mul_(scale)
    return norm


def global_norm(model: nn.Module, squares: GradientSquares) -> float:
    """sqrt of the sum, over all ranks and without double counting, of the pieces' squares."""
    sync, pp_axis, axes = zero_of(model), pipeline_axis(model), split_axes(model)
    kept = torch.where(squares.counted, squares.values, torch.zeros_like(squares.values))
    # A rank may hold no gradient (its ZeRO shards all padding); its zeros still join in.
    kept, early = _inside_data(squares, kept, axes, zero=sync is not None)
    # [squares split over each axis outside dp (tp), the rest]; one number when none splits.
    outside = [name for name in axes if name not in INSIDE_DATA]
    total = _partial_sums(kept, [squares.splits[name] for name in outside])
    total[-1] += early
    if sync is not None and sync.axis.size > 1:
        comm.all_reduce(total, sync.axis)
    for i, name in enumerate(outside):
        comm.all_reduce(total[i:i + 1], axes[name])
    if pp_axis is not None and pp_axis.size > 1:
        comm.all_reduce(total, pp_axis)
    return math.sqrt(total.sum().item())


def _partial_sums(kept: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """The squares of the pieces each mask marks, then of the pieces none marks."""
    if not masks:
        return kept.sum().reshape(1)
    if len(masks) > 1 and bool((torch.stack(masks).sum(0) > 1).any()):
        raise NotImplementedError("a gradient split over two axes outside dp needs a sum over both")
    rest = ~torch.stack(masks).any(0)
    return torch.stack([*(kept[mask].sum() for mask in masks), kept[rest].sum()])


def _inside_data(squares: GradientSquares, kept: torch.Tensor, axes: dict[str, Axis],
                 zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the squares left to sum as before, those split over an axis carved out of dp, summed
    over it already).

    Data parallelism holds every expert of its ep rank whole, the other ep ranks the other
    experts: their squares are summed over ep (experts are whole on every tp rank: tp is not
    built with them). Under ZeRO the sum over dp covers them (module docstring): nothing moves.
    """
    early = torch.zeros((), dtype=kept.dtype, device=kept.device)
    if zero:
        return kept, early
    for name in [name for name in axes if name in INSIDE_DATA]:
        mask = squares.splits[name]
        part = kept[mask].sum()
        comm.all_reduce(part, axes[name])
        kept, early = torch.where(mask, torch.zeros_like(kept), kept), early + part
    return kept, early
