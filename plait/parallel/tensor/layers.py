"""Megatron-style parallel layers, each built from the dense layer it replaces.

A layer keeps only this rank's slice of the dense weight and remembers where that slice sits
(`Shard`), so the full tensor can be gathered back for parity checks and checkpoints:

- `ColumnParallelLinear`: rows of W (output features) split; input replicated, output sharded.
  A fused layer whose output is k equal parts (GPT-2's q|k|v) is split part by part, so each
  rank holds its slice of every part (`Shard.fused`).
- `RowParallelLinear`: columns of W (input features) split; input sharded, output summed.
- `VocabParallelEmbedding`: rows of the table (tokens) split; each rank looks up the tokens it
  owns, writes zeros for the others, and the ranks' outputs are summed.

A column layer followed by a row layer needs one collective each way: the column's input
enters the region (`copy_to_region`, or an all-gather with sequence parallelism) and the
row's output leaves it (`reduce_from_region`, or a reduce-scatter).

Both take an `nn.Linear` (W stored (out, in), y = x·Wᵀ + b) or transformers' `Conv1D` (GPT-2:
W stored transposed, (in, out), y = x·W + b). A Conv1D keeps its orientation, so its slices
are cut along the other dimension and the parameter keeps its name and full shape for
gathering and checkpoints; the layer multiplies by the transposed view.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.parallel.tensor import regions
from plait.runtime import comm
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


class Layout(NamedTuple):
    """A dense layer's sizes, and which dimension of its stored weight indexes the outputs."""

    in_features: int
    out_features: int
    out_dim: int  # 0: nn.Linear, W is (out, in); 1: Conv1D, W is (in, out)


def _conv1d_class() -> type | None:
    """transformers' Conv1D when transformers is loaded (a model holding one has loaded it):
    plait never imports transformers itself, it stays an optional extra."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    conv1d = _conv1d_class()
    return conv1d is not None and isinstance(module, conv1d)


def layout_of(module: nn.Module) -> Layout:
    """The `Layout` of an nn.Linear or a Conv1D (the two kinds column and row layers take)."""
    if is_conv1d(module):
        return Layout(module.weight.shape[0], module.weight.shape[1], 1)
    return Layout(module.in_features, module.out_features, 0)


def _as_linear_weight(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """W in F.linear's (out, in) orientation: a view for a Conv1D's (in, out) weight."""
    return weight.t() if transposed else weight


def sum_grad_over(param: nn.Parameter, axis: Axis) -> None:
    """Sum `param`'s gradient over `axis` in backward, before it is accumulated.

    With sequence parallelism a replicated parameter (a norm's scale, a row layer's bias) is
    applied to one chunk of the sequence per rank, so each rank holds part of its gradient;
    Megatron-LM sums these after backward, torch's DTensor while redistributing. A tensor
    hook does it as each gradient appears, through the ledger like every other collective.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(total, axis)
        return total

    if not getattr(param, "plait_sums_grad", None):
        param.register_hook(hook)
        param.plait_sums_grad = hook  # ZeRO-3 puts it on the views it gathers (zero/shard.py: FlatGroup.show)


def enter_region(x: torch.Tensor, axis: Axis, sequence_parallel: bool, regather: bool = True) -> torch.Tensor:
    """Replicated (or, with SP, sequence-sharded) input -> the whole input inside a region.

    With SP and `regather`, the column linears reading the result save only this rank's
    chunk of it and all-gather it again in backward (see `regions.regathered`).
    """
    if sequence_parallel:
        return regions.gather_from_sequence(x, axis, keep_shard=regather)
    return regions.copy_to_region(x, axis)


def leave_region(x: torch.Tensor, axis: Axis, sequence_parallel: bool) -> torch.Tensor:
    """Partial sums inside a region -> their sum (with SP, this rank's chunk of the sequence)."""
    if sequence_parallel:
        return regions.reduce_scatter_to_sequence(x, axis)
    return regions.reduce_from_region(x, axis)


