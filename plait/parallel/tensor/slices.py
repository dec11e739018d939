"""Tensor parallelism's placement rule: where this rank's slice of a split parameter sits.

A split layer (layers.py) keeps only its slice of the dense weight and marks it with its
placement (plait/parallel/placement.py): split over the tp axis along one dimension, fused
parts (q|k|v) cut alike, replicated over the data axis. The full tensor can then be gathered
back for parity checks, and the gradient norm and checkpoints place it, whatever the split.
"""

from __future__ import annotations

from torch import nn

from plait.parallel.placement import Placement, Split, place, placement_of
from plait.runtime.comm import Axis


def tensor_placement(axis: str, dim: int, rank: int, parts: int, full_shape: tuple[int, ...],
                     fused: int = 1) -> Placement:
    """The rule: cut over `axis` along `dim` (each of `fused` equal parts alike), replicated
    over the data axis like any dense parameter."""
    return Placement(tuple(full_shape), (Split(axis, dim, rank, parts, fused),))


def shard_of(param: nn.Parameter) -> Placement | None:
    """The placement of a tensor-parallel slice (split over "tp"), or None for a parameter
    tensor parallelism keeps whole: a reader of the placement, for the callers that gather."""
    placement = placement_of(param)
    return placement if placement.split("tp") is not None else None


def shard_param(param: nn.Parameter, dim: int, axis: Axis, memo: dict[int, nn.Parameter],
                fused: int = 1) -> nn.Parameter:
    """This rank's slice of `param` along `dim`, made once per parameter (tied weights stay tied)."""
    if id(param) in memo:
        shard = memo[id(param)]
        split = placement_of(shard).split(axis.name)
        if (split.dim, split.fused) != (dim, fused):
            raise ValueError("a tied parameter is split along two different dimensions")
        return shard
    where = tensor_placement(axis.name, dim, axis.rank, axis.size, tuple(param.shape), fused)
    shard = nn.Parameter(where.take(param.detach()), requires_grad=param.requires_grad)
    memo[id(param)] = place(shard, where)
    return shard
