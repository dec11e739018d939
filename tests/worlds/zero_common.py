"""Shared by the ZeRO worlds: models, data, one training run with plait, references to compare with.

Every run trains `steps` optimizer steps on the same global batches. A plait run splits each
global batch across the dp ranks (and into micro-batches with accumulation); a reference
run sees the whole global batch in one process. Runs return plain numbers (JSON-able), and
the final parameters as tensors, so that the world script can compare and report them.
"""

from __future__ import annotations

import dataclasses

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.parallel.compiled_update import adamw_pass
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.clip import clip_grad_norm
from plait.parallel.zero.stages import full_parameters, zero_of
from plait.parallel.zero.optim import zero_state_bytes
from plait.runtime import comm
from plait.bench.meter import model_state_bytes
from plait.estimate.layout import Workload
from plait.estimate.memory import StateBytes, model_states
from plait.parallel.zero.shard import owned_range, shard_size

GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
CLIP = 0.1  # below the tiny GPT's gradient norm (~0.5), so clipping really scales
RTOL, ATOL = 1e-5, 1e-7  # SGD runs: atol for parameters that pass through zero (see test_zero_worlds)
ADAM_LR = 1e-3


def padded_state_bytes(stage: int, group_sizes: list[int], n: int, rank: int, per: StateBytes) -> dict[str, int]:
    """plait.estimate's model states to the byte, as this rank's flat buffers hold them:
    whole buffers and shards carry the padding that makes each group divide by n, and the
    optimizer state covers only the real elements this rank owns."""
    padded = sum(shard_size(m, n) * n for m in group_sizes)
    shards = sum(shard_size(m, n) for m in group_sizes)
    owned = sum(hi - lo for lo, hi in (owned_range(m, n, rank) for m in group_sizes))
    return {"params": per.param * (shards if stage >= 3 else padded),
            "grads": per.grad * (shards if stage >= 2 else padded), "optim": per.optim * owned}


def paper_states(stage: int, params: int, n: int, per: StateBytes) -> dict[str, int]:
    """plait.estimate's model states of `params` parameters (the ZeRO paper's (p + g + K)Ψ)."""
    states = model_states(params, 0, Workload(dp=n, zero=stage), per)
    return {kind: int(getattr(states, kind)) for kind in ("params", "grads", "optim")}


class UserMLP(nn.Module):
    """A model plait has never seen, with odd sizes so that shards need padding."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, 7)
        self.layers = nn.Sequential(nn.Linear(7, 10), nn.Tanh(), nn.Linear(10, 7), nn.GELU())
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(torch.tanh(self.inp(x))))


def make_model(kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """"gpt": the tiny preset (2 blocks); "deep": the same with 4 blocks, so that ZeRO-3's
    prefetch depth shows; "mlp": UserMLP."""
    if kind == "mlp":
        return UserMLP().to(dtype)
    config = get_preset("tiny")
    return build_gpt(dataclasses.replace(config, n_layers=4) if kind == "deep" else config, 0).to(dtype)


def batches(kind: str, steps: int = STEPS) -> list[torch.Tensor]:
    """Global batches: token rows (GPT) or feature rows whose last column is the class (MLP)."""
    gen = torch.Generator().manual_seed(1)
    if kind in ("gpt", "deep"):
        return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(steps)]
    return [torch.cat([torch.randn(GLOBAL_BATCH, 6, generator=gen),
                       torch.randint(0, 3, (GLOBAL_BATCH, 1), generator=gen).float()], 1) for _ in range(steps)]


def loss_fn(model: nn.Module, rows: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("gpt", "deep"):
        logits = model(rows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
    x = rows[:, :-1].to(next(model.parameters()).dtype)
    return F.cross_entropy(model(x).float(), rows[:, -1].long())


def make_optimizer(model: nn.Module, optim: str) -> torch.optim.Optimizer:
    if optim == "adamw":
        return plait.build_optimizer(model, torch.optim.AdamW, lr=ADAM_LR, weight_decay=0.1)
    if optim == "adamw-compiled":  # --optimizer-kernel compiled's pass, run eagerly: its arithmetic and wiring
        optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=ADAM_LR, weight_decay=0.1, compiled_update=True)
        optimizer.compiled.compiled = adamw_pass  # Inductor's C++ build is the unit test's (tests/test_precision.py)
        return optimizer
    return plait.build_optimizer(model, torch.optim.SGD, lr=0.5, momentum=0.9, weight_decay=0.1)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    with full_parameters(model):
        return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def build(mesh: Any, *, stage: int, kind: str = "gpt", offload: bool = False, optim: str = "adamw",
          dtype: torch.dtype = torch.float32, bucket_mb: float = 0.02, prefetch: int = 1,
          reshard: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer a run trains (stage 0 is plait's DDP)."""
    model = make_model(kind, dtype)
    layout = mesh.with_layout(zero=stage, offload=offload, prefetch=prefetch, reshard_after_forward=reshard)
    plait.parallelize(model, layout, plait.ParallelConfig(bucket_mb=bucket_mb))
    return model, make_optimizer(model, optim)


