"""Helpers for the precision worlds: train the real Trainer on a layout, on any mesh."""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import replace
from typing import Any, Callable

import torch

from plait.families import family_of
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import Mesh, init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import finish
from plait.train.loop.trainer import Trainer

BASE = TrainConfig(model="tiny", steps=3, micro_batch=2, seq_len=32, warmup_steps=1, eval_every=0, eval_samples=4,
                   sample_tokens=0, loss_scale=1024.0)


def single_mesh() -> Mesh:
    """A one-process mesh inside a world: rank 0 computes the reference alone."""
    return init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))


def config(mesh: Mesh, out: str, **fields: Any) -> TrainConfig:
    shape = mesh.layout
    return replace(BASE, dp=shape.dp, tp=shape.tp, pp=shape.pp, nproc=shape.world, out=out, **fields)


def trainer_for(config: TrainConfig, mesh: Mesh) -> Trainer:
    """The Trainer `plait train` would build for `config` on `mesh` (its family's task)."""
    return Trainer(config, mesh, family_of(config).task(config))


def train(mesh: Mesh, out: str, before_step: Callable[[Trainer, int], None] | None = None,
          **fields: Any) -> dict[str, Any]:
    """Losses, scales and skips of a short run; `before_step(trainer, step)` may meddle first."""
    Path(out).mkdir(parents=True, exist_ok=True)
    trainer = trainer_for(config(mesh, out, **fields), mesh)
    if before_step is not None:
        real = trainer.guard.clip

        def guarded(step: int, *args: Any, **kwargs: Any) -> Any:
            before_step(trainer, step)
            return real(step, *args, **kwargs)

        trainer.guard.clip = guarded  # type: ignore[method-assign]
    trainer.run()
    summary, history = finish(trainer), trainer.metrics.history
    return {"losses": [r["loss"] for r in history], "grad_norms": [r["grad_norm"] for r in history],
            "scales": [r["loss_scale"] for r in history],
            "skipped": [r["skipped"] for r in history], "mem": history[-1]["mem"],
            "comm": history[-1]["comm"], "predicted": summary["predicted"], "summary_scale":
            summary["loss_scale"], "skipped_steps": summary["skipped_steps"], "trainer": trainer}


def public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "trainer"}


def snapshot(trainer: Trainer) -> list[torch.Tensor]:
    """Every parameter and every optimizer-state tensor this rank holds, copied."""
    tensors = [p.detach().clone() for p in trainer.model.parameters()]
    state = trainer.optimizer.state
    for key in list(state):
        tensors += [v.detach().clone() for v in state[key].values() if isinstance(v, torch.Tensor)]
    return tensors


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def poison(trainer: Trainer, value: float = math.inf, index: int = -1) -> str:
    """Put `value` into one element of the `index`-th gradient this rank holds; return its name."""
    from plait.parallel.precision import named_grads

    name, grad = named_grads(trainer.model)[index]
    grad.view(-1)[-1] = value
    return name
