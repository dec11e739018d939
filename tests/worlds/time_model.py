"""Calibrate, then train, in the same world: the predicted step time against the measured
median. Another attempt (calibration and training again, three at most) is made only when one falls
outside the bound, since other jobs on the machine can slow one phase and not the other.

argv: OUT_DIR MODEL STEPS BOUND [FIELD=INT ...] (TrainConfig fields: tp, pp, zero, micro_batch,
grad_accum)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from plait.bench import calibrate, machine
from plait.families import family_of
from plait.models.gpt.config import get_preset
from plait.runtime import comm
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import finish
from plait.train.loop.trainer import Trainer
from tests.worldlib import save_report


def main() -> None:
    out, model, steps, bound = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    extra = {k: int(v) for k, v in (a.split("=") for a in sys.argv[5:])}
    out.mkdir(parents=True, exist_ok=True)
    mesh = init_mesh(tp=extra.get("tp", 1), pp=extra.get("pp", 1))
    torch.set_num_threads(1)
    hw_file = out / "hw.toml"
    config = TrainConfig(model=model, steps=steps, seq_len=128, warmup_steps=2, eval_every=0, eval_samples=16,
                         sample_tokens=0, dp=mesh.size("dp"), nproc=mesh.env.world_size, out=str(out),
                         hardware_file=str(hw_file), **{"micro_batch": 8, **extra})
    attempts = []
    for _ in range(3):
        hw = machine.calibrate(mesh, get_preset(model), micro_batch=config.micro_batch, seq_len=128,
                               tp_sizes=[config.tp], precision="fp32", quick=True)
        if mesh.is_main:
            machine.save(hw, hw_file, machine.machine_facts(mesh))
        comm.barrier(mesh.axis("world"))
        trainer = Trainer(config, mesh, family_of(config).task(config))
        trainer.run()
        summary = finish(trainer)
        attempts.append(summary["step_time"])
        if abs(summary["step_time"]["ratio"] - 1) <= bound:
            break
    lags = calibrate.measure_lags(mesh, 1, loop_s=0.05)  # short loops: the rows' shape, not their values
    save_report({"attempts": attempts, "hardware": summary["predicted"]["layout"]["hardware"], "lags": lags,
                 "links": hw.links, "op_links": hw.op_links})
    mesh.close()


if __name__ == "__main__":
    main()