class _LinearFromShard(torch.autograd.Function):
    """x·Wᵀ (+ b) for an x that a sequence-parallel gather produced.

    forward: the product, saving W but not x (x's gather already saved 1/t of it).
    backward: dx = g·W; dW = gᵀ·x with x rebuilt by `regions.regathered` (one all-gather per
    gathered input, shared by all the linears that read it).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                node: Any) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.node, ctx.has_bias = node, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (weight,) = ctx.saved_tensors
        grad_x = grad @ weight
        x = regions.regathered(ctx.node)
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, except that an input gathered for SP is rebuilt in backward rather than saved."""
    node = regions.gather_source(x) if torch.is_grad_enabled() else None
    if node is None:
        return F.linear(x, weight, bias)
    return _LinearFromShard.apply(x, weight, bias, node)


class ColumnParallelLinear(nn.Module):
    """y_r = x·W_rᵀ: this rank computes out_features/t of the outputs from the whole input.

    `enters` says whether the input enters the region here; it is False when an enclosing
    module (the GPT's attention or MLP) already did it once for several column layers.
    `regather` (SP only): save the input's sequence chunk, not the gathered input.
    `transposed`: the weight is stored (in, out/t), as a Conv1D stores it.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, axis: Axis, *,
                 sequence_parallel: bool = False, enters: bool = True, regather: bool = True,
                 transposed: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.axis, self.sequence_parallel, self.enters = axis, sequence_parallel, enters
        self.regather, self.transposed = regather, transposed

    @classmethod
    def from_dense(cls, dense: nn.Module, axis: Axis, memo: dict[int, nn.Parameter], *, fused: int = 1,
                   **options: Any) -> "ColumnParallelLinear":
        """Cut from an nn.Linear or a Conv1D; `fused` equal parts of the output each split by t."""
        out_dim = layout_of(dense).out_dim
        bias = shard_param(dense.bias, 0, axis, memo, fused) if dense.bias is not None else None
        weight = shard_param(dense.weight, out_dim, axis, memo, fused)
        return cls(weight, bias, axis, transposed=out_dim == 1, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enters:
            x = enter_region(x, self.axis, self.sequence_parallel, self.regather)
        return column_linear(x, _as_linear_weight(self.weight, self.transposed), self.bias)

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, tp={self.axis.size}, sp={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r·W_rᵀ (+ b): this rank holds in_features/t columns and a partial sum.

    The bias is replicated and added once, after the sum. `transposed`: the weight is stored
    (in/t, out), as a Conv1D stores it.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, axis: Axis, *,
                 sequence_parallel: bool = False, transposed: bool = False):
        super().__init__()
        self.weight, self.bias, self.transposed = weight, bias, transposed
        self.axis, self.sequence_parallel = axis, sequence_parallel
        if sequence_parallel and bias is not None:
            sum_grad_over(bias, axis)  # added to a chunk of the sequence: its gradient is partial

    @classmethod
    def from_dense(cls, dense: nn.Module, axis: Axis, memo: dict[int, nn.Parameter],
                   **options: Any) -> "RowParallelLinear":
        """Cut from an nn.Linear or a Conv1D: the input features are split."""
        in_dim = 1 - layout_of(dense).out_dim
        bias = nn.Parameter(dense.bias.detach().clone()) if dense.bias is not None else None
        return cls(shard_param(dense.weight, in_dim, axis, memo), bias, axis, transposed=in_dim == 0, **options)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum: x_r·W_rᵀ, before the ranks' terms are added."""
        return F.linear(x, _as_linear_weight(self.weight, self.transposed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(self.partial(x), self.axis, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, tp={self.axis.size}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Rows [r·V/t, (r+1)·V/t) of the table; tokens outside them look up zeros, then a sum."""

    def __init__(self, weight: nn.Parameter, axis: Axis, *, sequence_parallel: bool = False):
        super().__init__()
        self.weight, self.axis, self.sequence_parallel = weight, axis, sequence_parallel
        self.start = axis.rank * weight.shape[0]

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, axis: Axis, memo: dict[int, nn.Parameter],
                   **options: Any) -> "VocabParallelEmbedding":
        return cls(shard_param(embedding.weight, 0, axis, memo), axis, **options)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(rows, self.axis, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, tp={self.axis.size}, sp={self.sequence_parallel}"
