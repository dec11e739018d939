"""Calibrate, then train, in the same world: the predicted step time against the measured
median. Another attempt (calibration and training again, three at most) is made only when one falls
outside the bound, since other jobs on the machine can slow one phase and not the other. The
next attempt's calibration also times the machine after the attempt before it ran: that one is
then priced, too, at the mean of the two calibrations around it (as benchmarks/planner_measured.py
and the planner check price every layout), and either verdict within the bound ends the attempts.
The report's "held" is the ratio that ended them (else the last attempt's own).

argv: OUT_DIR MODEL STEPS BOUND [lags] [FIELD=INT ...] (TrainConfig fields: tp, pp, zero, micro_batch,
grad_accum); `lags` also times the ranks' lag after the training (about a second a rank, read
by one test only).
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


def bracketed(before: dict, after: dict) -> float:
    """`before`'s predicted / measured step, priced at the mean of its own calibration and the
    next attempt's (timed after `before` trained; the same layout, so the same prediction)."""
    return (before["predicted"]["step"] + after["predicted"]["step"]) / 2 / before["measured"]["step"]


def verdict(attempts: list[dict], bound: float) -> float:
    """The last attempt's ratio, or the one before it priced between two calibrations, whichever
    is within `bound` (the last attempt's when neither is)."""
    last = attempts[-1]["ratio"]
    if abs(last - 1) <= bound or len(attempts) < 2:
        return last
    between = bracketed(attempts[-2], attempts[-1])
    return between if abs(between - 1) <= bound else last


def main() -> None:
    out, model, steps, bound = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    lags_wanted = "lags" in sys.argv[5:]
    extra = {k: int(v) for k, v in (a.split("=") for a in sys.argv[5:] if a != "lags")}
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
        held = verdict(attempts, bound)
        if abs(held - 1) <= bound:
            break
    # short loops: the rows' shape, not their values
    lags = calibrate.measure_lags(mesh, 1, loop_s=0.05) if lags_wanted else None
    save_report({"attempts": attempts, "held": held, "hardware": summary["predicted"]["layout"]["hardware"],
                 "lags": lags, "links": hw.links, "op_links": hw.op_links})
    mesh.close()


if __name__ == "__main__":
    main()
