"""The real Trainer with ZeRO: `plait train --zero N` in miniature, inside the ZeRO world.

zero_parity.py calls `trainer_runs` after its own runs, so the one spawned world checks the
Trainer too. Until the trainer has `zero`/`offload` fields, this patches the three places its
integration changes (docs/zero.md, "Trainer integration"): the ParallelConfig it builds, the
clipping function and the memory meter. Once it has them, only the settings are passed. Trains
the tiny GPT with plait's DDP and with each ZeRO stage on the same data; returns the records.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import plait.train.trainer as trainer_module
from plait.parallel.compose import ParallelConfig
from plait.parallel.clip import clip_grad_norm
from plait.parallel.zero.optim import ZeroOptimizer, zero_state_bytes
from plait.train.config import TrainConfig
from plait.bench.meter import model_state_bytes


def train(config: TrainConfig, mesh: Any, stage: int, offload: bool) -> list[dict[str, Any]]:
    if hasattr(config, "zero"):  # the trainer knows ZeRO
        config = replace(config, zero=stage, offload=offload)
    else:
        trainer_module.ParallelConfig = functools.partial(ParallelConfig, zero=stage, offload=offload)
    trainer = trainer_module.Trainer(config, mesh)
    real_clip = torch.nn.utils.clip_grad_norm_
    if stage:  # (stage 0: plait.parallel.zero.stages.clip_grad_norm is torch's own)
        torch.nn.utils.clip_grad_norm_ = lambda params, max_norm: torch.tensor(clip_grad_norm(trainer.model, max_norm))
    trainer_module.model_state_bytes = lambda m, o: zero_state_bytes(m, o) if isinstance(o, ZeroOptimizer) \
        else model_state_bytes(m, o)
    try:
        trainer.run()
        trainer.sample_text()  # generation goes through the stage-3 hooks too
    finally:
        torch.nn.utils.clip_grad_norm_ = real_clip
    return trainer.history


def trainer_runs(mesh: Any, out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every stage (and stage 3 with offload) through the Trainer; each run's history."""
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    config = TrainConfig(model="tiny", steps=4, micro_batch=2, grad_accum=2, seq_len=32, warmup_steps=2,
                         eval_every=2, eval_samples=8, sample_tokens=8, dp=mesh.size("dp"), nproc=mesh.size("dp"),
                         out=str(out))
    return {f"zero{stage}{'-offload' if offload else ''}": train(config, mesh, stage, offload)
            for stage, offload in ((0, False), (1, False), (2, False), (3, False), (3, True))}
