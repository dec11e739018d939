"""Calibrate, plan, then train the plan's data-parallel layouts, all in one world: does the
plan's order hold when each layout runs?

Every rank times the machine (`machine.calibrate`, in full, at every micro-batch dividing a
rank's share of the batch, as `plait calibrate --micro-batch 8,4,2,1` would), rank 0 writes
the hardware file, and every rank plans from it (`plait plan --hardware-file`: pure
arithmetic, the same rows on every rank). The plan's first `TOP` layouts that this world's
mesh runs as it is (dp = world; ZeRO, micro-batch, accumulation and recompute vary) are
trained `STEPS` steps, the layouts taking turns step by step so that a slow stretch of the
host lands on every layout, not on one, in a new order each round (plait.bench.turns, as the
planner check takes them), every step after the first two kept.

A full calibration, not a quick one: a quick one times each shape in 3 rounds, and on this
shared 2-core host that orders micro-batches by chance. Four quick calibrations in a row put
micro-batch 4, 4, 2 and 1 first where the layouts measured micro-batch 8 fastest; two full ones
(11 rounds) both put 8 first. Full, less what no data-parallel layout pays
(`machine.calibrate(data_parallel_only=True)`): the ranks' lag after bursts of compute (tp, cp
and ep collectives pay it) and the send/recv latency (pipelines and ring attention), 13 s of
each calibration here (19.3-19.9 s with them, 6.3-6.5 s without) that priced none of the
layouts trained.

argv: OUT_DIR MODEL GLOBAL_BATCH STEPS TOP
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from plait.bench import machine
from plait.bench.turns import take_turns
from plait.estimate.hardware import load_hardware
from plait.estimate.planner import divisors, plan
from plait.families import family_of
from plait.models.gpt.config import get_preset
from plait.runtime import comm
from plait.runtime.env import prepare_host
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.trainer import Trainer
from tests.worldlib import save_report

SEQ = 128
# The host's pace moves by up to 40% within minutes (benchmarks/RESULTS.md, "planner-measured",
# run 6): where the layouts' steps and the calibration before them disagree by more than this
# (their median ratio), the machine is timed again after them and each layout priced at the
# mean of the two, as benchmarks/planner_measured.py does for every run.
RECHECK_PACE = 0.2


def runs_on_this_mesh(row: dict, world: int) -> bool:
    """A plan row whose grid is this world's (dp only), so that one mesh trains it."""
    return (row["dp"], row["tp"], row["pp"], row["cp"], row["ep"]) == (world, 1, 1, 1, 1) and not (
        row["offload"] or row["dp_shard"] or row["sp"])


def layout_of(row: dict) -> dict:
    return {k: row[k] for k in ("zero", "micro_batch", "grad_accum", "recompute")}


def pace(trained: list[dict], mesh) -> float:
    """The median over the trained layouts of predicted / measured (their median step), as the
    ranks agree on it (each times its own steps): the calibration's pace against the training's."""
    ratio = statistics.median(entry["predicted"] / statistics.median(entry["steps"]) for entry in trained)
    agreed = torch.tensor([ratio], dtype=torch.float64)
    comm.all_reduce(agreed, mesh.axis("world"), purpose=comm.TELEMETRY)
    return agreed.item() / mesh.env.world_size


def planned(mesh, model: str, batch: int, hw_file: Path) -> list[dict]:
    """This machine calibrated now (in full, every micro-batch a rank's share allows, for the
    data-parallel layouts this mesh trains; rank 0 writes the file), then the plan read from
    it: the same rows on every rank."""
    world = mesh.env.world_size
    share = batch // world
    hw = machine.calibrate(mesh, get_preset(model), micro_batch=share, seq_len=SEQ, tp_sizes=[1], precision="fp32",
                           other_micro_batches=divisors(share)[:-1], data_parallel_only=True)
    if mesh.is_main:
        machine.save(hw, hw_file, machine.machine_facts(mesh))
    comm.barrier(mesh.axis("world"))
    return plan(get_preset(model), gpus=world, global_batch=batch, hardware=load_hardware(hw_file),
                gpus_per_node=world, seq_len=SEQ, precision="fp32")


def main() -> None:
    out, model, batch, steps, top = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    out.mkdir(parents=True, exist_ok=True)
    mesh = init_mesh()
    world = mesh.env.world_size
    prepare_host(world)
    hw_file = out / "hw.toml"
    rows = planned(mesh, model, batch, hw_file)
    chosen = [row for row in rows if runs_on_this_mesh(row, world)][:top]
    trainers = [Trainer(config, mesh, family_of(config).task(config))
                for config in (TrainConfig(model=model, steps=steps, seq_len=SEQ, warmup_steps=2, eval_every=0,
                                           eval_samples=16, sample_tokens=0, dp=world, nproc=world,
                                           out=str(out / f"layout{i}"), hardware_file=str(hw_file), zero=row["zero"],
                                           micro_batch=row["micro_batch"], grad_accum=row["grad_accum"],
                                           recompute=row["recompute"])
                               for i, row in enumerate(chosen))]
    times = take_turns(trainers, steps)  # a slow second slows them all; a new order each round
    trained = [{"layout": layout_of(row), "predicted": row["step_s"], "steps": taken,
                "rank_in_plan": rows.index(row) + 1} for row, taken in zip(chosen, times)]
    if abs(pace(trained, mesh) - 1) > RECHECK_PACE:
        again = {str(layout_of(row)): row["step_s"] for row in planned(mesh, model, batch, out / "hw-after.toml")
                 if runs_on_this_mesh(row, world)}
        for entry in trained:
            entry["predicted_after"] = again.get(str(entry["layout"]), entry["predicted"])
    save_report({"trained": trained, "plan": [{k: r[k] for k in ("dp", "tp", "pp", "cp", "zero", "micro_batch",
                                                                 "grad_accum", "recompute", "step_s")}
                                              for r in rows[:top]]})
    mesh.close()


if __name__ == "__main__":
    main()
