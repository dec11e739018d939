"""Pipeline parallelism: cut the model into stages and run any schedule across the pp ranks.

    stages = plait.parallelize(build_gpt(config, seed), mesh, config)  # TP, the cut, DP or ZeRO
    runner = PipelineRunner(stages, mesh, schedule="1f1b")
    loss = runner.step(micro_inputs, micro_targets, loss_fn)    # every pp rank, once per step
    plait.clip_grad_norm(stages, 1.0); optimizer.step(); optimizer.zero_grad()

The schedule is data (plait/schedule/build.py); the runner walks this rank's list of actions and does
what each says. Everything else is bookkeeping around that loop: activations and gradients
cross stage boundaries as point-to-point messages (`comm.py`), each action is
timed so the bubble can be measured, and after the last action the step's gradients are
reduced over dp (DDP and ZeRO-1 once; ZeRO-2 and -3 reduced each backward into their
shards) and added between the two copies of a tied embedding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.packed import Packed
from plait.parallel.data.sync import grad_sync, no_sync
from plait.parallel.pipeline.p2p import (BufferPool, Channels, Key, add_from_peer, agree_shapes,
                                         delivery_proofs, send_order, sum_tied_grads)
from plait.parallel.pipeline.execute import LossFn, PipelineStats, StageWork, StepRun
from plait.parallel.applied import hand_over
from plait.parallel.pipeline.split import (PipelineStage, check_split, rank_stages, split_stages,
                                           tied_copies)
from plait.schedule.build import Schedule, build_schedule, validate
from plait.schedule.timeline import Slot, Timeline
from plait.parallel.tensor.plan import tensor_parallel_of
from plait.parallel.zero.stages import zero_of
from plait.rules import SPLIT_BACKWARD, check_split_backward
from plait.runtime import comm
from plait.parallel.deferred import is_meta
from plait.runtime.mesh import Mesh

__all__ = ["PipelineRunner", "PipelineStage", "PipelineStats", "apply_pipeline", "check_pipeline",
           "check_split", "split_stages"]


def apply_pipeline(model: nn.Module, mesh: Mesh, *, virtual_stages: int | None = None,
                   balance: Sequence[int] | None = None, adapter: Any = None) -> nn.ModuleList:
    """This rank's stages of `model` (v chunks, in chunk order: the layout's virtual stages
    and cut (--stage-layers) unless given), moved to its device.

    Tensor parallelism, if any, is applied to the whole model before (its layers are cut
    as they are); data parallelism or ZeRO to the returned ModuleList after: the stages of
    the other ranks are dropped with `model`. `adapter` says where to cut and how a stage
    runs (plait.parallel.seam; default: the model class's, or an nn.Sequential's children).
    """
    pp, virtual_stages = mesh.size("pp"), virtual_stages or mesh.layout.virtual_stages
    if balance is None and mesh.layout.stage_layers and virtual_stages == mesh.layout.virtual_stages:
        balance = mesh.layout.stage_layers  # the layout's cut (--stage-layers), as its estimate prices it
    info = tensor_parallel_of(model)
    seq_split = info.axis.size if info is not None and info.sp else 1
    stages = split_stages(model, pp, virtual_stages=virtual_stages, balance=balance, seq_split=seq_split,
                          adapter=adapter)
    held = rank_stages(stages, mesh.rank("pp"), pp)
    if not is_meta(held):  # a meta model's stages are materialised on the device by parallelize
        held.to(mesh.device)
    # The stage list carries what was applied to the whole model (tp, cp, ep): the same record.
    hand_over(model, held, mesh.axis("pp"))
    return held


def check_pipeline(n_layers: int, pp: int, schedule: str, microbatches: int, *, virtual_stages: int = 1,
                   balance: Sequence[int] | None = None) -> None:
    """Raise PlaitError if this layout cannot run; pure, so a config is checked before spawning."""
    check_split(n_layers, pp, virtual_stages=virtual_stages, balance=balance)
    build_schedule(schedule, pp, microbatches, virtual_stages)


ScheduleBuilder = Callable[[int, int, int], Schedule]  # (pp, m, v) -> one action list per rank


@dataclass(frozen=True)
class _Plan:
    """A schedule for one micro-batch count, and who sends whom what, in which order."""

    schedule: Schedule
    order: dict[tuple[int, int], list[Key]]
    proofs: dict[int, dict[Key, int]]  # delivery_proofs: when a sent message can go


class PipelineRunner:
    """Runs a pipeline schedule over this rank's stages, one optimizer step per `step` call."""

    def __init__(self, stages: nn.ModuleList | Sequence[nn.Module], mesh: Mesh,
                 schedule: str | ScheduleBuilder | None = None, *, measure: bool = True):
        """`schedule` is the layout's (mesh.layout.schedule) unless given: a name from
        plait.rules.SCHEDULES or any function (pp, m, v) -> Schedule; `measure` times every
        action and gathers the timeline (two tiny collectives a step)."""
        schedule = schedule or mesh.layout.schedule
        self.mesh, self.axis = mesh, mesh.axis("pp")
        self.pp, self.rank = self.axis.size, self.axis.rank
        if not isinstance(stages, nn.ModuleList) and any(grad_sync(s) or zero_of(s) for s in stages):
            raise PlaitError("pass the ModuleList that parallelize (or apply_pipeline) returned, not a list "
                             "of its stages: data parallelism and ZeRO are attached to the ModuleList")
        self.module = stages if isinstance(stages, nn.ModuleList) else nn.ModuleList(stages)
        self.v = len(self.module)
        self.num_stages = self.pp * self.v
        self.schedule_name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "custom")
        self._build: ScheduleBuilder = (schedule if callable(schedule)
                                        else lambda pp, m, v: build_schedule(schedule, pp, m, v))
        self.measure = measure
        probe = self._build(self.pp, self.pp, self.v)  # fails now on a bad name or v
        split = any(a.kind in "IW" for row in probe for a in row)
        _check_split_backward(self.module, split)
        sync = zero_of(self.module)
        gathered = sync.gathered_storages if sync is not None else set
        self.work = [StageWork(stage, split_backward=split, gathered_weights=gathered) for stage in self.module]
        self.pool = BufferPool(mesh.device)
        self._plans: dict[int, _Plan] = {}
        self._shapes: dict[tuple, dict] = {}
        self.last_timeline: Timeline | None = None
        self.last_stats: PipelineStats | None = None

    # -- the step ------------------------------------------------------------------------------
    def step(self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor],
             loss_fn: LossFn) -> float:
        """Forward and backward every micro-batch; return the mean loss (on every pp rank).

        Every pp rank passes the same micro-batches: the first stage reads the inputs, the
        last the targets, the others only their number and shape. Gradients are left summed
        over micro-batches (as loss / m), averaged over dp (in `.grad`, or in ZeRO's shards),
        and the tied embedding's two copies hold the same sum.
        """
        plan = self._plan(len(micro_inputs), micro_inputs)
        actions = plan.schedule[self.rank]
        shapes = self._agree(micro_inputs[0])
        channels = Channels(self.axis, plan.order, lambda key: self._shape_of(key, shapes), self.pool,
                            plan.proofs.get(self.rank))
        run = self._run(channels, micro_inputs, micro_targets, loss_fn)
        origin = self._barrier()
        with no_sync(self.module):
            slots = [run.do(act, actions[i + 1] if i + 1 < len(actions) else None, origin)
                     for i, act in enumerate(actions)]
        channels.finish()
        self._reduce_dp()
        self._sum_tied()
        self.last_stats = run.stats(slots)
        if self.measure:
            self.last_timeline = self._gather_timeline(plan.schedule, slots)
        return self._broadcast_loss(run.losses, len(micro_inputs))

    @torch.no_grad()
    def eval_loss(self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor],
                  loss_fn: LossFn) -> float:
        """Mean loss over the micro-batches, forwards only (the schedule's F actions, in order)."""
        losses = self._forwards(micro_inputs, micro_targets, loss_fn)
        return self._broadcast_loss(list(losses.values()), len(micro_inputs))

    @torch.no_grad()
    def eval_rows(self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor],
                  rows_fn: LossFn, width: int) -> torch.Tensor:
        """`rows_fn(outputs, targets)` of every micro-batch, (batch, width) each, stacked to
        (m, batch, width) in float64 on every pp rank: what evaluation sums per sample."""
        kept = self._forwards(micro_inputs, micro_targets, lambda out, targets: rows_fn(out, targets).double())
        shape = (len(micro_inputs), micro_targets[0].shape[0], width)
        rows = torch.stack([kept[i] for i in sorted(kept)]) if kept else torch.zeros(shape, dtype=torch.float64)
        rows = rows.to(self.mesh.device)
        comm.broadcast(rows, self.axis, src=self.pp - 1, purpose=comm.TELEMETRY)
        return rows

    def _forwards(self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor],
                  loss_fn: LossFn) -> dict[int, torch.Tensor]:
        """Run the schedule's forwards; the last stage's loss_fn results by micro-batch."""
        plan = self._plan(len(micro_inputs), micro_inputs, forward_only=True)
        shapes = self._agree(micro_inputs[0])
        channels = Channels(self.axis, plan.order, lambda key: self._shape_of(key, shapes), self.pool,
                            plan.proofs.get(self.rank))
        run = self._run(channels, micro_inputs, micro_targets, loss_fn)
        for act in plan.schedule[self.rank]:
            run.do(act, None, 0.0)
        channels.finish()
        return run.loss_of

    @torch.no_grad()
    def last_logits(self, ids: torch.Tensor, position: int = -1) -> torch.Tensor | None:
        """Logits at `position` of `ids` (batch, seq): one forward through every stage, for
        sampling. On the last stage's ranks (a vocab shard under TP); None on the others."""
        kept: list[torch.Tensor] = []

        def keep(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            kept.append(logits[:, position])
            return logits.new_zeros(())

        self.eval_loss([ids], [ids], keep)
        return kept[0] if kept else None

    def clip_grad_norm_(self, max_norm: float) -> float:
        """An alias of `plait.clip_grad_norm(stages, max_norm)`: the norm of the whole
        model's gradient (all stages, the tied embedding once, tp slices and ZeRO shards
        summed), clipped to `max_norm`; returns the norm before clipping."""
        from plait.parallel.clip import clip_grad_norm

        return clip_grad_norm(self.module, max_norm)

    def _run(self, channels: Channels, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
             loss_fn: LossFn) -> StepRun:
        return StepRun(self.work, self.rank, self.pp, channels, inputs, targets, loss_fn, self.mesh.device)

    # -- planning --------------------------------------------------------------------------
    def _plan(self, m: int, micro_inputs: Sequence[torch.Tensor], forward_only: bool = False) -> _Plan:
        if m < 1 or len({tuple(x.shape) for x in micro_inputs}) != 1:
            raise PlaitError(f"a pipeline step needs micro-batches of one shape; got "
                             f"{sorted({tuple(x.shape) for x in micro_inputs})}")
        key = -m if forward_only else m
        if key not in self._plans:
            schedule = self._build(self.pp, m, self.v)
            validate(schedule, self.pp, m, self.v)
            if forward_only:  # the F's of a valid schedule, in its order, cannot deadlock either
                schedule = [[a for a in row if a.kind == "F"] for row in schedule]
            self._plans[key] = _Plan(schedule, send_order(schedule, self.pp, self.v),
                                    delivery_proofs(schedule, self.pp, self.v))
        return self._plans[key]

    def _agree(self, first_input: Any) -> dict:
        if isinstance(first_input, Packed):  # the shapes are the ids' (the documents change no shape)
            first_input = first_input.ids
        device = self.mesh.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        key = (tuple(first_input.shape), first_input.dtype, autocast)
        if key not in self._shapes:
            mine = {chunk * self.pp + self.rank: stage for chunk, stage in enumerate(self.module)}
            self._shapes[key] = agree_shapes(mine, self.axis, self.num_stages, first_input.to(self.mesh.device))
        return self._shapes[key]

    @staticmethod
    def _shape_of(key: Key, shapes: dict) -> tuple:
        kind, _, stage = key
        return shapes[stage - 1] if kind == "act" else shapes[stage]

    # -- after the schedule ------------------------------------------------------------------
    def _reduce_dp(self) -> None:
        """Reduce the step's summed gradients over dp, once: plait's DDP buckets, or ZeRO-1's
        reduce-scatter (ZeRO-2 and 3 reduced each backward into their shards already).

        Every backward ran under no_sync: with I and W split, weight gradients arrive in many
        small backward calls, and DDP's end-of-backward hook would fire after each one.
        """
        sync = grad_sync(self.module)
        if sync is not None:
            sync.sync_now()

    def _sum_tied(self) -> None:
        """Add the gradients of the tied embedding's two copies, on the first and last rank.

        Under ZeRO each copy is a flat group of its own, cut alike on both ranks, so the
        dp rank's two gradient shards line up and are added the same way.
        """
        peer = self.pp - 1 if self.rank == 0 else 0
        sync = zero_of(self.module)
        for weight in sync.tied if sync is not None else tied_copies(self.module):
            if sync is not None:
                add_from_peer(sync.group_of(weight).grad_shard, self.axis, peer)
            else:
                sum_tied_grads(weight, self.axis, peer)

    def _barrier(self) -> float:
        """A tiny all-reduce lines the ranks up, so that their clocks start together."""
        if self.measure and self.pp > 1:
            comm.all_reduce(torch.zeros(1, device=self.mesh.device), self.axis, purpose=comm.TELEMETRY)
        return time.perf_counter()

    def _broadcast_loss(self, losses: list[torch.Tensor], m: int) -> float:
        """The last stage's mean loss, to every pp rank (one sync per step, not per micro-batch)."""
        value = torch.zeros(1, dtype=torch.float64, device=self.mesh.device)
        if losses:
            value += torch.stack(losses).double().sum() / m
        comm.broadcast(value, self.axis, src=self.pp - 1, purpose=comm.TELEMETRY)
        return value.item()

    def _gather_timeline(self, schedule: Schedule, slots: list[Slot]) -> Timeline:
        """Every rank's measured slots (all ranks run the same number of actions)."""
        local = torch.tensor([[s.start, s.end] for s in slots], dtype=torch.float64, device=self.mesh.device)
        stacked = torch.empty((self.pp, *local.shape), dtype=torch.float64, device=self.mesh.device)
        comm.all_gather(stacked.flatten(0, 1), local, self.axis, purpose=comm.TELEMETRY)
        rows = tuple(tuple(Slot(act, float(t[0]), float(t[1])) for act, t in zip(schedule[r], stacked[r].tolist()))
                     for r in range(self.pp))
        return Timeline(pp=self.pp, v=self.v, rows=rows)


def _check_split_backward(module: nn.Module, split_backward: bool) -> None:
    """What cannot run a schedule whose backward is split into I and W (zb-h1): the rule is
    plait.rules', asked of what the stages actually carry (a user may build them by hand)."""
    if not split_backward:
        return
    recomputes = any(getattr(m, "recompute", False) is True for m in module.modules())
    sync = zero_of(module)
    check_split_backward(SPLIT_BACKWARD[0], zero=sync.stage if sync is not None else 0,
                         recompute="full" if recomputes else "none")
