"""ZeRO stages 1-3: each data-parallel rank keeps only 1/n of the model states it can shed.

Trainable parameters are packed into flat buffers ("groups"), each cut into n equal shards
(shard.py); rank r owns shard r of every group. The stage decides what else it keeps:

    stage  parameters  gradients  optimizer state   wire per step (S = Ψ·bytes)
    1      whole       whole      shard             reduce-scatter S + all-gather S
    2      whole       shard      shard             reduce-scatter S + all-gather S
    3      shard       shard      shard             all-gather 2S + reduce-scatter S

Stages 1-2 pack parameters into buckets in backward order, as DDP does, and launch a bucket's
reduce-scatter asynchronously once all its gradients are in, so communication overlaps the
rest of backward. The optimizer steps only the owned shard, then the updated parameters are
all-gathered back in place. Stage 3 packs parameters by unit (each child of a module list,
e.g. a transformer block; each untied matrix outside them, e.g. the embedding and the head;
and a root unit for the rest, e.g. the final norm): a unit is all-gathered just before
its forward and freed after it, gathered again just before its backward
(`GatherForBackward`), and its gradient is reduce-scattered as soon as autograd has
accumulated it; the next unit is prefetched while the current one computes.

Each parameter is sharded over the ranks its placement replicates it over
(plait/parallel/placement.py): the dp × cp ranks as above, or, for expert parallelism
(plait.parallel.expert), which folds into dp, the edp ranks that hold the same experts.
Parameters of each replicate axis go into groups of their own, cut over that axis (an
expert group's reduce-scatter sums over edp and divides by dp, as DDP's expert buckets do),
broadcast at setup from its rank 0; a stage-3 unit holding several kinds is one group per
axis (shards registered as `plait_shard`, `plait_edp_shard`) gathered and freed together.

Hybrid sharding (--dp-shard N) shards over a group of N of the dp × cp ranks instead (the
mesh's "dp_shard" axis) and keeps a whole copy of the states in each group. The ranks that
hold the same shard ("dp_replicate") sum it after each reduce-scatter, and every gradient
sum is divided by all dp × cp ranks, so the mean is the one process's. Setup broadcasts
over both axes, so every copy starts alike; a checkpoint takes each shard from its first
replica.

Files: stages.py (this: setup and the public functions), hooks.py (`ZeroSync`, what
autograd and the module hooks call), shard.py (packing and cutting flat buffers),
optim.py (the sharded optimizer, checkpoint pieces, the formulas).

Gradient accumulation: `no_sync(model)` from plait.parallel.data.sync works unchanged (this
machinery sits at the attribute it looks for). Stage 1 keeps whole gradients anyway, so
inside no_sync it skips the reduction and the last micro-batch reduce-scatters the sum once.
Stages 2-3 exist to not hold whole gradients, so they reduce-scatter every micro-batch into
the shard, as DeepSpeed does: m reduce-scatters per step with m micro-batches. At most one
reduction is in flight; a bucket's whole gradient is freed as soon as its reduction is done.
Every stage makes a gradient at the first backward that reaches it and drops it at
`zero_grad` after the update, so that a pipeline's chunk holds none before its first
backward (docs/estimate.md, "Memory per GPU").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from plait import rules
from plait.errors import PlaitError
from plait.parallel.applied import applied
from plait.parallel.data.sync import follow_rank0_buffers, grad_sync
from plait.parallel.pipeline.split import is_pipeline, logical_parameters, tied_copies
from plait.parallel.zero.hooks import ZeroSync
from plait.parallel.zero.optim import checkpoint_pieces
from plait.parallel.materialize import Fill
from plait.parallel.zero.shard import (FlatGroup, ShardAxes, bucket_params, filled_shard, find_units, pack,
                                       shard_size, unit_owners, with_edges)
from plait.runtime import comm
from plait.runtime.comm import Axis
from plait.runtime.mesh import SYNC

log = logging.getLogger(__name__)
SHARD_PARAM = "plait_shard"  # stage 3: the name under which a unit's shard is registered


def apply_zero(model: nn.Module, axis: Axis, *, stage: int, offload: bool = False, bucket_mb: float = rules.BUCKET_MB,
               units: Sequence[nn.Module] | None = None, reduce_dtype: torch.dtype | None = None,
               prefetch: int = 1, reshard_after_forward: bool = True, expert_axis: Axis | None = None,
               replicate_axis: Axis | None = None, fill: Fill | None = None) -> nn.Module:
    """Shard `model`'s states over `axis` with ZeRO `stage` 1, 2 or 3 (in place).

    Build the optimizer with plait.build_optimizer, which returns the sharded one (its state
    in CPU memory when `offload`). Parameters and buffers are first broadcast from the axis's
    rank 0, as apply_data_parallel does; expert-parallel parameters are sharded over, and
    broadcast from rank 0 of, `expert_axis` (the edp ranks: see the module docstring).
    Stage 3's units are the children of every module list (`find_units`) and the matrices
    outside them (`with_edges`: an untied embedding, a head) unless `units` names them;
    `prefetch` units are gathered ahead of the one computing, and
    `reshard_after_forward=False` keeps each unit gathered from its forward to its backward
    (one gather less, the whole model held at the turn). `replicate_axis` (hybrid sharding,
    --dp-shard): `axis` is then one group of shard ranks, and the ranks of `replicate_axis`
    hold the same shards, summing their gradients after each reduce-scatter.

    `fill` (stage 3; plait.parallel.materialize.placeholders): the parameters are handles
    with a shape and no values, and each rank fills only its shards, a parameter whole at a
    time, from what `fill` gives: no rank ever holds a unit whole at setup, and nothing is
    broadcast (every rank fills from the same source).
    """
    rules.check_zero3_gathers(stage, prefetch, reshard_after_forward, 2 if is_pipeline(model) else 1)
    if stage not in (1, 2, 3):
        raise PlaitError(f"apply_zero takes stage 1, 2 or 3, got {stage}", hint="stage 0 is apply_data_parallel")
    if grad_sync(model) is not None:
        raise PlaitError("this model already has data parallelism or ZeRO applied", hint="apply one of them, once")
    if fill is not None and stage != 3:
        raise PlaitError(f"ZeRO-{stage} holds whole parameters: it cannot fill shards from placeholders",
                         hint="materialize the model (plait.parallel.materialize), then apply_zero")
    axes = ShardAxes.of_model(model, axis, expert_axis, replicate_axis)
    for each in axes.over.values():
        check_backend(each, stage, next(model.parameters()).device)
    filled = list(model.buffers()) if fill is not None else [*model.parameters(), *model.buffers()]
    _broadcast_state(filled, axes)
    logical = logical_parameters(model)
    chunks = list(model) if is_pipeline(model) else [model]
    chunk_of = {p: k for k, chunk in enumerate(chunks) for p in chunk.parameters()}
    alone = tied_copies(model)
    sync = (_shard_units(model, axes, units, chunks, alone, fill) if stage == 3
            else _shard_buckets(chunks, axes, stage, bucket_mb, alone))
    sync.offload, sync.tied, sync.reduce_dtype = offload, alone, reduce_dtype
    sync.prefetch, sync.reshard_after_forward = prefetch, reshard_after_forward
    sync.names = {p: name for name, p, _ in logical}
    sync.replicas = {p for _, p, replica in logical if replica}
    sync.chunk = {g.index: chunk_of[g.params[0]] for g in sync.groups}
    for weight in alone:  # its two copies must be cut alike on both pipeline ranks
        members = sync.group_of(weight).params
        if len(members) != 1 or members[0] is not weight:
            raise PlaitError("a ZeRO-3 unit holds a pipeline copy of the tied embedding with other parameters",
                             hint="leave units=None, or give the embedding and the head units of their own")
    record = applied(model)
    record.grad_sync, record.pieces = sync, checkpoint_pieces
    if not is_pipeline(model):
        for over in filter(None, (axis, axes.replicate)):  # the shard group's rank 0, then the replicas' first
            follow_rank0_buffers(model, over)
    others = "".join(f" (those replicated over {name}: {over.size} ranks)" for name, over in axes.over.items()
                     if name != SYNC)
    log.info("ZeRO-%d over %d dp ranks%s%s: %d %s%s", stage, axis.size,
             f" × {axes.replicate.size} replicas" if axes.replicate is not None else "", others,
             len(sync.units) if stage == 3 else len(sync.groups), "units" if stage == 3 else "buckets",
             ", optimizer offloaded to CPU" if offload else "")
    return model


def _broadcast_state(tensors: list[torch.Tensor], axes: ShardAxes) -> None:
    """Every rank alike: each tensor from its replicas' first rank (--dp-shard), then from its
    shard axis's (comm.broadcast_each); each tensor's two come in that order."""
    for over_of in (axes.replicate_of, axes.axis):
        comm.broadcast_each([(t.data, over) for t in tensors if (over := over_of(t)) is not None], purpose=comm.SETUP)


def zero_of(model: nn.Module) -> ZeroSync | None:
    """The ZeRO machinery attached by `apply_zero`, if any."""
    sync = grad_sync(model)
    return sync if isinstance(sync, ZeroSync) else None


def _shard_buckets(chunks: list[nn.Module], axes: ShardAxes, stage: int, bucket_mb: float,
                   alone: list[nn.Parameter]) -> ZeroSync:
    """Stages 1-2: parameters become views of whole flat buckets; each rank owns a slice.

    Buckets never span two pipeline chunks (each chunk's backward reduces its own) nor two
    replicate axes (expert parameters are cut over edp), and a copy of a tied weight is a
    bucket of its own, cut alike on both pipeline ranks.
    """
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    buckets, alone_ids = [[p] for p in alone], {id(p) for p in alone}
    for chunk in chunks:
        rest = [p for p in chunk.parameters() if p.requires_grad and id(p) not in alone_ids]
        buckets += [b for kind in axes.kinds(rest) for b in bucket_params(kind, int(bucket_mb * 2**20))]
    groups = []
    for index, members in enumerate(buckets):
        axis = axes.axis(members[0])
        flat = pack(members, axis.size)
        size = flat.numel() // axis.size
        group = FlatGroup(index, members, axis, flat, flat[axis.rank * size:(axis.rank + 1) * size],
                          divisor=axes.mean_over, replicate=axes.replicate_of(members[0]))
        for param, view in zip(members, group.split(flat)):
            param.data = view
        groups.append(group)  # its whole gradient is made at the first backward that needs it
    sync = ZeroSync(axes.dense, stage, groups)
    for param in params:
        param.register_post_accumulate_grad_hook(sync.on_grad_ready)
    return sync


def _shard_units(model: nn.Module, axes: ShardAxes, units: Sequence[nn.Module] | None, chunks: list[nn.Module],
                 alone: list[nn.Parameter], fill: Fill | None = None) -> ZeroSync:
    """Stage 3: each unit's parameters become one shard Parameter per replicate axis (two when
    the unit holds expert parameters too: a group per axis, each the previous one's
    companion), plus views gathered on demand.

    `chunks` are the modules a forward calls: the model, or each pipeline stage, whose
    hooks gather the root unit and end the forward. A copy of a tied weight is a unit of
    its own (the module reading it), cut alike on both pipeline ranks that hold one; that
    module's other parameters (a head's bias: CTRL's, ModernBERT-decoder's) join the root.
    """
    modules = (list(units) if units is not None
               else [u for chunk in chunks for u in with_edges(chunk, find_units(chunk))])
    alone_ids = {id(p) for p in alone}
    modules += [m for chunk in chunks for m in chunk.modules()
                if any(id(p) in alone_ids for p in m.parameters(recurse=False)) and m not in modules]
    if any(module is model for module in modules):
        raise PlaitError("the model itself cannot be a ZeRO-3 unit", hint="name its children, or pass units=None")
    recomputing = [m for m in model.modules() if getattr(m, "recompute", False) is True]
    if any(unit is not block and unit in set(block.modules()) for block in recomputing for unit in modules):
        raise PlaitError("a ZeRO-3 unit inside a block that recomputes its activations would be gathered "
                         "and freed again by the recomputation", hint="make the recomputing blocks the units")
    owner, where = unit_owners(model, modules)
    _copy_alone(owner, modules, alone_ids)
    groups: list[FlatGroup] = []
    for k, module in [(-1, model), *enumerate(modules)]:
        unit = [_unit_group(len(groups) + i, kind, axes, module, where, fill)
                for i, kind in enumerate(axes.kinds([p for p, u in owner.items() if u == k]))]
        for group, companion in zip(unit, unit[1:]):
            group.companion = companion
        groups += unit
    root = groups[0] if groups and groups[0].module is model else None
    sync = ZeroSync(axes.dense, 3, groups, root)
    for group in groups:
        sync._free(group)
        group.flat.register_post_accumulate_grad_hook(lambda t, g=group: sync.on_unit_grad(g))
    for group in sync.units:  # a companion is gathered and freed by its unit's hooks
        if group is not root:
            group.module.register_forward_pre_hook(lambda m, a, g=group: sync.pre_forward(g, False))
            group.module.register_forward_hook(lambda m, a, out, g=group: sync.post_forward(g, out, False))
    for chunk in chunks:
        inside = set(chunk.modules())
        held = [m for g in root.together() for m, _, _ in g.locations] if root is not None else []
        mine = root if any(m in inside for m in held) else None
        chunk.register_forward_pre_hook(lambda m, a, g=mine: sync.pre_forward(g, True))
        chunk.register_forward_hook(lambda m, a, out, g=mine: sync.post_forward(g, out, True))
    return sync


def _copy_alone(owner: dict[nn.Parameter, int], modules: Sequence[nn.Module], alone: set[int]) -> None:
    """Leave a tied weight's copy alone in its unit (the module reading it): the module's
    other parameters go to the root. The two pipeline ranks holding a copy each cut it alike
    only where the copy is all its group holds; a bias beside it would shift the cut."""
    for k, module in enumerate(modules):
        if any(id(p) in alone for p in module.parameters(recurse=False)):
            for param in module.parameters():
                if owner.get(param) == k and id(param) not in alone:
                    owner[param] = -1


def _unit_group(index: int, members: list[nn.Parameter], axes: ShardAxes, module: nn.Module,
                where: list[tuple[nn.Module, str, nn.Parameter]], fill: Fill | None = None) -> FlatGroup:
    """Pack one replicate axis's parameters of a unit; keep this rank's shard as a Parameter of
    `module`; the originals keep only their shape, and leave the modules that held them
    (`where`: every registration), whose attributes the gathered views fill in. With `fill`
    the shard is filled from it, and the gathered buffer is never written at setup."""
    axis = axes.axis(members[0])
    if fill is None:
        flat = pack(members, axis.size).requires_grad_()
        size = flat.numel() // axis.size
        shard = nn.Parameter(flat.detach()[axis.rank * size:(axis.rank + 1) * size].clone())
    else:  # torch.empty: its pages are never touched before _free drops them
        size = shard_size(sum(p.numel() for p in members), axis.size)
        flat = torch.empty(size * axis.size, dtype=members[0].dtype, device=members[0].device).requires_grad_()
        shard = nn.Parameter(filled_shard(members, axis.size, axis.rank, fill))
    name = shard_param_name(axes.replicated_over(members[0]))
    module.register_parameter(name, shard)
    slot = {id(p): i for i, p in enumerate(members)}
    locations = [(m, attr, slot[id(p)]) for m, attr, p in where if id(p) in slot]
    for m, attr, _ in locations:
        del m._parameters[attr]
    for param in members:
        _keep_shape_only(param)
    return FlatGroup(index, members, axis, flat, shard, module, name, axes.mean_over,
                     replicate=axes.replicate_of(members[0]), locations=locations)


def shard_param_name(replicated_over: str) -> str:
    """Where a unit registers its shard of the parameters replicated over that axis:
    `plait_shard` for the data axis's, `plait_edp_shard` for the experts'."""
    return SHARD_PARAM if replicated_over == SYNC else f"plait_{replicated_over}_shard"


def _keep_shape_only(param: nn.Parameter) -> None:
    """A handle with the parameter's name, shape and dtype, and one element of memory."""
    param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside this block a ZeRO-3 model has its ordinary, whole parameters and state_dict.

    For saving weights or loading them: on exit every rank keeps its shard of whatever the
    parameters then hold. Stages 1-2 (and plain models) are whole already.
    """
    sync = zero_of(model)
    if sync is None or sync.stage < 3:
        yield model
        return
    for group in sync.groups:
        sync._gather(group, purpose="checkpoint")
        for param, view in zip(group.params, group.split(group.flat.detach())):
            param.data = view
        for module, name, i in group.locations:
            module.__dict__.pop(name, None)
            module._parameters[name] = group.params[i]
        del group.module._parameters[group.shard_name]
    try:
        yield model
    finally:
        for group in sync.groups:
            group.shard.data.copy_(group.flat.detach()[group.rank * group.size:(group.rank + 1) * group.size])
            for module, name, _ in group.locations:
                module._parameters.pop(name, None)
            for param in group.params:
                _keep_shape_only(param)
            group.module.register_parameter(group.shard_name, group.shard)
            sync._free(group)


def check_backend(axis: Axis, stage: int, device: torch.device | str = "cpu") -> None:
    """Fail at setup, naming the fix, when the dp group cannot reduce-scatter (every stage needs it)."""
    if axis.size == 1:
        return
    backend = str(torch.distributed.get_backend(axis.group))
    require_reduce_scatter(backend, stage)
    try:  # a one-element probe: a backend without reduce_scatter fails here, not mid-backward
        comm.reduce_scatter(torch.zeros(1, device=device), torch.zeros(axis.size, device=device), axis,
                            purpose=comm.SETUP, native=True)  # a bucket past Gloo's all-to-all size takes it
    except (comm.CommError, RuntimeError) as exc:  # a CommError is a PlaitError, not a RuntimeError
        require_reduce_scatter(backend, stage, reason=str(exc).splitlines()[0])


def require_reduce_scatter(backend: str, stage: int, reason: str | None = None) -> None:
    """The error a user sees when `backend` lacks reduce_scatter (mpi does), or a probe failed."""
    if backend == "mpi" or reason:
        raise PlaitError(
            f"--zero {stage} needs reduce_scatter, which the {backend} backend does not provide"
            + (f" ({reason})" if reason else ""),
            hint="use --backend gloo (CPU) or --backend nccl (GPU), or drop --zero: "
                 "plain data parallelism needs only all_reduce")
