"""Where this rank's slice of a tensor-parallel parameter sits in the full tensor.

A split layer (layers.py) keeps only its slice of the dense weight; the slice carries a
`Shard` saying where it came from, so the full tensor can be gathered back for parity
checks, the gradient norm and checkpoints (plait/parallel/pieces.py), whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.errors import PlaitError
from plait.runtime.comm import Axis

SHARD_ATTR = "plait_tp_shard"


@dataclass(frozen=True)
class Shard:
    """Where this rank's slice of a parameter sits in the full tensor.

    `fused` > 1: along `dim` the full tensor is that many equal parts (q|k|v), and this rank
    holds slice `rank` of each part, concatenated: k blocks of the full tensor, not one.
    """

    dim: int
    rank: int
    parts: int
    full_shape: tuple[int, ...]
    fused: int = 1

    @property
    def offset(self) -> int:
        """Where the one block this rank holds starts along `dim` (unfused shards only)."""
        if self.fused > 1:
            raise PlaitError(f"a fused tensor-parallel parameter {self.full_shape} is {self.fused} blocks "
                             "per rank, not one contiguous block", hint="place it with Shard.blocks")
        return self.rank * self.full_shape[self.dim] // self.parts

    def blocks(self, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> list[tuple[int, int, tuple[int, ...]]]:
        """A block of this rank's slice (at `offsets`, of `lengths`) as blocks of the full tensor.

        Each is (where it starts within the block along `dim`, its length there, its offsets
        in the full tensor): one block when unfused; a fused slice's block is cut where the
        parts meet, since consecutive local parts lie apart in the full tensor.
        """
        chunk = self.full_shape[self.dim] // (self.fused * self.parts)
        lo, hi = offsets[self.dim], offsets[self.dim] + lengths[self.dim]
        out = []
        for part in range(lo // chunk, -(-hi // chunk)):
            start, stop = max(lo, part * chunk), min(hi, (part + 1) * chunk)
            where = list(offsets)
            where[self.dim] = (part * self.parts + self.rank) * chunk + start - part * chunk
            out.append((start - lo, stop - start, tuple(where)))
        return out

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `full` (a copy): slice `rank` of each of the `fused` parts."""
        parts = full.unflatten(self.dim, (self.fused, self.parts, -1))
        return parts.select(self.dim + 1, self.rank).flatten(self.dim, self.dim + 1).clone()

    def join(self, stacked: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's slice, stacked on a new first dimension (t, ...)."""
        parts = stacked.unflatten(self.dim + 1, (self.fused, -1))  # (t, ..., fused, chunk, ...)
        return parts.movedim(0, self.dim + 1).flatten(self.dim, self.dim + 2).contiguous()


def shard_of(param: torch.Tensor) -> Shard | None:
    """The `Shard` of a tensor-parallel parameter, or None for a replicated one."""
    return getattr(param, SHARD_ATTR, None)


def shard_param(param: nn.Parameter, dim: int, axis: Axis, memo: dict[int, nn.Parameter],
                fused: int = 1) -> nn.Parameter:
    """This rank's slice of `param` along `dim`, made once per parameter (tied weights stay tied)."""
    if id(param) in memo:
        shard = memo[id(param)]
        if (shard_of(shard).dim, shard_of(shard).fused) != (dim, fused):
            raise ValueError("a tied parameter is split along two different dimensions")
        return shard
    where = Shard(dim, axis.rank, axis.size, tuple(param.shape), fused)
    shard = nn.Parameter(where.take(param.detach()), requires_grad=param.requires_grad)
    setattr(shard, SHARD_ATTR, where)
    memo[id(param)] = shard
    return shard
