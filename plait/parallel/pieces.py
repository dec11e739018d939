"""What each rank holds, as pieces of logical tensors: the layout-free view a checkpoint writes.

A piece is a rectangular block of a logical tensor (by its unsharded name and full shape):
its offsets per dimension, and whether this rank is the one that writes it. Strategies
describe their shards here (ZeRO installs its own view on the model under VIEW_ATTR);
plait.train.checkpoint writes and reads the pieces without knowing any layout. This lives
below both, so a strategy never imports the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.parallel.expert.shard import expert_shard_of
from plait.parallel.pipeline.split import logical_parameters
from plait.parallel.tensor.layers import shard_of
from plait.runtime.mesh import EXPERT, EXPERT_SYNC, SYNC, Mesh

VIEW_ATTR = "_plait_checkpoint_view"  # a strategy that shards tensors (ZeRO) puts its own view here


@dataclass(frozen=True)
class Piece:
    """A block of logical tensor `name` (full shape `full_shape`) held by this rank."""

    name: str
    tensor: torch.Tensor  # the local block, same dims as the full tensor
    offsets: tuple[int, ...]
    full_shape: tuple[int, ...]
    owned: bool = True  # False: a replica; another rank writes it, this rank still loads it


def local_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> list[Piece]:
    """The model's and optimizer's tensors as pieces; a strategy may override the view."""
    view = getattr(model, VIEW_ATTR, None)
    if view is not None:
        return view(model, optimizer, mesh)
    return param_pieces(model, optimizer, mesh)


def param_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> list[Piece]:
    """Parameters and their optimizer state, whole or as tensor-parallel blocks.

    Every tensor is written exactly once: replicas across dp by one dp rank (`dp_writers`
    spreads them); a tensor that tensor parallelism does not split, also only by tp rank 0;
    a split one by every tp rank (each its own block, at its offset along the split dimension).
    """
    named = list(logical_parameters(model))
    # The replicas' writers are spread over every rank that holds the same ones: dp × cp;
    # for an expert-parallel block, the edp ranks (each ep rank writes its own experts).
    sync, edp = mesh.axis(SYNC), mesh.axis(EXPERT_SYNC)
    writers = dp_writers([(name, param.numel()) for name, param, replica in named
                          if not replica and expert_shard_of(param) is None], sync.size)
    expert_writers = dp_writers([(name, param.numel()) for name, param, _ in named
                                 if expert_shard_of(param) is not None], edp.size)
    pieces = []
    for name, param, replica in named:
        if expert_shard_of(param) is not None:
            dp_writer = expert_writers[name] == edp.rank
        else:
            dp_writer = writers.get(name) == sync.rank
        owned = dp_writer and not replica and writes_its_tp_part(param, mesh)
        pieces += [Piece(f"model/{name}", view, offsets, full, owned)
                   for view, offsets, full in placement(param, param.detach())]
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == param.shape:
                pieces += [Piece(f"optim/{name}/{key}", view, offsets, full, owned)
                           for view, offsets, full in placement(param, value)]
            else:  # a per-parameter scalar (Adam's step): the same on every shard
                owned_scalar = dp_writer and not replica and mesh.rank("tp") == 0 and (
                    expert_shard_of(param) is None or mesh.rank(EXPERT) == 0)
                pieces.append(Piece(f"optim/{name}/{key}", value, (0,) * value.ndim, tuple(value.shape), owned_scalar))
    return pieces


def dp_writers(sizes: list[tuple[str, int]], dp: int) -> dict[str, int]:
    """{parameter: the dp rank that writes it and its optimizer state}: the largest first,
    each to the rank with the fewest elements so far. Every dp rank holds the same replicas,
    so each computes the same answer alone; the ranks then write (and, saving in the
    background, copy and hash) a dp-th of the state each, not all of it on one rank."""
    load, writers = [0] * dp, {}
    for name, numel in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = load.index(min(load))
        writers[name], load[rank] = rank, load[rank] + numel
    return writers


def writes_its_tp_part(param: torch.Tensor, mesh: Mesh) -> bool:
    """Whether this rank writes its tensor-parallel part of `param`: every tp rank its own
    slice of a split parameter, tp rank 0 alone a parameter tensor parallelism keeps whole."""
    return shard_of(param) is not None or mesh.rank("tp") == 0


def placement(param: torch.Tensor, block: torch.Tensor, at: tuple[int, ...] | None = None
              ) -> list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """Where `block`, a block of this rank's `param` at offsets `at` (default: the whole of
    it), sits in the logical tensor: (a view of it, its offsets there, the full shape) for
    each of its parts. One part, except for a fused tensor-parallel slice (GPT-2's q|k|v),
    whose parts lie apart in the full tensor (`Shard.blocks`)."""
    offsets = tuple(at) if at is not None else (0,) * param.ndim
    experts = expert_shard_of(param)
    if experts is not None:  # this ep rank's experts: a block along the first dimension
        return [(block, (offsets[0] + experts.offset, *offsets[1:]), experts.full_shape)]
    shard = shard_of(param)
    if shard is None:
        return [(block, offsets, tuple(param.shape))]
    return [(block.narrow(shard.dim, start, length), where, shard.full_shape)
            for start, length, where in shard.blocks(offsets, tuple(block.shape))]
