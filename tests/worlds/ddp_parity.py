"""A data-parallel world: plait's DDP against one process and against torch's DDP.

Every rank trains the same tiny GPT three ways on the same global batches:
  - plait DDP (this world's dp ranks), with and without gradient accumulation,
  - torch.nn.parallel.DistributedDataParallel, same split,
  - one process (computed on every rank, it is cheap) with grad-accum = dp,
and reports losses, final parameters, ledger bytes and the bucket launch order.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.data.sync import grad_sync
from tests.worldlib import save_report

SEQ, STEPS, SEED = 16, 4, 1234
torch.set_num_threads(1)


def global_batches(global_batch: int) -> torch.Tensor:
    """(STEPS, global_batch, SEQ + 1) random tokens, identical on every rank."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (STEPS, global_batch, SEQ + 1), generator=generator)


def loss_of(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


def train(model, opt, data, rank, size, micro, no_sync, ledger=None) -> dict:
    """Train STEPS steps; this rank takes the rank-th contiguous part of each global batch
    (the trainer's layout: one process with accumulation cuts micro-batches the same way)."""
    losses, per_step_comm, calls_mid_accum = [], [], []
    for step_rows in data:
        mine = step_rows.chunk(size)[rank]
        chunks = mine.split(micro)
        before = ledger.snapshot() if ledger else None
        total = 0.0
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            with contextlib.nullcontext() if last else no_sync(model):
                loss = loss_of(model, chunk)
                (loss / len(chunks)).backward()
            total += loss.item() / len(chunks)
            if ledger and not last:
                calls_mid_accum.append(ledger.calls() - sum(t.calls for (p, _, _), t in before.items() if p == "train"))
        if not per_step_comm and not losses:
            first_grads = torch.cat([p.grad.flatten() for p in model.parameters()]).tolist()
        opt.step()
        opt.zero_grad()
        mean = torch.tensor([total])
        if size > 1:
            torch.distributed.all_reduce(mean)
        losses.append(mean.item() / size)
        if ledger:
            per_step_comm.append(ledger.since(before))
    return {"losses": losses, "comm": per_step_comm, "calls_mid_accum": calls_mid_accum, "first_grads": first_grads}


def params_of(model: nn.Module) -> dict[str, list[float]]:
    return {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return plait.build_optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)


def main() -> None:
    mesh = plait.init_mesh()
    n, r = mesh.size("dp"), mesh.rank("dp")
    config = get_preset("tiny")
    report: dict = {"world": n, "num_params": config.num_params()}

    # One process, grad-accum = n: the reference every layout must reproduce.
    data = global_batches(2 * n)
    ref = build_gpt(config, SEED)
    ref_opt = torch.optim.AdamW(
        [{"params": [p for p in ref.parameters() if p.ndim >= 2]},
         {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=3e-3, weight_decay=0.1)
    report["single"] = train(ref, ref_opt, data, 0, 1, 2, plait.no_sync)
    report["single"]["params"] = params_of(ref)

    # plait DDP, one micro-batch of 2 per rank; small buckets so several launch in backward.
    model = plait.parallelize(build_gpt(config, SEED), mesh, plait.ParallelConfig(bucket_mb=0.05))
    report["plait"] = train(model, adamw(model), data, r, n, 2, plait.no_sync, mesh.ledger)
    report["plait"]["params"] = params_of(model)
    sync = grad_sync(model)
    report["buckets"] = len(sync.buckets)
    report["events"] = sync.events[: len(sync.buckets) + 1]

    # plait DDP with accumulation: micro-batch 1, two micro-batches per step, same global batch.
    model = plait.parallelize(build_gpt(config, SEED), mesh, plait.ParallelConfig())
    report["plait_accum"] = train(model, adamw(model), data, r, n, 1, plait.no_sync, mesh.ledger)
    report["plait_accum"]["params"] = params_of(model)

    # torch's DDP on the same model and split.
    native = nn.parallel.DistributedDataParallel(build_gpt(config, SEED))
    opt = torch.optim.AdamW(
        [{"params": [p for p in native.parameters() if p.ndim >= 2]},
         {"params": [p for p in native.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=3e-3, weight_decay=0.1)
    report["torch"] = train(native, opt, data, r, n, 1, lambda m: m.no_sync())
    report["torch"]["params"] = params_of(native.module)

    report["user_model"] = user_model_checks(mesh)
    save_report(report)
    mesh.close()


def user_model_checks(mesh) -> dict:
    """Any nn.Module: built with a different seed on each rank, it must start from rank 0's
    weights; an unused parameter must not hang the step and gets a zero gradient."""
    torch.manual_seed(100 + int(os.environ["RANK"]))
    model = Regressor()
    plait.parallelize(model, mesh)
    start = model.body[0].weight.detach().clone()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7 + mesh.rank("dp")))
    model(x).pow(2).mean().backward()
    return {"first_weight_sum": start.sum().item(), "unused_grad_abs": model.unused.weight.grad.abs().sum().item(),
            "grad_sum": model.body[0].weight.grad.sum().item()}


class Regressor(nn.Module):
    """A model plait has never seen, with one parameter that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


if __name__ == "__main__":
    main()
