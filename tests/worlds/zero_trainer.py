"""The real Trainer with ZeRO: `plait train --nproc 4 --zero N` in miniature.

Until the trainer has `zero`/`offload` fields, this patches the three places its integration
changes (docs/zero.md, "Trainer integration"): the ParallelConfig it builds, the clipping
function and the memory meter. Once it has them, only the settings are passed. Trains the
tiny GPT with plait's DDP and with each ZeRO stage on the same data; reports the records.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import plait.train.trainer as trainer_module
from plait.parallel.compose import ParallelConfig
from plait.parallel.clip import clip_grad_norm
from plait.parallel.zero_optim import ZeroOptimizer, zero_state_bytes
from plait.runtime.mesh import init_mesh
from plait.train.config import TrainConfig
from plait.train.meter import model_state_bytes
from tests.worldlib import save_report


def train(config: TrainConfig, mesh: Any, stage: int, offload: bool) -> list[dict[str, Any]]:
    if hasattr(config, "zero"):  # the trainer knows ZeRO
        config = replace(config, zero=stage, offload=offload)
    else:
        trainer_module.ParallelConfig = functools.partial(ParallelConfig, zero=stage, offload=offload)
    trainer = trainer_module.Trainer(config, mesh)
    real_clip = torch.nn.utils.clip_grad_norm_
    if stage:  # (stage 0: plait.parallel.zero.clip_grad_norm is torch's own)
        torch.nn.utils.clip_grad_norm_ = lambda params, max_norm: torch.tensor(clip_grad_norm(trainer.model, max_norm))
    trainer_module.model_state_bytes = lambda m, o: zero_state_bytes(m, o) if isinstance(o, ZeroOptimizer) \
        else model_state_bytes(m, o)
    try:
        trainer.run()
        trainer.sample_text()  # generation goes through the stage-3 hooks too
    finally:
        torch.nn.utils.clip_grad_norm_ = real_clip
    return trainer.history


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    mesh = init_mesh()
    torch.set_num_threads(1)
    config = TrainConfig(model="tiny", steps=4, micro_batch=2, grad_accum=2, seq_len=32, warmup_steps=2,
                         eval_every=2, eval_samples=8, sample_tokens=8, dp=mesh.size("dp"), nproc=mesh.size("dp"),
                         out=str(out))
    report = {f"zero{stage}{'-offload' if offload else ''}": train(config, mesh, stage, offload)
              for stage, offload in ((0, False), (1, False), (2, False), (3, False), (3, True))}
    save_report(report)
    mesh.close()


if __name__ == "__main__":
    main()
