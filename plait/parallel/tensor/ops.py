"""Tensor parallelism's collectives: plain functions, and the same as torch custom ops.

The functions (`all_gather_sequence`, `reduce_scatter_sequence`, ...) call
`plait.runtime.comm`, so every byte is in the ledger; they have no autograd (regions.py
wraps them). The three that move data are also torch custom ops (`plait::tp_all_reduce`,
`plait::tp_all_gather_sequence`, `plait::tp_reduce_scatter_sequence`), each with a shape-only
fake: `torch.compile` (--compile) then keeps them as opaque nodes of a block's graph, where
a call into the ledger would otherwise break it. The axis travels as a name into `_AXES`,
since an op takes tensors and plain values only.
"""

from __future__ import annotations

import torch

from plait.errors import PlaitError
from plait.runtime import comm
from plait.runtime.comm import Axis

SEQ_DIM = 1


def check_sequence(length: int, axis: Axis) -> None:
    """Sequence parallelism splits the sequence evenly; say which numbers disagree if not."""
    if length % axis.size:
        raise PlaitError(
            f"sequence parallelism needs the sequence length divisible by tp: "
            f"{length} tokens over tp={axis.size} ranks",
            hint=f"use a sequence length that is a multiple of {axis.size}, or drop --sp",
        )


def all_gather_stacked(shard: torch.Tensor, axis: Axis, purpose: str = comm.TRAIN) -> torch.Tensor:
    """Every rank's `shard`, stacked: (t, *shard.shape); no autograd."""
    shard = shard.contiguous()
    stacked = shard.new_empty((axis.size, *shard.shape))
    # Gloo takes only the concatenated form of the output: (t·d0, d1, ...), the same memory.
    comm.all_gather(stacked.flatten(0, 1), shard, axis, purpose=purpose)
    return stacked


def all_gather_sequence(shard: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(batch, seq/t, ...) on each rank -> (batch, seq, ...) everywhere; no autograd."""
    full = all_gather_stacked(shard, axis).movedim(0, SEQ_DIM)  # (batch, t, seq/t, ...)
    return full.reshape(shard.shape[0], -1, *shard.shape[2:])


def reduce_scatter_sequence(full: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sum (batch, seq, ...) over ranks and keep this rank's (batch, seq/t, ...); no autograd."""
    check_sequence(full.shape[SEQ_DIM], axis)
    chunks = full.unflatten(SEQ_DIM, (axis.size, -1)).movedim(SEQ_DIM, 0).contiguous()
    shard = full.new_empty(chunks.shape[1:])
    comm.reduce_scatter(shard, chunks.flatten(0, 1), axis)
    return shard


def split_sequence(full: torch.Tensor, axis: Axis) -> torch.Tensor:
    """This rank's chunk of the sequence (a copy, so the full tensor can be freed)."""
    check_sequence(full.shape[SEQ_DIM], axis)
    return full.chunk(axis.size, dim=SEQ_DIM)[axis.rank].contiguous()


def _all_reduce(tensor: torch.Tensor, axis: Axis) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, axis)
    return out


# -- the collectives as custom ops: opaque to torch.compile ----------------------------------------
_AXES: dict[str, Axis] = {}


def register_axis(axis: Axis) -> str:
    """Make `axis` the one its name stands for in the ops (apply_tensor_parallel calls it);
    returns the name. The name is stable across processes and restarts, so that a compiled
    graph holding it is found in the compile cache. A rank is in one group per axis name and
    size at a time: the axis registered last under the name is the one the ops use."""
    name = _name(axis)
    _AXES[name] = axis
    return name


def _name(axis: Axis) -> str:
    return f"{axis.name}:{axis.size}"


def _key(axis: Axis) -> str:
    # Eager calls keep the registry on the axis in use; a compiled graph must not write it
    # (a side effect inside an autograd Function breaks the graph): TP registered it already.
    return _name(axis) if torch.compiler.is_compiling() else register_axis(axis)


@torch.library.custom_op("plait::tp_all_reduce", mutates_args=())
def _all_reduce_op(tensor: torch.Tensor, axis: str) -> torch.Tensor:
    return _all_reduce(tensor, _AXES[axis])


@_all_reduce_op.register_fake
def _(tensor: torch.Tensor, axis: str) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@torch.library.custom_op("plait::tp_all_gather_sequence", mutates_args=())
def _all_gather_sequence_op(shard: torch.Tensor, axis: str) -> torch.Tensor:
    return all_gather_sequence(shard, _AXES[axis])


@_all_gather_sequence_op.register_fake
def _(shard: torch.Tensor, axis: str) -> torch.Tensor:
    return shard.new_empty((shard.shape[0], shard.shape[SEQ_DIM] * _AXES[axis].size, *shard.shape[2:]))


@torch.library.custom_op("plait::tp_reduce_scatter_sequence", mutates_args=())
def _reduce_scatter_sequence_op(full: torch.Tensor, axis: str) -> torch.Tensor:
    return reduce_scatter_sequence(full, _AXES[axis])


@_reduce_scatter_sequence_op.register_fake
def _(full: torch.Tensor, axis: str) -> torch.Tensor:
    return full.new_empty((full.shape[0], full.shape[SEQ_DIM] // _AXES[axis].size, *full.shape[2:]))


def all_reduce_copy(tensor: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The sum over the axis, in a new tensor; no autograd."""
    return _all_reduce_op(tensor, _key(axis))


def gather_sequence(shard: torch.Tensor, axis: Axis) -> torch.Tensor:
    """`all_gather_sequence`, through its custom op."""
    return _all_gather_sequence_op(shard, _key(axis))


def scatter_sum_sequence(full: torch.Tensor, axis: Axis) -> torch.Tensor:
    """`reduce_scatter_sequence`, through its custom op."""
    return _reduce_scatter_sequence_op(full, _key(axis))
