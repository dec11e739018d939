"""`apply_layout` (under `plait.parallelize`): apply the strategies the mesh's layout names, in one fixed order.

The layout (plait.layout: degrees, ZeRO stage and offload, SP, the pipeline's virtual
stages) comes with the mesh; `ParallelConfig` holds what is not a layout: bucket size,
recomputation, the reduce dtype, a tensor-parallel plan, SyncBatchNorm.

The order is the one every strategy assumes of the others, and any product of them runs:

0. make every BatchNorm a SyncBatchNorm over dp, if asked; route attention through context
   parallelism over cp (plait.parallel.context); mark the blocks that recompute their
   activations in backward, if asked (the model's adapter names its blocks);
1. shard layers across the tensor-parallel ranks (the whole model, so that every rank
   takes its slice of the same initial weights);
2. split the experts of a mixture of experts over the ep ranks (plait.parallel.expert: each
   keeps experts / ep and dispatches tokens by all-to-all; ep is carved out of dp);
   then check what 0-2 split against the whole model on a few tokens, recorded before any
   of it (plait.parallel.probe): a split that would train another model is refused here;
3. cut the result into pipeline stages and keep this rank's (`apply_pipeline`);
4. replicate or shard what is left across the data-parallel ranks: plain data parallelism
   (ZeRO stage 0) or ZeRO stages 1-3, over the stages when pipelined. The cp ranks hold
   different tokens of the same samples, so they join the dp ranks here (the mesh's dp_cp
   axis): the gradients are averaged, and ZeRO's shards cut, over dp × cp.

Each step reads the one before from the model itself (the tensor-parallel axis, the
pipeline's chunks), so the loss, the gradient norm and checkpoints need no other record.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.layout import Layout
from plait.parallel.clip import clip_grad_norm
from plait.parallel.compiled import apply_compile
from plait.parallel.fp8 import apply_fp8
from plait.parallel.context.plan import apply_context_parallel, context_of
from plait.parallel.data.sync import apply_data_parallel, grad_sync
from plait.parallel.deferred import is_meta
from plait.parallel.expert.dispatch import take_formula
from plait.parallel.expert.plan import apply_expert_parallel, expert_axis
from plait.parallel import probe
from plait.parallel.masters import MasterOptimizer
from plait.parallel.materialize import Source, materialize, placeholders
from plait.parallel.probe_copy import ReducedCopy, drop_stand_in, reduced_copy, register_stand_in
from plait.parallel.pipeline.runner import apply_pipeline
from plait.parallel.pipeline.split import is_pipeline
from plait.parallel.recompute import apply_recompute
from plait.parallel.seam import ModelAdapter, adapter_of, tensor_plan
from plait.parallel.data.syncbn import convert_sync_batchnorm
from plait.parallel.tensor.layers import sum_grad_over
from plait.parallel.tensor.plan import apply_tensor_parallel, tensor_parallel_of
from plait.parallel.zero.shard import with_edges
from plait.parallel.zero.stages import apply_zero, zero_of
from plait.parallel.zero.optim import ZeroOptimizer
from plait.rules import (BUCKET_MB, FP8_SCALINGS, OPTIMIZER_KERNELS, RECOMPUTE, check_bucket_mb, check_choice,
                         check_compile, check_compiled_update, check_fp8, check_recompute)
from plait.runtime.mesh import EXPERT, EXPERT_SYNC, REPLICATE, SHARD, SYNC, Mesh

log = logging.getLogger(__name__)

__all__ = ["ParallelConfig", "build_optimizer", "apply_layout", "clip_grad_norm"]


_LAYOUT_FIELDS = frozenset(f.name for f in fields(Layout))  # the mesh carries these, not ParallelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """What the strategies need besides the layout (which the mesh carries: plait.layout)."""

    bucket_mb: float = BUCKET_MB  # size of a gradient bucket: one all-reduce (or reduce-scatter) per bucket
    recompute: str = "none"  # "full": keep each block's input only, rerun the block in backward;
    # "selective": rerun only the attention core
    reduce_dtype: torch.dtype | None = None  # gradients cross dp in this dtype (None: their own)
    tp_plan: dict[str, str] | None = None  # {module-name pattern: style} for tp > 1 (default: the adapter's)
    sync_bn: bool = False  # BatchNorm statistics over the whole dp group (plait's SyncBatchNorm)
    compile: bool = False  # torch.compile each block's forward (plait.parallel.compiled)
    fp8: str = ""  # the blocks' linears multiply in float8 with this scaling (plait.parallel.fp8); "": not
    # The loss reads the head's logits split by vocabulary over tp (plait train's does): a head
    # the model's plan gathers whole stays split, sparing the gather and V/tp logits per rank.
    # False keeps the model's own (whole logits, for code that reads them).
    split_logits: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "ParallelConfig":
        # Code written for the earlier API passed the layout here (ParallelConfig(zero=3)): say
        # where those fields live now, before the generated __init__ raises a bare TypeError.
        moved = [name for name in kwargs if name in _LAYOUT_FIELDS]
        if moved:
            given = ", ".join(f"{name}={kwargs[name]!r}" for name in moved)
            raise PlaitError(f"ParallelConfig({given}): {' and '.join(moved)} "
                             f"{'is a layout field' if len(moved) == 1 else 'are layout fields'}, carried by the mesh",
                             hint=f"pass {'it' if len(moved) == 1 else 'them'} to plait.init_mesh({given}) (or in the "
                                  f"plait.Layout(...) given to init_mesh); ParallelConfig keeps "
                                  f"{', '.join(f.name for f in fields(cls))}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        check_bucket_mb(self.bucket_mb)
        check_choice("recompute", self.recompute, RECOMPUTE)
        if self.fp8:
            check_choice("fp8-scaling", self.fp8, FP8_SCALINGS)


def apply_layout(model: nn.Module, mesh: Mesh, config: ParallelConfig | None = None,
                 adapter: ModelAdapter | None = None, source: Source | None = None) -> nn.Module:
    """Apply the strategies of `mesh.layout` to `model`; return what this rank trains.
    (`plait.parallelize` is the public entry: it first finds a transformers model's adapter.)

    That is `model` itself (moved to this rank's device, changed in place), or with pp > 1
    the ModuleList of this rank's pipeline stages, for a `PipelineRunner`. Stages already
    cut by `apply_pipeline` (and a model already split by tp) are taken as they are.
    `adapter` tells the strategies what the model is made of (plait.parallel.seam: its
    blocks, where to cut it, its tp plan); by default the model's class says, or its module
    lists do. `config.tp_plan`, when given, replaces the adapter's plan.

    A model on the meta device (plait.parallel.deferred) is cut as it is, and then this
    rank's part of each tensor is filled from `source` (a name -> the whole tensor), on the
    device, before data parallelism or ZeRO: no rank ever holds the whole model. Its split is
    checked on a copy cut to one block of each kind (plait.parallel.probe_copy).
    """
    config, layout = config or ParallelConfig(), mesh.layout
    check_recompute(layout, config.recompute)
    adapter = adapter_of(model, adapter)
    meta = is_meta(model)
    if meta and source is None:
        raise PlaitError(f"{type(model).__name__} is on the meta device, and parallelize was given no source "
                         "of its weights", hint="pass source=, a function from a tensor's name to its values "
                                                "(e.g. the draw_named of plait.parallel.deferred.build_deferred)")
    splits, built = _splits_to_check(model, mesh), model
    tp_plan = config.tp_plan
    if meta and (splits or (mesh.size("pp") > 1 and not is_pipeline(model))):
        twin = _stand_in(model, mesh, adapter, source)
        tp_plan = _check_on_a_copy(model, twin, mesh, config, adapter, splits) if splits else tp_plan
        splits = ""
    if splits and not _on_device_for_probe(model, mesh.device):
        splits = ""
    tokens = probe.probe_tokens(mesh.size("tp") if layout.sp else 1, mesh.size("cp"))
    whole = probe.record(model, adapter, tokens) if splits else None  # before any split: the one-process model
    if config.sync_bn and mesh.size("dp") > 1 and convert_sync_batchnorm(model, mesh.axis("dp")) == 0:
        raise PlaitError(f"sync_bn is set, and {type(model).__name__} has no BatchNorm layers",
                         hint="drop sync_bn (or --sync-bn): there are no batch statistics to share")
    if mesh.size("cp") > 1 and context_of(model) is None:  # before recompute, which wraps the attention
        if is_pipeline(model):
            raise PlaitError("context parallelism is applied to the whole model, before the pipeline cut",
                             hint="pass the whole model to parallelize: it cuts the stages itself")
        apply_context_parallel(model, mesh.axis("cp"), layout.cp_kind, adapter)
    if config.recompute != "none":
        apply_recompute(model, config.recompute, adapter)
    cut = is_pipeline(model)  # stages from apply_pipeline: only DP or ZeRO is left to apply
    if config.compile:  # the blocks' forwards, compiled lazily: TP, the cut and ZeRO still apply
        check_compile(layout.schedule, layout.pp)
        if cut:
            raise PlaitError("compile is applied to the whole model's blocks, before the pipeline cut",
                             hint="pass the whole model to parallelize: it cuts the stages itself")
        apply_compile(adapter.blocks(model), mesh.device)
    if mesh.size("tp") > 1 and tensor_parallel_of(model) is None:
        if cut:
            raise PlaitError("tensor parallelism is applied to the whole model, before the pipeline cut",
                             hint="pass the whole model to parallelize: it cuts the stages itself")
        # TP broadcasts the whole model over tp before slicing it, so it moves to the device
        # first (NCCL sends device memory); without TP only this rank's stages move.
        if not meta:
            model.to(mesh.device)
        if tp_plan is None and config.split_logits:
            tp_plan = tensor_plan(model, adapter, mesh.size("tp"), layout.sp, split_logits=True)
        apply_tensor_parallel(model, mesh.axis("tp"), plan=tp_plan, sp=layout.sp, adapter=adapter)
    if mesh.size(EXPERT) > 1 and expert_axis(model) is None:
        if cut:
            raise PlaitError("expert parallelism is applied to the whole model, before the pipeline cut",
                             hint="pass the whole model to parallelize: it cuts the stages itself")
        apply_expert_parallel(model, mesh.axis(EXPERT), adapter)
    probe.check(model, whole, mesh.axis("world"), tp=mesh.axis("tp"), sp=layout.sp, what=splits, device=mesh.device)
    if whole is not None:
        take_formula(model)  # the probe's expert dispatches are set-up, as its ledger entries are
    if config.fp8:  # after the probe, which checks the splits against the whole bf16 model
        check_fp8(layout, config.fp8)
        if cut:
            raise PlaitError("fp8 is applied to the whole model's blocks, before the pipeline cut",
                             hint="pass the whole model to parallelize: it cuts the stages itself")
        apply_fp8(adapter.blocks(model), config.fp8, mesh.device)
    if mesh.size("pp") > 1 and not cut:
        model = apply_pipeline(model, mesh, virtual_stages=layout.virtual_stages, adapter=adapter)
    fill = None  # ZeRO-3 fills its shards from the source itself: no rank holds its share whole
    if meta and layout.zero == 3:
        fill = placeholders(model, mesh.device, source)
    elif meta:
        materialize(model, mesh.device, source)
    drop_stand_in(built)  # the checks that needed it have run
    model.to(mesh.device)
    if layout.zero == 0:
        apply_data_parallel(model, mesh.axis(SYNC), bucket_mb=config.bucket_mb, reduce_dtype=config.reduce_dtype,
                            expert_axis=mesh.axis(EXPERT_SYNC))
    else:
        units = with_edges(model, adapter.blocks(model)) if layout.zero == 3 and not is_pipeline(model) else None
        apply_zero(model, mesh.axis(SHARD), stage=layout.zero, offload=layout.offload, bucket_mb=config.bucket_mb,
                   units=units, reduce_dtype=config.reduce_dtype, prefetch=layout.prefetch,
                   reshard_after_forward=layout.reshard_after_forward, expert_axis=mesh.axis(EXPERT_SYNC),
                   replicate_axis=mesh.axis(REPLICATE), fill=fill)
    return model


def _stand_in(model: nn.Module, mesh: Mesh, adapter: ModelAdapter, source: Source) -> ReducedCopy:
    """A copy of the meta model with one block of each kind, filled from `source` under the
    model's names, that runs the checks needing a forward in its place (plait.parallel.probe_copy)."""
    twin = reduced_copy(model, adapter)
    materialize(twin.model, mesh.device, lambda name: source(twin.original(name)))
    register_stand_in(model, twin.model)
    return twin


def _check_on_a_copy(model: nn.Module, twin: ReducedCopy, mesh: Mesh, config: ParallelConfig,
                     adapter: ModelAdapter, splits: str) -> dict[str, str] | None:
    """The probe's check of cp, tp and ep on the meta model's stand-in; the parameters whose
    gradient it finds partial over tp are summed in every block of their kind of the model
    too. Returns the tp plan for the model: the one found on the whole stand-in (an SP plan's
    regions are found by a forward), widened to every block."""
    tokens = probe.probe_tokens(mesh.size("tp") if mesh.layout.sp else 1, mesh.size("cp"))
    whole = probe.record(twin.model, adapter, tokens)
    plan = config.tp_plan
    if mesh.size("tp") > 1 and plan is None:
        plan = tensor_plan(twin.model, adapter, mesh.size("tp"), mesh.layout.sp, config.split_logits)
    if mesh.size("cp") > 1:
        apply_context_parallel(twin.model, mesh.axis("cp"), mesh.layout.cp_kind, adapter)
    if mesh.size("tp") > 1:
        apply_tensor_parallel(twin.model, mesh.axis("tp"), plan=plan, sp=mesh.layout.sp, adapter=adapter)
    if mesh.size(EXPERT) > 1:
        apply_expert_parallel(twin.model, mesh.axis(EXPERT), adapter)
    partial = probe.check(twin.model, whole, mesh.axis("world"), tp=mesh.axis("tp"), sp=mesh.layout.sp,
                          what=splits, device=mesh.device)
    params = dict(model.named_parameters())
    for name in partial:
        for alike in twin.alike(twin.original(name)):
            sum_grad_over(params[alike], mesh.axis("tp"))
    if whole is not None:
        take_formula(twin.model)  # the probe's expert dispatches are set-up, as its ledger entries are
    return twin.widen(plan) if plan is not None and config.tp_plan is None else config.tp_plan


def _splits_to_check(model: nn.Module, mesh: Mesh) -> str:
    """The splits this call applies that change what a forward computes inside the model
    ("tp 2 + sp, ep 2"), which the probe checks; "" when none (the pipeline's cut has its own
    check, data parallelism and ZeRO hold the model whole in each forward)."""
    if is_pipeline(model):
        return ""
    layout, applied = mesh.layout, []
    if mesh.size("cp") > 1 and context_of(model) is None:
        applied.append(f"cp {mesh.size('cp')} ({layout.cp_kind})")
    if mesh.size("tp") > 1 and tensor_parallel_of(model) is None:
        applied.append(f"tp {mesh.size('tp')}" + (" + sp" if layout.sp else ""))
    if mesh.size(EXPERT) > 1 and expert_axis(model) is None:
        applied.append(f"ep {mesh.size(EXPERT)}")
    return ", ".join(applied)


def _on_device_for_probe(model: nn.Module, device: torch.device) -> bool:
    """The probe's collectives run on the mesh's device (NCCL sends device memory), so the
    whole model moves there first, as tensor parallelism moves it anyway; a model that does not
    fit there whole (it would only after the pipeline cut) is not probed, and the log says so."""
    if device.type == "cpu" or all(param.device == device for param in model.parameters()):
        return True
    whole = sum(param.numel() * param.element_size() for param in model.parameters())
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    if 2 * whole > free:
        log.warning("the split is not checked against the whole model: %.1f GiB of parameters do not fit on %s "
                    "whole (the pipeline cuts them later)", whole / 2**30, device)
        return False
    model.to(device)
    return True


def adamw_kernel(kernel: str, device: torch.device) -> dict[str, Any]:
    """torch.optim.AdamW's keywords for `kernel` (plait.rules.OPTIMIZER_KERNELS) on `device`.

    "fused" is one kernel over every tensor: on the 2-core CPU it halves the demo's update
    (benchmarks/optimizer.py), where foreach is slower than the loop. Where torch has no
    fused AdamW for the device, the fallback is foreach on accelerators and the loop on CPUs.
    Fused rounds a few last bits differently from the loop; every parity test holds with it,
    since one process and the layouts then run the same kernel."""
    check_choice("optimizer-kernel", kernel, OPTIMIZER_KERNELS)
    if kernel == "compiled":  # torch's fused kernel takes the steps the compiled pass does not (compiled_update.py)
        kernel = "fused"
    if kernel == "fused" and _has_fused_adamw(device.type):
        return {"fused": True}
    if kernel == "fused":
        kernel = "loop" if device.type == "cpu" else "foreach"
    return {"foreach": kernel == "foreach"}


@functools.cache
def _has_fused_adamw(device_type: str) -> bool:
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1, device=device_type))], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def build_optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer], compiled_update: bool = False,
                    **kwargs: Any) -> torch.optim.Optimizer:
    """Build `optimizer_class` over `model`'s parameters, the way the strategies need it.

    When `weight_decay` is given, one-dimensional parameters (norm scales, biases) are put in
    a group without decay, as is usual for transformers. With data parallelism, zero_grad
    drops the gradient buckets with the gradients, which are views into them (the next
    backward makes them again).
    With ZeRO, the result is a `ZeroOptimizer`: the same groups, over this rank's shards.
    Without ZeRO, 16-bit parameters get a `MasterOptimizer`: the same groups, over fp32 masters.
    `compiled_update` (`--optimizer-kernel compiled`) has either step its masters and 16-bit
    weights in one compiled pass (plait.parallel.compiled_update); it needs 16-bit weights.
    """
    sync = zero_of(model)
    params = sync.params if sync is not None else [p for p in model.parameters() if p.requires_grad]
    groups: Any = params
    if kwargs.get("weight_decay"):
        groups = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    if sync is not None:
        return ZeroOptimizer(sync, optimizer_class, groups if kwargs.get("weight_decay") else [{"params": params}],
                             compiled_update=compiled_update, **kwargs)
    sixteen_bit = any(p.dtype != torch.float32 for p in params)
    if compiled_update:
        check_compiled_update(sixteen_bit, offload=False)
    if sixteen_bit:
        optimizer = MasterOptimizer(groups if kwargs.get("weight_decay") else [{"params": params}],
                                    optimizer_class, compiled_update=compiled_update, **kwargs)
    else:
        optimizer = optimizer_class(groups, **kwargs)
    ddp = grad_sync(model)
    if ddp is not None:
        _zero_buckets_instead(optimizer, ddp)
    return optimizer


def _zero_buckets_instead(optimizer: torch.optim.Optimizer, sync: Any) -> None:
    """Replace zero_grad with the buckets' own: torch's would drop each .grad but not the buckets under them."""

    def zero_grad(set_to_none: bool = True) -> None:  # noqa: ARG001 - same signature as torch
        sync.zero_grad()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
