"""Expert parallelism under ZeRO: 4 ranks, one spawn, the checks of plait.parallel.zero with experts.

argv: OUT CORPUS.
1. The real Trainer (what `plait train --ep N --zero K` runs) on plait's MoE GPT, both
   routers, under dp 4 × ep 2 with ZeRO 1, 2 and 3, and dp 4 × ep 4 with ZeRO 3; rank 0
   alone trains the same global batch in one process (accumulation 4). Losses and gradient
   norms every step, final weights elementwise; which axis each flat group is cut over, and
   the elements each rank owns (every trainable element owned once over the 4 ranks).
2. A checkpoint written at ep 2 ZeRO 3 (after step 1 of the sigmoid router's run above)
   resumed at ep 1 ZeRO 0 and at ep 4 ZeRO 1.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from plait.families import family_of
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import final_weights
from plait.train.loop.trainer import Trainer
from tests.parity import weight_excess
from tests.worldlib import save_report

LAYOUTS = {
    "ep2-zero1": dict(dp=4, ep=2, zero=1),
    "ep2-zero2": dict(dp=4, ep=2, zero=2),
    "ep2-zero3": dict(dp=4, ep=2, zero=3),
    "ep4-zero3": dict(dp=4, ep=4, zero=3),
}
SAVES = "ep2-zero3"  # the layout whose run also writes a checkpoint after each step
# make test's runs, by router; make test-all's (--extras) the rest
FAST = {"softmax": ("ep2-zero1", "ep2-zero3", "ep4-zero3"), "sigmoid": ("ep2-zero3",)}
EXTRA = {"softmax": ("ep2-zero2",), "sigmoid": ("ep2-zero1", "ep2-zero2", "ep4-zero3")}
MODELS = {"softmax": "tiny-moe", "sigmoid": "tiny-moe,router=sigmoid,bias_rate=0.01"}


def train(config: TrainConfig, mesh: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Losses, gradient norms and ZeRO's groups of one run; the whole weights (rank 0)."""
    trainer = Trainer(config, mesh, family_of(config).task(config))
    trainer.run()
    history = trainer.metrics.history
    found = {"losses": [r["loss"] for r in history], "norms": [r["grad_norm"] for r in history]}
    sync = getattr(trainer.optimizer, "sync", None)
    if sync is not None:
        found["groups"] = [[g.axis.name, g.n, g.shard_name] for g in sync.groups]
        found["owned"] = sum(hi - lo for lo, hi in (g.owned() for g in sync.groups))
    return found, final_weights(trainer)


def family_runs(base: TrainConfig, out: Path, rank: int, layouts: tuple[str, ...], save: bool = False
                ) -> dict[str, Any]:
    found: dict[str, Any] = {}
    reference = None
    if rank == 0:
        one = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
        found["one"], reference = train(replace(base, grad_accum=4, nproc=1, dp=1, out=str(out / "one")), one)
        found["one"]["numel"] = sum(v.numel() for k, v in reference.items() if not k.endswith("expert_bias"))
    for name in layouts:
        config = replace(base, **LAYOUTS[name], nproc=4, out=str(out / name), save_every=int(save and name == SAVES))
        found[name], weights = train(config, init_mesh(config.layout))
        if rank == 0:
            found[name]["excess"] = weight_excess(weights, reference)
    return found


def resumed(base: TrainConfig, out: Path) -> dict[str, Any]:
    """The checkpoint of step 1 at ep 2 ZeRO 3 (dp 4); step 2 resumed at ep 1 ZeRO 0 and ep 4 ZeRO 1."""
    checkpoint = str(out / SAVES / "checkpoints" / "step-00000001")
    found = {}
    for name, fields in {"ep1-zero0": dict(ep=1, zero=0), "ep4-zero1": dict(ep=4, zero=1)}.items():
        config = replace(base, dp=4, **fields, nproc=4, resume=checkpoint, out=str(out / f"resumed-{name}"))
        found[name] = train(config, init_mesh(config.layout))[0]["losses"]
    return found


def run_all(out: Path, corpus: str, rank: int, extras: bool = False) -> dict[str, Any]:
    """Every check of this world (make test's, or with `extras` make test-all's other
    layouts); tests/worlds/moe_world.py runs it in its own spawn."""
    report: dict[str, Any] = {}
    common = dict(data=corpus, steps=2, micro_batch=2, seq_len=16, eval_every=0, eval_samples=4, sample_tokens=0,
                  warmup_steps=1, lr=1e-3)
    bases = {name: TrainConfig(model=model, **common) for name, model in MODELS.items()}
    for name, base in bases.items():
        report[name] = family_runs(base, out / name, rank, (EXTRA if extras else FAST)[name],
                                   save=name == "sigmoid" and not extras)
    if not extras:
        report["resumed"] = resumed(bases["sigmoid"], out / "sigmoid")
    return report


def main() -> None:
    torch.set_num_threads(1)
    save_report(run_all(Path(sys.argv[1]), sys.argv[2], int(os.environ["RANK"])))


if __name__ == "__main__":
    main()
