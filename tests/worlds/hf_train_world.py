"""`plait train --model hf:DIR` in miniature, for families plait has no code for: 2 ranks.

argv: OUT CORPUS DIR... (local transformers directories: Qwen3, Mistral). For each, the real
Trainer (what `plait train` runs on every rank, its family record plait.families.hf.record) trains
3 AdamW steps under tp 2, pp 2 and dp 2 × ZeRO-3, and rank 0 alone trains the same global
batch in one process with 2 micro-batches. Each run reports its losses and gradient norms
and, on rank 0, its final weights' largest difference from the one-process run's.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from plait.families import family_of
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import final_weights
from plait.train.loop.trainer import Trainer
from tests.worldlib import save_report
from tests.worlds.hf_common import against_one_process

LAYOUTS = {"tp2": dict(tp=2, grad_accum=2), "pp2": dict(pp=2, grad_accum=2), "zero3": dict(dp=2, zero=3)}


def run(config: TrainConfig, mesh: Any) -> tuple[dict[str, list[float]], dict[str, torch.Tensor] | None]:
    """The run's losses and gradient norms per step, and its final weights (rank 0)."""
    trainer = Trainer(config, mesh, family_of(config).task(config))
    trainer.run()
    history = trainer.metrics.history
    return {"losses": [r["loss"] for r in history], "grad_norms": [r["grad_norm"] for r in history]}, \
        final_weights(trainer)


def main() -> None:
    out, corpus, dirs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    report = {}
    for directory in dirs:
        base = TrainConfig(model=f"hf:{directory}", data=corpus, steps=2, micro_batch=2, seq_len=16, eval_every=0,
                           eval_samples=4, sample_tokens=0, warmup_steps=1, lr=1e-3, nproc=1, dp=1)
        name = Path(directory).name
        configs = {layout: replace(base, **{"dp": 1, **fields}, nproc=2, out=str(out / name / layout))
                   for layout, fields in LAYOUTS.items()}
        report[name] = against_one_process(run, replace(base, grad_accum=2, out=str(out / name / "one")), configs)
    save_report(report)


if __name__ == "__main__":
    main()
