"""Calibrate, plan, then train the plan's data-parallel layouts, all in one world: does the
plan's order hold when each layout runs?

Every rank times the machine (`machine.calibrate`, quick, at every micro-batch dividing a
rank's share of the batch, as `plait calibrate --micro-batch 4,2,1` would), rank 0 writes
the hardware file, and every rank plans from it (`plait plan --hardware-file`: pure
arithmetic, the same rows on every rank). The plan's first `TOP` layouts that this world's
mesh runs as it is (dp = world; ZeRO, micro-batch, accumulation and recompute vary) are
trained `STEPS` steps each, and each one's predicted step is kept beside its measured median.
A layout measured outside `BOUND` of its prediction is trained again (ATTEMPTS at most), as
tests/worlds/time_model.py does: other jobs on the machine can slow one run.

argv: OUT_DIR MODEL GLOBAL_BATCH STEPS TOP BOUND
"""

from __future__ import annotations

import sys
from pathlib import Path

from plait.bench import machine
from plait.estimate.hardware import load_hardware
from plait.estimate.planner import divisors, plan
from plait.families import family_of
from plait.models.gpt.config import get_preset
from plait.runtime import comm
from plait.runtime.env import prepare_host
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import finish
from plait.train.loop.trainer import Trainer
from tests.worldlib import save_report

SEQ = 128
ATTEMPTS = 3


def runs_on_this_mesh(row: dict, world: int) -> bool:
    """A plan row whose grid is this world's (dp only), so that one mesh trains it."""
    return (row["dp"], row["tp"], row["pp"], row["cp"], row["ep"]) == (world, 1, 1, 1, 1) and not (
        row["offload"] or row["dp_shard"] or row["sp"])


def main() -> None:
    out, model, batch, steps, top = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    bound = float(sys.argv[6])
    out.mkdir(parents=True, exist_ok=True)
    mesh = init_mesh()
    world = mesh.env.world_size
    prepare_host(world)
    share = batch // world
    hw_file = out / "hw.toml"
    hw = machine.calibrate(mesh, get_preset(model), micro_batch=share, seq_len=SEQ, tp_sizes=[1], precision="fp32",
                           quick=True, other_micro_batches=divisors(share)[:-1])
    if mesh.is_main:
        machine.save(hw, hw_file, machine.machine_facts(mesh))
    comm.barrier(mesh.axis("world"))
    rows = plan(get_preset(model), gpus=world, global_batch=batch, hardware=load_hardware(hw_file), gpus_per_node=world,
                seq_len=SEQ, precision="fp32")
    chosen = [row for row in rows if runs_on_this_mesh(row, world)][:top]
    trained = []
    for i, row in enumerate(chosen):
        config = TrainConfig(model=model, steps=steps, seq_len=SEQ, warmup_steps=2, eval_every=0, eval_samples=16,
                             sample_tokens=0, dp=world, nproc=world, out=str(out / f"layout{i}"),
                             hardware_file=str(hw_file), zero=row["zero"], micro_batch=row["micro_batch"],
                             grad_accum=row["grad_accum"], recompute=row["recompute"])
        measured = []
        for _ in range(ATTEMPTS):  # again only while outside the bound: a slow minute slows one run
            trainer = Trainer(config, mesh, family_of(config).task(config))
            trainer.run()
            measured.append(finish(trainer)["step_time"]["measured"]["step"])
            if abs(row["step_s"] / measured[-1] - 1) <= bound:
                break
        trained.append({"layout": {k: row[k] for k in ("zero", "micro_batch", "grad_accum", "recompute")},
                        "predicted": row["step_s"], "measured": measured[-1], "attempts": measured,
                        "rank_in_plan": rows.index(row) + 1})
    save_report({"trained": trained, "plan": [{k: r[k] for k in ("dp", "tp", "pp", "cp", "zero", "micro_batch",
                                                                 "grad_accum", "recompute", "step_s")}
                                              for r in rows[:top]]})
    mesh.close()


if __name__ == "__main__":
    main()
