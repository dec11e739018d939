"""Autograd-aware region ops: the only places tensor parallelism talks to other ranks.

A tensor-parallel *region* is the stretch of a layer where each rank holds a slice of the
hidden units (attention heads, MLP columns, vocabulary rows). Activations enter a region
replicated and leave it as partial sums, so each boundary is a collective in one direction
of autograd and none (or its dual) in the other (Megatron-LM's f and g operators):

| op                         | forward                 | backward               |
|----------------------------|-------------------------|------------------------|
| copy_to_region             | identity                | all-reduce             |
| reduce_from_region         | all-reduce              | identity               |
| gather_from_sequence       | all-gather along seq    | reduce-scatter along seq |
| reduce_scatter_to_sequence | reduce-scatter along seq| all-gather along seq   |
| scatter_to_sequence        | keep own seq chunk      | all-gather along seq   |
| gather_to_replicated       | all-gather along seq    | keep own seq chunk     |
| gather_features            | all-gather last dim     | keep own slice         |
| split_features             | keep own last-dim slice | all-gather last dim    |

With sequence parallelism the ops outside the regions (norms, residual adds) work on a
slice of the sequence, so the first two ops become the last three: an all-reduce is a
reduce-scatter followed by an all-gather, and SP simply stops between the two halves.

Layout: activations stay (batch, seq, hidden...) everywhere; sequence-parallel shards split
dim 1. `comm.all_gather`/`comm.reduce_scatter` work on dim 0, so around each collective the
sequence chunks are laid out rank-major, (tp, batch, seq/tp, hidden): one copy when
batch > 1, none when batch == 1.

Every op calls `plait.runtime.comm`, so every byte is in the ledger.

The collectives themselves, and their custom-op form for torch.compile, are in ops.py.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.parallel.tensor.ops import (SEQ_DIM, all_gather_sequence, all_reduce_copy, gather_sequence,
                                       scatter_sum_sequence, split_sequence)
from plait.runtime.comm import Axis

class _CopyToRegion(torch.autograd.Function):
    """Enter a TP region with a replicated input.

    forward: identity (every rank already holds the whole input).
    backward: all-reduce, since each rank's slice of the layer contributes part of dL/dx.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_copy(grad, ctx.axis), None


class _ReduceFromRegion(torch.autograd.Function):
    """Leave a TP region by summing the ranks' partial outputs.

    forward: all-reduce of the partial sums (a row-parallel matmul's output).
    backward: identity, since the sum's gradient is the same for every term.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        return all_reduce_copy(x, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """Enter a TP region from a sequence-parallel one.

    forward: all-gather the sequence chunks; with `keep_shard` the chunk is saved so that the
    column-parallel linears reading the output can rebuild it in backward instead of saving
    the full tensor (see `regathered`).
    backward: reduce-scatter, summing each rank's partial dL/dx and keeping this rank's chunk.
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, axis: Axis, keep_shard: bool) -> torch.Tensor:
        ctx.axis, ctx.full, ctx.keep_shard = axis, None, keep_shard
        if keep_shard:
            ctx.save_for_backward(shard)
        return gather_sequence(shard, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.full = None  # the linears that shared the rebuilt input are done with it
        return scatter_sum_sequence(grad, ctx.axis), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Leave a TP region into a sequence-parallel one.

    forward: reduce-scatter the partial sums along the sequence.
    backward: all-gather dL/dy, since every rank's slice of the layer needs all of it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return scatter_sum_sequence(x, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_sequence(grad, ctx.axis), None


class _ScatterToSequence(torch.autograd.Function):
    """Go from a replicated tensor to a sequence-parallel one.

    forward: keep this rank's chunk of the sequence (no communication).
    backward: all-gather dL/dy to rebuild the gradient of the whole replicated input.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return split_sequence(x, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_sequence(grad, ctx.axis), None


class _GatherToReplicated(torch.autograd.Function):
    """Go from a sequence-parallel tensor back to a replicated one (scatter_to_sequence's dual).

    forward: all-gather the sequence chunks.
    backward: keep this rank's chunk of dL/dy, which every rank computed whole and alike.
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return gather_sequence(shard, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return split_sequence(grad, ctx.axis), None


def copy_to_region(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _CopyToRegion.apply(x, axis) if axis.size > 1 else x


def reduce_from_region(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, axis) if axis.size > 1 else x


def gather_from_sequence(x: torch.Tensor, axis: Axis, keep_shard: bool = False) -> torch.Tensor:
    # Under torch.compile the gathered input is saved whole: the compiled graph cannot hand
    # its shard to the column linears' backward (gather_source reads autograd's graph).
    keep_shard = keep_shard and not torch.compiler.is_compiling()
    return _GatherFromSequence.apply(x, axis, keep_shard) if axis.size > 1 else x


def reduce_scatter_to_sequence(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(x, axis) if axis.size > 1 else x


def scatter_to_sequence(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _ScatterToSequence.apply(x, axis) if axis.size > 1 else x


def gather_to_replicated(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _GatherToReplicated.apply(x, axis) if axis.size > 1 else x


def gather_features(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(..., f/t) on each rank -> (..., f) everywhere: a column layer's output made whole.

    Backward keeps this rank's slice of the gradient, exact because every rank computes the
    same whole gradient from the same whole output.
    """
    if axis.size == 1:
        return x
    return gather_to_replicated(x.movedim(-1, SEQ_DIM), axis).movedim(SEQ_DIM, -1).contiguous()


def split_features(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(..., f), the same on every rank -> this rank's (..., f/t): a row layer fed a whole input.

    Backward all-gathers the slices' gradients, so the whole input gets its whole gradient.
    """
    if axis.size == 1:
        return x
    return scatter_to_sequence(x.movedim(-1, SEQ_DIM), axis).movedim(SEQ_DIM, -1)


def gather_source(x: torch.Tensor) -> Any:
    """The gather node that made `x` while keeping its shard, or None."""
    if torch.compiler.is_compiling():
        return None
    node = x.grad_fn
    if isinstance(node, _GatherFromSequence._backward_cls) and node.keep_shard:
        return node
    return None


def regathered(node: Any) -> torch.Tensor:
    """The full input of a gather node, rebuilt by one more all-gather of its saved shard.

    Several linears may read one gathered input (q, k and v; gate and up); the first one to
    run backward rebuilds it, the others reuse it, and the gather's own backward drops it.
    Megatron-LM pays the same extra all-gather to store 1/t of these inputs (Korthikanti et
    al. 2022, section 4.2.2).
    """
    if node.full is None:
        (shard,) = node.saved_tensors
        node.full = all_gather_sequence(shard, node.axis)
    return node.full
