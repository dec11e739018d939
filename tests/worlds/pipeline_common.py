"""Shared by the pipeline worlds: data, the one-process reference, plait's runner, torch's.

Every run trains the same tiny GPT for STEPS AdamW steps on the same micro-batches; the
reference does it in one process with gradient accumulation over all of them, so any
pipeline layout must reproduce its losses and its final parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.models.gpt.config import GPTConfig, get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.pipeline.runner import PipelineRunner, apply_pipeline, split_stages
from plait.parallel.pipeline.split import rank_stages
from plait.parallel.zero.stages import zero_of
from plait.runtime import comm
from tests.parity import PARAM_ATOL, assert_params_close

SEQ, MICRO, STEPS, SEED, LR, CLIP = 16, 2, 3, 1234, 3e-3, 1.0
PP_PARAM_RTOL = 1e-4  # PP sums the tied embedding's two halves in another order (docs/pipeline.md)
ZERO_PARAM_ATOL = 1e-5  # ZeRO reduces each micro-batch in another order: tests/matrix.py's "zero" row
torch.set_num_threads(1)


def gpt_config(layers: int, tied: bool = True) -> GPTConfig:
    return dataclasses.replace(get_preset("tiny"), n_layers=layers, tie_embeddings=tied)


def batches(m: int, dp: int = 1) -> torch.Tensor:
    """(STEPS, dp·m, MICRO, SEQ + 1) token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(SEED + m)
    return torch.randint(0, 256, (STEPS, dp * m, MICRO, SEQ + 1), generator=generator)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(module: nn.Module) -> torch.optim.Optimizer:
    return plait.build_optimizer(module, torch.optim.AdamW, lr=LR, weight_decay=0.1)


def train_reference(config: GPTConfig, data: torch.Tensor, clip: bool) -> dict[str, Any]:
    """One process, accumulating over every micro-batch of the step (all dp ranks' too)."""
    model = build_gpt(config, SEED)
    opt = adamw(model)
    losses = []
    for step in data:
        total = 0.0
        for rows in step:
            loss = loss_fn(model(rows[:, :-1]), rows[:, 1:])
            (loss / len(step)).backward()
            total += loss.item() / len(step)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"model": model, "losses": losses}


def train_plait(config: GPTConfig, mesh: Any, schedule: str, v: int, data: torch.Tensor,
                clip: bool, zero: int = 0) -> dict[str, Any]:
    """plait's runner on this rank's stages (and dp shard), as a trainer would drive it; with
    `zero`, ZeRO over dp instead of plain DDP, its events of the last step in "events"."""
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    stages = apply_pipeline(build_gpt(config, SEED), mesh, virtual_stages=v)
    plait.parallelize(stages, mesh.with_layout(zero=zero) if zero else mesh,  # plain DDP over dp when dp > 1
                      plait.ParallelConfig(bucket_mb=0.02) if zero else plait.ParallelConfig())
    opt = adamw(stages)
    runner = PipelineRunner(stages, mesh, schedule)
    sync = zero_of(stages) if zero else None
    losses: list[float] = []
    holding = watch_gradients(stages)
    for step in data:
        mine = step.chunk(dp)[dp_rank]
        before = mesh.ledger.snapshot()
        holding.clear()
        if sync is not None:
            sync.events.clear()
        loss = runner.step([r[:, :-1] for r in mine], [r[:, 1:] for r in mine], loss_fn)
        if clip:
            runner.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        step_comm = mesh.ledger.since(before)
        mean = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(mean, mesh.axis("dp"), purpose=comm.TELEMETRY)
        losses.append(mean.item() / dp)
    return {"stages": stages, "runner": runner, "losses": losses, "comm": step_comm,
            "events": [list(e) for e in sync.events] if sync is not None else [], "grads_at_forward": list(holding)}


def watch_gradients(stages: nn.ModuleList) -> list[tuple[int, list[int]]]:
    """A list each chunk-forward appends to: (its chunk, the rank's chunks holding a gradient
    at that moment), for a test to hold gradient-making to the order the estimate walks."""
    holding: list[tuple[int, list[int]]] = []

    def hook(k: int) -> Any:
        def before_forward(module: nn.Module, args: Any) -> None:
            holding.append((k, [j for j, chunk in enumerate(stages)
                                if any(p.grad is not None for p in chunk.parameters())]))
        return before_forward

    for k, chunk in enumerate(stages):
        chunk.register_forward_pre_hook(hook(k))
    return holding


def train_torch(config: GPTConfig, mesh: Any, schedule: str, v: int, data: torch.Tensor) -> dict[str, Any]:
    """torch.distributed.pipelining on the same stages, the same data, no clipping."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pp, rank = mesh.size("pp"), mesh.rank("pp")
    stages = rank_stages(split_stages(build_gpt(config, SEED), pp, virtual_stages=v), rank, pp)
    pipe_stages = [PipelineStage(stage, stage.index, pp * v, mesh.device, group=mesh.group("pp"))
                   for stage in stages]
    m = data.shape[1]
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
    first = pipe_stages[0] if schedule != "interleaved" else pipe_stages
    sched = kinds[schedule](first, n_microbatches=m, loss_fn=loss_fn)
    opt = adamw(stages)
    losses = []
    for step in data:
        full = step.flatten(0, 1)  # torch cuts the batch back into the same m micro-batches
        kwargs: dict[str, Any] = {}
        if any(s.is_last for s in stages):
            kwargs = {"target": full[:, 1:].contiguous(), "losses": (step_losses := [])}
        if rank == 0:  # contiguous: torch 2.11's stages check the strides they inferred
            sched.step(full[:, :-1].contiguous(), **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        opt.zero_grad()
        losses.append(sum(x.item() for x in step_losses) / m if kwargs else None)
    return {"stages": stages, "losses": losses}


def param_error(stages: nn.ModuleList, reference: nn.Module, rtol: float = PP_PARAM_RTOL,
                atol: float = PARAM_ATOL) -> str:
    """'' when this rank's stage parameters match the reference's, else the mismatch."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    actual, expected = {}, {}
    for stage in stages:
        for name, param in stage.named_parameters():
            full = stage.global_name(name)
            actual[full] = param.detach().flatten().tolist()
            expected[full] = ref[full].detach().flatten().tolist()
    try:
        assert_params_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as err:
        return str(err)[:400]
    return ""


def max_param_diff(a: nn.ModuleList, b: nn.ModuleList) -> float:
    """Largest |a - b| over the parameters of two copies of this rank's stages."""
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))
