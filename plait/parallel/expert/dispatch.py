"""The experts' forward across the ep ranks: counts, tokens out, experts, tokens back.

For each MoE forward, on every ep rank:

1. sort this rank's (token, choice) assignments by expert; experts are numbered so that
   ep rank r holds experts r·E/ep ... (r+1)·E/ep - 1, so that order is also by destination;
2. one small all-to-all of the counts per expert (E integers), so that each rank knows how
   many rows it will receive from each other rank, per local expert; reading them is the
   one host sync of the layer (all_to_all_single needs the split sizes on the host). The
   copy to the host starts as soon as the counts have arrived (on a GPU, non-blocking into
   pinned memory), and the rows are permuted into expert order before it is waited for, so
   the device has that work queued while the host waits;
3. all-to-all of the rows with those split sizes; the local experts run on what arrived,
   grouped by expert (the experts module's own forward, given local indices and weight 1);
4. the reverse all-to-all brings each row's output home, where the weighted sum over the
   token's top_k choices is made as on one process.

Any part may be empty: a rank that sends or receives no rows still joins every collective,
and its empty rows stay in the autograd graph so that its backward joins the two reverse
all-to-alls too (a rank that skipped them would hang the others). Every collective goes
through plait.runtime.comm, so the ledger counts the bytes each rank actually sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.parallel.expert.ops import recomputing
from plait.runtime import comm
from plait.runtime.comm import Axis
from plait.wire import dispatch_bytes


class AllToAllRows(torch.autograd.Function):
    """Rows out by `in_splits`, in by `out_splits`; backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], axis: Axis) -> torch.Tensor:
        ctx.splits, ctx.axis = (out_splits, in_splits), axis
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        comm.all_to_all_uneven(out, rows.contiguous(), out_splits, in_splits, axis)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all_uneven(back, grad.contiguous(), in_splits, out_splits, ctx.axis)
        return back, None, None, None


