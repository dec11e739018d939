"""Megatron-style parallel layers, each built from the dense layer it replaces.

A layer keeps only this rank's slice of the dense weight, marked with its placement
(slices.py, plait/parallel/placement.py), so the full tensor can be gathered back for parity
checks and checkpoints:

- `ColumnParallelLinear`: rows of W (output features) split; input replicated, output sharded.
  A fused layer whose output is k equal parts (GPT-2's q|k|v) is split part by part, so each
  rank holds its slice of every part (`Split.fused`).
- `RowParallelLinear`: columns of W (input features) split; input sharded, output summed.
- `VocabParallelEmbedding`: rows of the table (tokens) split; each rank looks up the tokens it
  owns, writes zeros for the others, and the ranks' outputs are summed. An nn.Embedding
  subclass whose forward does more than the lookup (Gemma scales it by sqrt(hidden)) is
  split in place instead (`split_embedding_in_place`), so its own arithmetic still runs.

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
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.parallel.tensor import regions
from plait.parallel.tensor.slices import shard_of, shard_param, tensor_placement
from plait.runtime import comm
from plait.runtime.comm import Axis

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "carry_grad_sum",
           "enter_region", "is_conv1d", "layout_of", "leave_region", "overrides_forward", "shard_of", "shard_param",
           "head_vectors", "split_embedding_in_place", "split_head_in_place", "sum_grad_over", "tensor_placement"]

class WeightLayout(NamedTuple):
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


def layout_of(module: nn.Module) -> WeightLayout:
    """The `WeightLayout` of an nn.Linear or a Conv1D (the two kinds column and row layers take)."""
    if is_conv1d(module):
        return WeightLayout(module.weight.shape[0], module.weight.shape[1], 1)
    return WeightLayout(module.in_features, module.out_features, 0)


def _as_linear_weight(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """W in F.linear's (out, in) orientation: a view for a Conv1D's (in, out) weight."""
    return weight.t() if transposed else weight


SUMS_GRAD = "plait_sums_grad"  # the hook sum_grad_over set on a parameter


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

    if not param.requires_grad:  # a buffer kept as a parameter (AfMoE's expert bias): no gradient to sum
        return
    if not getattr(param, SUMS_GRAD, None):
        param.register_hook(hook)
        setattr(param, SUMS_GRAD, hook)  # ZeRO-3 puts it on the views it gathers (zero/shard.py: FlatGroup.show)


def carry_grad_sum(old: nn.Parameter, new: nn.Parameter) -> None:
    """`new`, a parameter made to replace `old` (its materialised or sliced copy), sums its
    gradient as `old` did: a tensor hook lives with the tensor, so it is set on `new` too."""
    hook = old.__dict__.get(SUMS_GRAD)
    if hook is not None:
        new.register_hook(hook)
        setattr(new, SUMS_GRAD, hook)


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
    `entry` (a SharedEntry): enter once with the other column layers reading the same input.
    `regather` (SP only): save the input's sequence chunk, not the gathered input.
    `gather_output`: return the whole output, all-gathered (a head that returns whole logits).
    `transposed`: the weight is stored (in, out/t), as a Conv1D stores it.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, axis: Axis, *,
                 sequence_parallel: bool = False, enters: bool = True, regather: bool = True,
                 transposed: bool = False, gather_output: bool = False, entry: Any = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.axis, self.sequence_parallel, self.enters = axis, sequence_parallel, enters
        self.regather, self.transposed, self.gather_output, self.entry = regather, transposed, gather_output, entry

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
            x = self.entry.enter(x, self._enter) if self.entry is not None else self._enter(x)
        y = column_linear(x, _as_linear_weight(self.weight, self.transposed), self.bias)
        return regions.gather_features(y, self.axis) if self.gather_output else y

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        return enter_region(x, self.axis, self.sequence_parallel, self.regather)

    def extra_repr(self) -> str:
        gather = ", gather_output" if self.gather_output else ""
        return f"local={tuple(self.weight.shape)}, tp={self.axis.size}, sp={self.sequence_parallel}{gather}"


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r·W_rᵀ (+ b): this rank holds in_features/t columns and a partial sum.

    The bias is replicated and added once, after the sum. `split_input`: the input is whole
    on every rank and this rank keeps its slice of it. `entry`: the SharedEntry of the column
    layers, emptied here since the region is left. `transposed`: the weight is stored
    (in/t, out), as a Conv1D stores it.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, axis: Axis, *,
                 sequence_parallel: bool = False, transposed: bool = False, split_input: bool = False,
                 entry: Any = None):
        super().__init__()
        self.weight, self.bias, self.transposed = weight, bias, transposed
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.split_input, self.entry = split_input, entry
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
        if self.entry is not None:
            self.entry.clear()
        if self.split_input:
            x = regions.split_features(x, self.axis)
        y = leave_region(self.partial(x), self.axis, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        split = ", split_input" if self.split_input else ""
        return f"local={tuple(self.weight.shape)}, tp={self.axis.size}, sp={self.sequence_parallel}{split}"


class VocabParallelEmbedding(nn.Module):
    """Rows [r·V/t, (r+1)·V/t) of the table; tokens outside them look up zeros, then a sum.

    `padding_idx`, as nn.Embedding's: that row (on the rank that holds it) gets no gradient.
    """

    def __init__(self, weight: nn.Parameter, axis: Axis, *, sequence_parallel: bool = False,
                 padding_idx: int | None = None):
        super().__init__()
        self.weight, self.axis, self.sequence_parallel = weight, axis, sequence_parallel
        self.start = axis.rank * weight.shape[0]
        self.local_padding = local_padding(padding_idx, self.start, weight.shape[0])

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, axis: Axis, memo: dict[int, nn.Parameter],
                   **options: Any) -> "VocabParallelEmbedding":
        return cls(shard_param(embedding.weight, 0, axis, memo), axis, padding_idx=embedding.padding_idx, **options)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local, outside = owned_ids(ids, self.start, self.weight.shape[0])
        rows = F.embedding(local, self.weight, padding_idx=self.local_padding)
        return sum_owned_rows(rows, outside, self.axis, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, tp={self.axis.size}, sp={self.sequence_parallel}"


def local_padding(padding_idx: int | None, start: int, rows: int) -> int | None:
    """nn.Embedding's padding row as a row of this rank's slice; None when another rank holds it."""
    local = None if padding_idx is None else padding_idx - start
    return local if local is not None and 0 <= local < rows else None


def owned_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as rows of this rank's slice, 0 where another rank owns the token; where that is)."""
    local = ids - start
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def sum_owned_rows(rows: torch.Tensor, outside: torch.Tensor, axis: Axis, sequence_parallel: bool) -> torch.Tensor:
    """Zeros for the tokens another rank owns, then the ranks' rows summed: each token's row
    comes from its owner alone, whatever per-token arithmetic made it."""
    return leave_region(rows.masked_fill(outside.unsqueeze(-1), 0.0), axis, sequence_parallel)


