"""The real Trainer with ZeRO: `plait train --zero N` in miniature, inside the ZeRO world.

zero_parity.py calls `trainer_runs` after its own runs, so the one spawned world checks the
Trainer too: the tiny GPT with plait's DDP and with each ZeRO stage (`zero`, `offload` in its
config, as `plait train --zero N` sets them) on the same data; returns the records.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import plait.train.loop.trainer as trainer_module
from plait.bench.meter import model_state_bytes
from plait.families import family_of
from plait.parallel.zero.optim import ZeroOptimizer, zero_state_bytes
from plait.train.config.settings import TrainConfig


def train(config: TrainConfig, mesh: Any, stage: int, offload: bool) -> list[dict[str, Any]]:
    config = replace(config, zero=stage, offload=offload)
    trainer = trainer_module.Trainer(config, mesh, family_of(config).task(config))
    # The shards alone (not ZeRO-3's gathered units), to hold them to the paper's formula.
    trainer_module.model_state_bytes = lambda m, o: zero_state_bytes(m, o) if isinstance(o, ZeroOptimizer) \
        else model_state_bytes(m, o)
    trainer.run()
    trainer.sample()  # generation goes through the stage-3 hooks too
    return trainer.metrics.history


def trainer_runs(mesh: Any, out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every stage (and stage 3 with offload) through the Trainer; each run's history."""
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    config = TrainConfig(model="tiny", steps=4, micro_batch=2, grad_accum=2, seq_len=32, warmup_steps=2,
                         eval_every=2, eval_samples=8, sample_tokens=8, dp=mesh.size("dp"), nproc=mesh.size("dp"),
                         out=str(out))
    return {f"zero{stage}{'-offload' if offload else ''}": train(config, mesh, stage, offload)
            for stage, offload in ((0, False), (1, False), (2, False), (3, False), (3, True))}
