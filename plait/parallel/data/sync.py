"""Data parallelism: every rank holds the whole model; gradients are averaged in buckets.

Gradients live in flat buffers ("buckets") of about `bucket_mb` each, filled in the order
backward produces them (roughly the reverse of registration order). A bucket is made when
the first of its gradients arrives in a step and dropped by `zero_grad` after the update
(torch's `set_to_none`, as FSDP does): a pipeline's rank then holds no gradient of a chunk
before that chunk's first backward, which is where an interleaved schedule's activations
peak (docs/estimate.md, "Memory per GPU"). As soon as the last
gradient of a bucket has been accumulated, that bucket's all-reduce is launched
asynchronously, so communication overlaps the rest of backward. At the end of backward every
in-flight all-reduce is waited on, so the optimizer only ever sees averaged gradients.

With gradient accumulation, `no_sync(model)` turns the collectives off for all but the last
micro-batch: gradients simply accumulate in the buckets, and one all-reduce per step carries
the sum. This is the same contract torch's DistributedDataParallel offers, written small
enough to read.

Each parameter is averaged over the ranks its placement replicates it over
(plait/parallel/placement.py), and buckets never mix two such axes. Most parameters are
replicated over the whole data axis; an expert-parallel one (plait.parallel.expert) only
over the dp ranks of one edp group: its buckets are averaged over that axis, divided by the
whole dp (each expert's gradient already sums what every ep rank's tokens sent it), and it
starts from its edp rank 0's copy rather than dp rank 0's.

Buffers that a forward changes (BatchNorm's running statistics) would drift apart, each
rank averaging its own micro-batches. As torch DDP's `broadcast_buffers=True` does, rank 0's
are broadcast before a forward that follows a synchronised training forward (so once per
step with accumulation, not once per micro-batch): see `follow_rank0_buffers`. Buffers of a
SyncBatchNorm are equal on every rank by construction and are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from plait.parallel.applied import applied, applied_of
from plait.parallel.data.syncbn import SyncBatchNorm
from plait.parallel.pipeline.split import is_pipeline
from plait.parallel.placement import placement_of
from plait.rules import BUCKET_MB
from plait.runtime import comm
from plait.runtime.comm import Axis, Handle
from plait.runtime.mesh import EXPERT_SYNC, SYNC



@dataclass
class Bucket:
    """A flat gradient buffer shared by a few parameters (their .grad are views into it),
    while this step has made it (`make`): None between a step's update and its next backward."""

    index: int
    params: list[nn.Parameter]
    flat: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    ready: int = 0
    handle: Handle | None = None
    wire: torch.Tensor | None = None  # the bucket in --reduce-dtype, while it is reduced
    axis: Axis | None = None  # the ranks that average it: its parameters' replicate axis (dp_cp, or edp)
    divisor: int = 0  # what the sum is divided by, when not the axis's size (every bucket's: dp)

    def make(self) -> None:
        """Allocate the buffer and make every parameter's .grad its view, taking in a gradient
        autograd already made (the one whose arrival asked for the bucket): the bucket's other
        gradients then accumulate in place."""
        first = self.params[0]
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for param in self.params:
            view = self.flat[offset:offset + param.numel()].view_as(param)
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view
            self.views.append(view)
            offset += param.numel()

    def drop(self) -> None:
        """Free the buffer and the parameters' gradients (zero_grad's set_to_none)."""
        for param in self.params:
            param.grad = None
        self.flat, self.views = None, []