def train(mesh: Any, model: nn.Module, optimizer: torch.optim.Optimizer, rows_per_step: list[torch.Tensor], *,
          kind: str = "gpt", accum: int = 1) -> dict[str, Any]:
    """Optimizer steps on `rows_per_step`; this rank takes its share, in `accum` micro-batches."""
    n, r = mesh.size("dp"), mesh.rank("dp")
    out: dict[str, Any] = {"losses": [], "norms": [], "ledger": [], "events": []}
    local = GLOBAL_BATCH // n
    sync = zero_of(model)
    for rows in rows_per_step:
        before = mesh.ledger.snapshot()
        if sync is not None:
            sync.events.clear()
        total = 0.0
        for k, mb in enumerate(rows[r * local:(r + 1) * local].chunk(accum)):
            with plait.no_sync(model) if k < accum - 1 else contextlib.nullcontext():
                loss = loss_fn(model, mb, kind)
                (loss / accum).backward()
            total += loss.item() / accum
        out["norms"].append(clip_grad_norm(model, CLIP))
        optimizer.step()
        out["mem"] = zero_state_bytes(model, optimizer) if sync else model_state_bytes(model, optimizer)
        out["gathered"] = sync.peak_gathered_bytes if sync else 0  # stage 3: whole units held at once
        out["gathered_units"] = sync.peak_gathered_units if sync else 0  # ... and how many (the root aside)
        out["meter"] = model_state_bytes(model, optimizer)  # the trainer's meter, unchanged
        optimizer.zero_grad()
        out["ledger"].append(mesh.ledger.since(before).get("dp", {}))
        out["events"].append(list(sync.events) if sync else [])
        mean = torch.tensor([total], dtype=torch.float64)
        comm.all_reduce(mean, mesh.axis("dp"), purpose=comm.TELEMETRY)
        out["losses"].append(mean.item() / n)
    return out


def run_plait(mesh: Any, *, stage: int, kind: str = "gpt", accum: int = 1, offload: bool = False,
              optim: str = "adamw", dtype: torch.dtype = torch.float32, bucket_mb: float = 0.02,
              steps: int = STEPS, prefetch: int = 1,
              reshard: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train with plait; return the numbers (with the run's options) and the final parameters."""
    model, optimizer = build(mesh, stage=stage, kind=kind, offload=offload, optim=optim, dtype=dtype,
                             bucket_mb=bucket_mb, prefetch=prefetch, reshard=reshard)
    out = train(mesh, model, optimizer, batches(kind, steps), kind=kind, accum=accum)
    out.update(stage=stage, kind=kind, accum=accum, offload=offload, optim=optim, dtype=str(dtype),
               prefetch=prefetch, reshard=reshard)
    out["compiled_steps"] = optimizer.compiled.steps if getattr(optimizer, "compiled", None) else 0
    out["compiled_tensors"] = optimizer.compiled.tensors if getattr(optimizer, "compiled", None) else 0
    out["compiled_plans"] = optimizer.compiled.plans_made if getattr(optimizer, "compiled", None) else 0
    out["pieces"] = sum(len(part.pieces) for part in getattr(optimizer, "slices", []))
    sync = zero_of(model)
    out["groups"] = [sum(g.sizes) for g in sync.groups] if sync else []
    out["num_params"] = sum(out["groups"]) if sync else sum(p.numel() for p in model.parameters())
    return out, full_state(model)


def run_reference(*, kind: str = "gpt", optim: str = "adamw", dtype: torch.dtype = torch.float32,
                  steps: int = STEPS) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One process, whole global batch, plain torch (no plait strategy); bf16 keeps fp32 masters."""
    model = make_model(kind, dtype)
    params = [p for p in model.parameters()]
    masters = [p.detach().float().clone().requires_grad_() for p in params] if dtype != torch.float32 else params
    groups = [{"params": [m for m, p in zip(masters, params) if p.ndim >= 2]},
              {"params": [m for m, p in zip(masters, params) if p.ndim < 2], "weight_decay": 0.0}]
    if optim == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=ADAM_LR, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(groups, lr=0.5, momentum=0.9, weight_decay=0.1)
    out: dict[str, Any] = {"losses": [], "norms": []}
    for rows in batches(kind, steps):
        loss = loss_fn(model, rows, kind)
        loss.backward()
        for m, p in zip(masters, params):
            if m is not p:
                m.grad = p.grad.float()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                if m is not p:
                    p.copy_(m)
                    p.grad = None
        optimizer.zero_grad()
        out["losses"].append(loss.item())
    return out, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def loss_excess(got: list[float], want: list[float], rtol: float = RTOL) -> float:
    return max(abs(a - b) - rtol * abs(b) for a, b in zip(got, want))