def overrides_forward(module: nn.Module, base: type) -> bool:
    """Whether `module`'s class is a subclass of `base` whose forward is its own (arithmetic
    around the base's: Gemma's scaled embedding), which a replacement layer would drop."""
    return isinstance(module, base) and getattr(type(module), "forward", None) is not base.forward


class _InPlaceVocab:
    """The forward hooks of an embedding split in place: the ids become this rank's rows
    before the module's own forward; its output (its arithmetic included) is zeroed for the
    tokens other ranks own and summed after."""

    def __init__(self, start: int, rows: int, axis: Axis, sequence_parallel: bool, input_name: str | None):
        self.start, self.rows, self.axis, self.sequence_parallel = start, rows, axis, sequence_parallel
        self.input_name, self.outside = input_name, []  # one entry per forward in flight

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = args[0] if args else kwargs.get(self.input_name or "")
        if not isinstance(ids, torch.Tensor):
            raise PlaitError(f"{type(module).__name__} was called without its token ids",
                             hint="a split embedding reads the ids as the first argument of its forward")
        local, outside = owned_ids(ids, self.start, self.rows)
        self.outside.append(outside)
        return ((local, *args[1:]), kwargs) if args else (args, {**kwargs, self.input_name: local})

    def after(self, module: nn.Module, args: tuple, out: Any) -> torch.Tensor:
        outside = self.outside.pop()
        if not isinstance(out, torch.Tensor) or out.shape[:-1] != outside.shape:
            raise PlaitError(f"{type(module).__name__}'s forward does not return one row per token, so "
                             "plait cannot split its vocabulary", hint="leave it out of the tp plan")
        return sum_owned_rows(out, outside, self.axis, self.sequence_parallel)


def head_vectors(head: nn.Module, rows: int) -> list[str]:
    """A head's own vectors over its `rows` outputs beside its weight (a bias, a learned scale a
    logit): what a vocabulary split cuts with the weight's rows, and what the estimate counts
    split with them (GPTConfig.head_vectors)."""
    return [name for name, param in head.named_parameters(recurse=False)
            if name != "weight" and param.ndim == 1 and param.shape[0] == rows]


def split_head_in_place(head: nn.Linear, axis: Axis, memo: dict[int, nn.Parameter]) -> nn.Linear:
    """`head` (an nn.Linear subclass with its own forward: Dory's learned scale a logit) holding
    this rank's vocabulary rows of its weight and of its vectors over the vocabulary
    (`head_vectors`), its class, buffers and forward kept: its logits come out split by
    vocabulary, as a column layer's do, for the vocab-parallel loss. Exact for any arithmetic
    each logit gets from its own row alone (the probe checks the rest); a parameter of another
    shape is refused, since no split can be read off it. The caller enters the input into
    the region."""
    rows = head.out_features
    vectors = head_vectors(head, rows)
    other = [name for name, _ in head.named_parameters(recurse=False) if name not in ("weight", *vectors)]
    if other:
        raise PlaitError(f"tensor-parallel plan: the head {type(head).__name__} holds {other[0]} beside its weight, "
                         "which a split by vocabulary cannot tell how to cut",
                         hint="leave the head out of the tp plan (it then stays whole on every rank)")
    for name in ("weight", *vectors):
        setattr(head, name, shard_param(getattr(head, name), 0, axis, memo))
    head.out_features = rows // axis.size
    return head


def split_embedding_in_place(embedding: nn.Embedding, axis: Axis, memo: dict[int, nn.Parameter], *,
                             sequence_parallel: bool = False, input_name: str | None = None) -> nn.Embedding:
    """`embedding` (an nn.Embedding subclass with its own forward) holding this rank's rows of
    the table, its class, buffers and forward kept: hooks around that forward do what
    `VocabParallelEmbedding` does around F.embedding. Exact for any per-token arithmetic
    (a scale, a norm), since only the owner's row of each token survives the sum. `input_name`:
    the forward's ids argument, when called by keyword."""
    weight = shard_param(embedding.weight, 0, axis, memo)
    start = axis.rank * weight.shape[0]
    embedding.weight = weight
    embedding.num_embeddings = weight.shape[0]
    embedding.padding_idx = local_padding(embedding.padding_idx, start, weight.shape[0])
    hooks = _InPlaceVocab(start, weight.shape[0], axis, sequence_parallel, input_name)
    embedding.register_forward_pre_hook(hooks.before, with_kwargs=True)
    embedding.register_forward_hook(hooks.after)
    return embedding