@dataclass
class GradSync:
    """The gradient-averaging machinery attached to one model."""

    axis: Axis
    buckets: list[Bucket]
    enabled: bool = True
    reduce_dtype: torch.dtype | None = None  # the wire's dtype, when not the gradients' own
    events: list[tuple[str, int]] = field(default_factory=list)
    _slot: dict[nn.Parameter, tuple[Bucket, int]] = field(default_factory=dict)
    _callback_queued: bool = False
    _in_backward: bool = False

    def __post_init__(self) -> None:
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                self._slot[param] = (bucket, i)

    # -- called by autograd ----------------------------------------------------------------
    def on_grad_ready(self, param: nn.Parameter) -> None:
        """A parameter's gradient for this micro-batch is fully accumulated."""
        bucket, i = self._slot[param]
        if bucket.flat is None:
            bucket.make()
        view = bucket.views[i]
        if param.grad is not view:
            # Something set .grad afresh (not through the bucket), so autograd made a new
            # tensor: move it into the bucket so the all-reduce sees it.
            view.copy_(param.grad)
            param.grad = view
        if not self._callback_queued:
            self._callback_queued = True
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)
        if not self.enabled:
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def on_backward_end(self) -> None:
        """Launch the buckets whose parameters got no gradient, then wait for all of them."""
        self._callback_queued = False
        self._in_backward = False
        if self.enabled:
            for bucket in self.buckets:
                if bucket.handle is None:
                    self._collect(bucket)
                    self._launch(bucket)
            self._wait_all()
        for bucket in self.buckets:
            bucket.ready = 0
        self.events.append(("backward_end", -1))

    def sync_now(self) -> None:
        """Average every bucket now, for callers that ran all their backwards under no_sync
        (the pipeline executor: with split backward, weight gradients arrive in many calls)."""
        for bucket in self.buckets:
            self._collect(bucket)
            self._launch(bucket)
        self._wait_all()

    # -- internals ---------------------------------------------------------------------------
    def _launch(self, bucket: Bucket) -> None:
        # Pre-divide so the sum is the mean; same order of operations as torch DDP. With
        # --reduce-dtype the sum runs in that dtype and is rounded back once, on arrival.
        wire = bucket.flat
        assert wire is not None  # made by its first gradient, or by _collect
        if self.reduce_dtype not in (None, wire.dtype):
            wire = bucket.wire = wire.to(self.reduce_dtype)
        wire.div_(bucket.divisor or self.axis.size)
        bucket.handle = comm.all_reduce(wire, bucket.axis or self.axis, async_op=True)
        self.events.append(("launch" if self._in_backward else "launch_late", bucket.index))

    def _wait_all(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            if bucket.wire is not None:
                assert bucket.flat is not None  # a bucket on the wire was made
                bucket.flat.copy_(bucket.wire)
                bucket.wire = None

    @staticmethod
    def _collect(bucket: Bucket) -> None:
        """Put every gradient in its bucket view: an unused parameter contributes zeros, and a
        gradient set afresh (not through the hook) is copied in."""
        if bucket.flat is None:
            bucket.make()
        for param, view in zip(bucket.params, bucket.views):
            if param.grad is None:
                view.zero_()
            elif param.grad is not view:
                view.copy_(param.grad)
            param.grad = view

    def zero_grad(self) -> None:
        """Drop every bucket: the next backward makes them again, as its gradients arrive."""
        for bucket in self.buckets:
            bucket.drop()


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Group parameters, in backward order, into flat buffers of about `bucket_bytes`."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for param in reversed(params):
        nbytes = param.numel() * param.element_size()
        same_kind = groups and groups[-1][0].dtype == param.dtype and groups[-1][0].device == param.device
        if not groups or not same_kind or size + nbytes > bucket_bytes and size > 0:
            groups.append([])
            size = 0
        groups[-1].append(param)
        size += nbytes
    return [Bucket(i, group) for i, group in enumerate(groups)]  # each made by its first gradient


def apply_data_parallel(model: nn.Module, axis: Axis, *, bucket_mb: float = BUCKET_MB,
                        reduce_dtype: torch.dtype | None = None, expert_axis: Axis | None = None) -> nn.Module:
    """Make `model` average its gradients over `axis` after every backward (in place).

    Parameters and buffers are first broadcast from the axis's rank 0, so every replica
    starts identical even if the ranks built the model with different seeds. A parameter
    whose placement replicates it over the edp axis (expert parallelism) is broadcast and
    averaged over `expert_axis` instead (see the module docstring).
    """
    if axis.size == 1:
        return model
    axes = {SYNC: axis, EXPERT_SYNC: expert_axis}
    over = replicated_over(model, axes)
    comm.broadcast_each([(t.data, axes[over.get(t, SYNC)]) for t in [*model.parameters(), *model.buffers()]],
                        purpose=comm.SETUP)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets: list[Bucket] = []
    for name in dict.fromkeys([SYNC, *over.values()]):  # the data axis's buckets first
        for chunk in reversed(chunk_params(model, params)):
            for bucket in make_buckets([p for p in chunk if over[p] == name], int(bucket_mb * 2**20)):
                bucket.index, bucket.axis, bucket.divisor = len(buckets), axes[name], axis.size
                buckets.append(bucket)
    sync = GradSync(axis, buckets, reduce_dtype=reduce_dtype)
    for param in params:
        param.register_post_accumulate_grad_hook(sync.on_grad_ready)
    applied(model).grad_sync = sync
    follow_rank0_buffers(model, axis)
    return model


def chunk_params(model: nn.Module, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` by pipeline chunk (one list for a whole model), so that no bucket holds two
    chunks' gradients: each chunk's are made at its own first backward (`Bucket.make`)."""
    if not is_pipeline(model):
        return [params]
    wanted, seen, out = set(params), set(), []
    for chunk in model:
        out.append([p for p in chunk.parameters() if p in wanted and p not in seen])
        seen.update(out[-1])
    return out


def replicated_over(model: nn.Module, axes: dict[str, Axis | None]) -> dict[nn.Parameter, str]:
    """{parameter: its placement's replicate axis}, each of which `axes` must give."""
    over = {param: placement_of(param).replicate for param in model.parameters()}
    for name in set(over.values()):
        if axes.get(name) is None:
            raise ValueError(f"parameters replicated over {name} need that axis (expert_axis for edp)")
    return over


def running_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a training forward changes: running statistics of norms, SyncBN's excepted."""
    return [b for m in model.modules() if isinstance(m, _NormBase) and not isinstance(m, SyncBatchNorm)
            for b in m.buffers(recurse=False)]


def follow_rank0_buffers(model: nn.Module, axis: Axis) -> int:
    """Broadcast rank 0's running buffers over `axis` at the forwards torch DDP would.

    torch DDP broadcasts before a forward when the forward before it ran with gradients and
    synchronised them (`require_forward_param_sync`): the first micro-batch of every step,
    and an evaluation that follows training. Returns how many buffers follow rank 0.
    """
    buffers = running_buffers(model)
    if axis.size == 1 or not buffers:
        return 0
    state = {"sync_next": True}

    def before(module: nn.Module, args: object) -> None:
        if state["sync_next"]:
            comm.broadcast_many(buffers, axis)  # the statistics and counters, packed by dtype

    def after(module: nn.Module, args: object, out: object) -> None:
        sync = applied_of(module).grad_sync
        state["sync_next"] = torch.is_grad_enabled() and (sync is None or sync.enabled)

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)
    return len(buffers)


def grad_sync(model: nn.Module) -> GradSync | None:
    """What syncs `model`'s gradients (apply_data_parallel's GradSync, or ZeRO's ZeroSync), if any."""
    return applied_of(model).grad_sync


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally inside this block; the next synced backward sends the sum."""
    sync = grad_sync(model)
    if sync is None:
        yield
        return
    previous, sync.enabled = sync.enabled, False
    try:
        yield
    finally:
        sync.enabled = previous
