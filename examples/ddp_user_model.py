"""Your own model under plait's data parallelism: the README's API loop, complete.

    plait launch --nproc 2 examples/ddp_user_model.py          # 2 ranks (or torchrun, srun)
    plait launch --nproc 1 examples/ddp_user_model.py          # 1 rank, 2 micro-batches: the same model
    plait launch --nproc 2 examples/ddp_user_model.py --zero 3 # ZeRO-3 instead of DDP

A small regression MLP on a synthetic dataset. Every rank builds the same model from the
seed; `plait.shard_indices` deals each epoch's samples out so that the global batch is the
same whatever the number of ranks (each rank takes its share as micro-batches), and gradient
accumulation syncs only on the last micro-batch. Rank 0 prints each step's loss (the mean
over ranks) and, at the end, what went over the wire.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn

import plait

GLOBAL_BATCH, STEPS, SEED = 16, 6, 0


class Regressor(nn.Module):
    """Any nn.Module: plait's data parallelism and ZeRO need nothing from it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 32)])
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x).squeeze(-1)


def dataset(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, 8, generator=generator)
    return x, x.sin().sum(-1) + 0.1 * torch.randn(n, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage (0: plait's DDP)")
    args = parser.parse_args()

    mesh = plait.init_mesh(zero=args.zero)  # dp = the world size; the layout is checked here
    torch.manual_seed(SEED)
    model = plait.parallelize(Regressor(), mesh, plait.ParallelConfig(bucket_mb=1))
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    x, y = dataset()
    dp, micro = mesh.size("dp"), 4
    accum = GLOBAL_BATCH // (dp * micro)  # micro-batches per rank and step: the global batch stays 16
    steps_per_epoch = len(x) // GLOBAL_BATCH
    for step in range(STEPS):
        epoch, at = divmod(step, steps_per_epoch)
        mine = plait.shard_indices(len(x), mesh, seed=SEED, epoch=epoch, block=micro * accum)
        indices = mine[at * micro * accum:(at + 1) * micro * accum]
        total = torch.zeros((), dtype=torch.float64)
        for k in range(accum):
            batch = indices[k * micro:(k + 1) * micro]
            # Only the last micro-batch syncs gradients; the others accumulate locally.
            with plait.no_sync(model) if k < accum - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x[batch]), y[batch])
                (loss / accum).backward()
            total += loss.detach().double() / accum
        plait.clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if dp > 1:  # the mean over ranks, for printing
            torch.distributed.all_reduce(total)
        if mesh.is_main:
            print(f"step {step + 1} loss {total.item() / dp:.6f}", flush=True)
    if mesh.is_main:
        print(f"wire bytes per axis and op: {mesh.ledger.wire()}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