class ExpertDispatch:
    """Stands in for an experts module's forward(x, index, weight) under expert parallelism;
    `local_forward` is the module's own forward over the experts this rank holds."""

    def __init__(self, local_forward: Callable[..., torch.Tensor], axis: Axis, experts: int):
        self.local_forward, self.axis, self.experts = local_forward, axis, experts
        self.formula = 0.0  # the bytes the formula gives for the routing since `take_formula`

    def __call__(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ep, local = self.axis.size, self.experts // self.axis.size
        order, counts = sort_by_expert(index, self.experts)
        arriving = torch.empty_like(counts)
        comm.all_to_all(arriving, counts, self.axis)  # E/ep counts to each rank: its experts' share of ours
        arriving = arriving.view(ep, local)
        sizes = HostCopy(torch.stack([counts.view(ep, local).sum(1), arriving.sum(1)]))
        outgoing = assignment_rows(x, order, index.shape[1])  # needs no sizes: queued while they travel
        send, receive = sizes.tolist()  # the host sync
        backward = torch.is_grad_enabled() and not recomputing()  # a no-grad probe or evaluation: forward only
        self.formula += routed_bytes(send, receive, self.axis, x, self.experts, backward=backward)
        rows = AllToAllRows.apply(outgoing, receive, send, self.axis)
        experts_of_rows = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(
            arriving.reshape(-1), output_size=rows.shape[0])  # the size given: no second sync
        out = self.local_forward(rows, experts_of_rows[:, None], rows.new_ones((rows.shape[0], 1)))
        out = out + rows[:, :1] * 0  # no rows arrived: the output still leads back to the all-to-all
        return combine(AllToAllRows.apply(out, send, receive, self.axis), order, weight)


class HostCopy:
    """A device tensor's copy to the host, started now and read later (`tolist`), so that the
    device work queued in between is not held up by the read. On a GPU the copy goes
    non-blocking into pinned memory, and an event marks its end: the read waits for the copy
    only, not for the work queued after it. On a CPU the tensor is on the host already."""

    def __init__(self, values: torch.Tensor):
        self.values, self.done = values, None
        if values.device.type == "cuda":
            self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.values.tolist()


def routed_bytes(send: list[int], receive: list[int], axis: Axis, x: torch.Tensor, experts: int,
                 backward: bool) -> float:
    """What one dispatch puts on the wire from this rank, by the formula on its routing
    (plait.estimate.experts.dispatch_bytes) with the rows it actually sends and returns."""
    me = axis.rank
    return dispatch_bytes(sum(send) - send[me], sum(receive) - receive[me], x.shape[-1] * x.element_size(),
                          experts, axis.size, backward)


def take_formula(model: torch.nn.Module) -> float:
    """The formula's bytes of every dispatch in `model` since the last call, and reset them."""
    total = 0.0
    for module in model.modules():
        dispatch = module.__dict__.get("forward")
        if isinstance(dispatch, (ExpertDispatch, DenseExpertDispatch)):
            total, dispatch.formula = total + dispatch.formula, 0.0
    return total


def by_expert(x: torch.Tensor, index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each (token, choice) assignment's row of `x` (tokens, d), sorted by expert (stable, so
    in token order within an expert); the count per expert; the order, for `combine`."""
    order, counts = sort_by_expert(index, experts)
    return assignment_rows(x, order, index.shape[1]), counts, order


def assignment_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Row t of `x` (tokens, d) once for each of its k assignments, in `order` (a permutation of
    the tokens · k assignments): x[order // k], with a backward that needs no accumulating
    index_put (eager torch runs one on a GPU by sorting the indices first, to add a token's k
    gradients deterministically)."""
    return AssignmentRows.apply(x, order, k)


class AssignmentRows(torch.autograd.Function):
    """x[order // k]; backward puts each gradient row back in assignment order (`unsort`: a
    permutation, nothing added) and sums each token's k rows, in a fixed order."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        return unsort(grad, order).view(-1, ctx.k, grad.shape[-1]).sum(dim=1), None, None


def unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows given in `order` (a permutation), put back where they came from: row i to order[i]."""
    return Unsort.apply(rows, order)


class Unsort(torch.autograd.Function):
    """`unsort`, whose backward takes each gradient row back into `order` and keeps only
    `order`: autograd's index_copy keeps its source rows as well, (tokens · k, d) values that
    an MoE block held until its backward for nothing (its combine keeps the unsorted rows)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(order)
        return torch.empty_like(rows).index_copy_(0, order, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None


def sort_by_expert(index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The assignments of `index` (tokens, k) in expert order (stable), and the count per expert."""
    flat = index.reshape(-1)
    return torch.argsort(flat, stable=True), tally(flat, experts)


def tally(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """How many entries of `flat` name each expert (int64): bincount's answer, its size fixed
    by `experts` rather than by the largest entry, which bincount reads on the host (a sync on
    a GPU, a graph break under torch.compile). Added up in int32, which Inductor adds with the
    GPU's atomics: an int64 addition falls back to torch's sorted index_put, whose one thread
    per expert walks that expert's every entry (2.0 of small-moe's 8.3 ms of device time a
    compiled forward and backward, profiled on an H200)."""
    ones = torch.ones_like(flat, dtype=torch.int32)
    return torch.zeros(experts, dtype=torch.int32, device=flat.device).index_add_(0, flat, ones).long()


def combine(rows: torch.Tensor, order: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The experts' output rows, in `by_expert`'s order, -> (tokens, d): put back in token
    order, weighted and summed over each token's k choices, in one fixed order (plait's MoE
    combines the same way on one process)."""
    tokens, k = weight.shape
    weighted = unsort(rows, order).view(tokens, k, rows.shape[-1]) * weight.unsqueeze(-1).to(rows.dtype)
    return weighted.sum(dim=1)


class AllToAllEqual(torch.autograd.Function):
    """Equal parts of dim 0 to each rank, and back in backward."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        out = torch.empty_like(rows)
        comm.all_to_all(out, rows.contiguous(), axis)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        back = torch.empty_like(grad)
        comm.all_to_all(back, grad.contiguous(), ctx.axis)
        return back, None


class DenseExpertDispatch:
    """Stands in for the forward of an experts module that runs every expert on every token
    (Llama 4: rows (E·T, d), expert-major, the router's scores already applied to them, the
    weights of every other expert's rows zero) under expert parallelism. Each ep rank holds
    E / ep experts: one all-to-all sends each expert's rows to the rank holding it, the local
    experts run on every rank's tokens at once, and one more brings the outputs home. No
    counts and no host sync (every part is T rows per expert), but the bytes are those of
    every expert on every token, E / top_k times a sparse dispatch's: the layout the model
    computes in, kept exactly. Every ep rank must bring the same T (plait's batches do)."""

    def __init__(self, local_forward: Callable[..., torch.Tensor], axis: Axis, experts: int):
        self.local_forward, self.axis, self.experts = local_forward, axis, experts
        self.formula = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ep, local = self.axis.size, self.experts // self.axis.size
        tokens = x.shape[0] // self.experts
        arrived = AllToAllEqual.apply(x.reshape(self.experts * tokens, -1), self.axis)  # (ep sources, local, T, d)
        mine = arrived.view(ep, local, tokens, -1).transpose(0, 1).reshape(local * ep * tokens, -1)
        out = self.local_forward(mine)  # each local expert over every rank's T tokens
        back = out.view(local, ep, tokens, -1).transpose(0, 1).reshape(ep * local * tokens, -1)
        backward = torch.is_grad_enabled() and not recomputing()
        away = (ep - 1) * local * tokens  # rows sent to other ranks, and as many returned
        self.formula += dispatch_bytes(away, away, x.shape[-1] * x.element_size(), 0, ep, backward)
        return AllToAllEqual.apply(back, self.axis).view(x.shape[0], *out.shape[1:])
