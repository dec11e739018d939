"""How one parameter is placed over the mesh: the one record every consumer reads.

A strategy that splits a parameter marks it with a `Placement` (`place`): tensor
parallelism's layers (tensor/slices.py), expert parallelism (expert/shard.py). Every other
parameter is whole on every rank and replicated over the data axis. Gradient sync, ZeRO's
flat groups, the gradient norm and checkpoint pieces read this record and nothing else, as
torchtitan's FSDP, clipping and checkpointing all read a DTensor's placements: a new way to
split a parameter is one new rule where a strategy marks it, not an edit in each consumer.

    field        says                                      read by
    splits       the mesh axes that cut it: along which    the norm (its squares summed over
                 dimension, this rank's part of how many   them), checkpoints (offsets, writers)
    full_shape   the logical tensor                        checkpoints
    replicate    the ranks holding identical copies,       gradient sync and ZeRO (the axis that
                 whose gradients are averaged              averages or shards it), checkpoints
                                                           (the writers spread over it)

Imports only the mesh's axis names, so every strategy and consumer may read it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from plait.errors import PlaitError
from plait.runtime.mesh import EXPERT, EXPERT_SYNC, SYNC

ATTR = "plait_placement"
# Axes whose ranks hold a parameter whole unless they split it, without averaging its
# gradient (tensor parallelism's ranks compute the same gradient of what they share): rank 0
# of each writes what it holds whole. The data axes' copies are a placement's `replicate`.
WHOLE_ON = ("tp",)
# Axes carved out of the data axis (plait.runtime.mesh: ep × edp = dp): a sum over every data
# rank, as ZeRO's gradient norm makes, already runs over them.
INSIDE_DATA = frozenset({EXPERT, EXPERT_SYNC})

Cut = tuple[int, int, int]  # (start within a local range, its length, its offset in the full tensor)


@dataclass(frozen=True)
class Split:
    """Mesh axis `axis` cuts the parameter along `dim` into `parts`; this rank holds part `rank`.

    `fused` > 1: along `dim` the full tensor is that many equal parts (GPT-2's q|k|v), each
    cut alike, and this rank holds its slice of every part, concatenated: `fused` blocks of
    the full tensor, not one.
    """

    axis: str
    dim: int
    rank: int
    parts: int
    fused: int = 1

    def cuts(self, full: int, lo: int, hi: int) -> list[Cut]:
        """This rank's elements [lo, hi) along `dim` (of `full` there) as runs of the full
        tensor: one run, except where a fused slice's parts meet (they lie apart in it)."""
        chunk = full // (self.fused * self.parts)
        out = []
        for part in range(lo // chunk, -(-hi // chunk)):
            start, stop = max(lo, part * chunk), min(hi, (part + 1) * chunk)
            out.append((start - lo, stop - start, (part * self.parts + self.rank) * chunk + start - part * chunk))
        return out

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full` along `dim` (a copy): slice `rank` of each fused part."""
        parts = full.unflatten(self.dim, (self.fused, self.parts, -1))
        return parts.select(self.dim + 1, self.rank).flatten(self.dim, self.dim + 1).clone()

    def join(self, stacked: torch.Tensor) -> torch.Tensor:
        """The tensor whole along `dim` from every rank's part, stacked on a new first dimension."""
        parts = stacked.unflatten(self.dim + 1, (self.fused, -1))  # (parts, ..., fused, chunk, ...)
        return parts.movedim(0, self.dim + 1).flatten(self.dim, self.dim + 2).contiguous()


@dataclass(frozen=True)
class Placement:
    """Where one parameter's elements live: `splits` cut it (at most one per axis and per
    dimension), `full_shape` is the logical tensor, `replicate` names the ranks that hold the
    same part and average its gradient (the data axis `SYNC`, or `EXPERT_SYNC` for experts)."""

    full_shape: tuple[int, ...]
    splits: tuple[Split, ...] = ()
    replicate: str = SYNC

    def __post_init__(self) -> None:
        axes, dims = [s.axis for s in self.splits], [s.dim for s in self.splits]
        if len(set(axes)) < len(axes) or len(set(dims)) < len(dims):
            raise PlaitError(f"a placement cuts a parameter twice along one axis or dimension: {self.splits}",
                             hint="one split per mesh axis and per tensor dimension")
        if any(not 0 <= d < len(self.full_shape) for d in dims):
            raise PlaitError(f"a split dimension is outside the shape {self.full_shape}: {self.splits}")

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes that split it, in the order they were applied."""
        return tuple(s.axis for s in self.splits)

    def split(self, axis: str) -> Split | None:
        """How `axis` cuts it, or None when every rank of `axis` holds it whole."""
        return next((s for s in self.splits if s.axis == axis), None)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the part this rank holds."""
        shape = list(self.full_shape)
        for s in self.splits:
            shape[s.dim] //= s.parts
        return tuple(shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where the one block this rank holds starts in the full tensor (unfused splits only)."""
        fused = [s for s in self.splits if s.fused > 1]
        if fused:
            raise PlaitError(f"a fused split parameter {self.full_shape} is {fused[0].fused} blocks per rank, "
                             "not one contiguous block", hint="place it with Placement.blocks")
        return self.blocks((0,) * len(self.full_shape), self.local_shape)[0][2]

    def blocks(self, offsets: tuple[int, ...], lengths: tuple[int, ...]
               ) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """A block of this rank's part (at `offsets`, of `lengths`) as blocks of the full
        tensor: (where each starts within the block, its lengths, its offsets in the full
        tensor), per dimension. One block, except where a fused split's parts meet."""
        by_dim = {s.dim: s for s in self.splits}
        per_dim = [by_dim[d].cuts(self.full_shape[d], o, o + n) if d in by_dim else [(0, n, o)]
                   for d, (o, n) in enumerate(zip(offsets, lengths))]
        return [tuple(zip(*runs)) for runs in itertools.product(*per_dim)] if per_dim else [((), (), ())]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (a copy)."""
        for s in self.splits:
            full = s.take(full)
        return full

    def join(self, stacked: torch.Tensor, axis: str | None = None) -> torch.Tensor:
        """The tensor whole along `axis`'s dimension (default: its one split) from every rank of
        `axis`'s part, stacked on a new first dimension in rank order."""
        if axis is None and len(self.splits) != 1:
            raise PlaitError(f"join names no axis, and {len(self.splits)} axes split this parameter")
        split = self.splits[0] if axis is None else self.split(axis)
        if split is None:
            raise PlaitError(f"axis {axis} does not split this parameter")
        return split.join(stacked)


def placement_of(param: torch.Tensor) -> Placement:
    """The placement a strategy marked `param` with; unmarked: whole, replicated over the data axis."""
    marked = getattr(param, ATTR, None)
    return marked if marked is not None else Placement(tuple(param.shape))


def place(param: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Mark `param`, this rank's part, with its placement (what a strategy that splits calls)."""
    if tuple(param.shape) != placement.local_shape:
        raise PlaitError(f"a parameter of shape {tuple(param.shape)} cannot be the part "
                         f"{placement.local_shape} its placement {placement} describes")
    setattr(param, ATTR, placement)
    return param
