"""What each rank holds, as pieces of logical tensors: the layout-free view a checkpoint writes.

A piece is a rectangular block of a logical tensor (by its unsharded name and full shape):
its offsets per dimension, and whether this rank is the one that writes it. Strategies
describe their shards here (ZeRO records its own view in the model's applied record);
plait.train.checkpoint.write writes and reads the pieces without knowing any layout. This lives
below both, so a strategy never imports the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.parallel.applied import applied_of
from plait.parallel.pipeline.split import is_pipeline, logical_parameters
from plait.parallel.placement import WHOLE_ON, placement_of
from plait.runtime.mesh import Mesh



@dataclass(frozen=True)
class Piece:
    """A block of logical tensor `name` (full shape `full_shape`) held by this rank."""

    name: str
    tensor: torch.Tensor  # the local block, same dims as the full tensor
    offsets: tuple[int, ...]
    full_shape: tuple[int, ...]
    owned: bool = True  # False: a replica; another rank writes it, this rank still loads it
    buffer: bool = False  # a persistent buffer (BatchNorm's running statistics), not a parameter


def local_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> list[Piece]:
    """The model's and optimizer's tensors as pieces (a strategy may override the view of the
    parameters), and the model's persistent buffers."""
    view = applied_of(model).pieces
    pieces = view(model, optimizer, mesh) if view is not None else param_pieces(model, optimizer, mesh)
    return pieces + buffer_pieces(model, mesh)


# The axes whose ranks hold the same buffers: every one but pp, whose stages hold their own.
BUFFER_REPLICAS = ("dp", "cp", "tp")


def buffer_pieces(model: nn.Module, mesh: Mesh) -> list[Piece]:
    """Each buffer a state_dict keeps (BatchNorm's running mean, variance and count), whole,
    written by the rank that is 0 on every axis but pp, loaded by all. No strategy splits a
    buffer, and the data ranks hold the same ones (SyncBN computes them alike; without it rank
    0's are broadcast, as torch DDP does), so that rank's are the run's."""
    owned = all(mesh.rank(axis) == 0 for axis in BUFFER_REPLICAS)
    return [Piece(f"model/{name}", buffer, (0,) * buffer.ndim, tuple(buffer.shape), owned, buffer=True)
            for name, buffer in logical_buffers(model)]


def logical_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(full-model name, buffer) of each persistent buffer this rank holds, named as
    `logical_parameters` names parameters (a pipeline stage's by the whole model's names)."""
    if not is_pipeline(model):
        return persistent_buffers(model)
    return [(stage.global_name(name), buffer) for stage in model for name, buffer in persistent_buffers(stage)]


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers `module.state_dict()` holds: not those registered with
    persistent=False (RoPE's tables, masks), which the model rebuilds."""
    return [(f"{prefix}.{name}" if prefix else name, buffer)
            for prefix, owner in module.named_modules()
            for name, buffer in owner.named_buffers(recurse=False)
            if name not in owner._non_persistent_buffers_set]


def param_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> list[Piece]:
    """Parameters and their optimizer state, each as the blocks its placement gives.

    Every tensor is written exactly once: of the ranks holding the same copy (its placement's
    replicate axis), by one (`dp_writers` spreads them); of an axis that splits it, by every
    rank (each its own block, at its offset); of tp keeping it whole, by tp rank 0 alone.
    """
    named = list(logical_parameters(model))
    placed = {name: placement_of(param) for name, param, _ in named}
    writers = replica_writers([(name, param.numel(), placed[name].replicate) for name, param, replica in named
                               if not replica], mesh)
    pieces = []
    for name, param, replica in named:
        over = placed[name].replicate
        dp_writer = writers.get(name) == mesh.rank(over)
        owned = dp_writer and not replica and writes_its_part(param, mesh)
        pieces += [Piece(f"model/{name}", view, offsets, full, owned)
                   for view, offsets, full in logical_blocks(param, param.detach())]
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == param.shape:
                pieces += [Piece(f"optim/{name}/{key}", view, offsets, full, owned)
                           for view, offsets, full in logical_blocks(param, value)]
            else:  # a per-parameter scalar (Adam's step): the same on every part
                owned_scalar = dp_writer and not replica and writes_scalars(param, mesh)
                pieces.append(Piece(f"optim/{name}/{key}", value, (0,) * value.ndim, tuple(value.shape), owned_scalar))
    return pieces


def replica_writers(sizes: list[tuple[str, int, str]], mesh: Mesh) -> dict[str, int]:
    """{parameter: the rank of its replicate axis that writes it}, from (name, elements,
    replicate axis): each axis's parameters spread over that axis's ranks (`dp_writers`), so
    the dp × cp ranks share the dense tensors and the edp ranks their experts."""
    writers: dict[str, int] = {}
    for over in dict.fromkeys(axis for _, _, axis in sizes):
        writers.update(dp_writers([(name, numel) for name, numel, axis in sizes if axis == over], mesh.size(over)))
    return writers


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


def writes_its_part(param: torch.Tensor, mesh: Mesh) -> bool:
    """Whether this rank writes its part of `param` (its copies aside): every rank of an axis
    that splits it writes its own; of an axis holding it whole (tp), rank 0 alone."""
    placement = placement_of(param)
    return all(mesh.rank(axis) == 0 for axis in WHOLE_ON if placement.split(axis) is None)


def writes_scalars(param: torch.Tensor, mesh: Mesh) -> bool:
    """Whether this rank writes `param`'s per-parameter scalars (Adam's step), the same on
    every part: rank 0 of every axis that splits it or holds it whole (its copies aside)."""
    return all(mesh.rank(axis) == 0 for axis in dict.fromkeys((*WHOLE_ON, *placement_of(param).axes)))


def logical_blocks(param: torch.Tensor, block: torch.Tensor, at: tuple[int, ...] | None = None
                   ) -> list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """Where `block`, a block of this rank's `param` at offsets `at` (default: the whole of
    it), sits in the logical tensor: (a view of it, its offsets there, the full shape) for
    each of its parts. One part, except for a fused split (GPT-2's q|k|v), whose parts lie
    apart in the full tensor (`Placement.blocks`)."""
    placement = placement_of(param)
    offsets = tuple(at) if at is not None else (0,) * param.ndim
    return [(_narrow(block, starts, lengths), where, placement.full_shape)
            for starts, lengths, where in placement.blocks(offsets, tuple(block.shape))]


def _narrow(block: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """`block` cut to `lengths` from `starts`, dimension by dimension (itself where whole)."""
    for dim, (start, length) in enumerate(zip(starts, lengths)):
        if (start, length) != (0, block.shape[dim]):
            block = block.narrow(dim, start, length)
    return block
