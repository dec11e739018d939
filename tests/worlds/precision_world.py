"""Mixed precision on 2 ranks, each layout against one process (rank 0 alone) in the same world.

argv: OUT PHASE...; phases:
  parity   fp16 and bf16 (no ZeRO) on dp 2, tp 2 and pp 2; bf16 dp 2 reduced in fp32
  faults   an inf on one tp rank (fp16: skipped everywhere, scale halves); a nan on one pp
           rank (fp32: every rank stops naming it; --skip-nonfinite: skipped everywhere)
  fp8      fp8 (tensorwise and rowwise) on dp 2 (ZeRO 0, 1, 3) and pp 2; tp 2 refused
  resume   fp16 dp 2 resumed to the bit, scale included; an fp32 checkpoint resumed in fp16
           (no ZeRO and ZeRO-1) builds its masters from the fp32 weights
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

from plait.errors import PlaitError
from plait.runtime.env import torch_release
from plait.runtime.mesh import init_mesh
from plait.train.checkpoint import read as checkpoint_read, write as checkpoint

from tests.worlds.precision_common import config, poison, public, same, single_mesh, snapshot, train, trainer_for
from tests.worldlib import save_report

LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}


def one_process(out: Path, runs: dict[str, dict[str, Any]], **common: Any) -> dict[str, Any]:
    """Rank 0 alone trains each named run: the one-process references of a phase."""
    one = single_mesh()
    return {name: public(train(one, str(out / name), **common, **fields)) for name, fields in runs.items()}


def parity(out: Path, rank: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    if rank == 0:
        report.update(one_process(out, {f"one-{p}": {"precision": p} for p in ("fp16", "bf16")}, grad_accum=2, steps=2))
    for name, degrees in LAYOUTS.items():
        mesh = init_mesh(**degrees)
        accum = 1 if name == "dp2" else 2
        for precision in ("fp16", "bf16"):
            report[f"{name}-{precision}"] = public(train(mesh, str(out / name), precision=precision,
                                                         grad_accum=accum, steps=2))
        if name == "dp2":
            for zero in (0, 1):
                report[f"dp2-bf16-reduce-fp32-zero{zero}"] = public(train(
                    mesh, str(out / name), precision="bf16", reduce_dtype="fp32", zero=zero, steps=1))
    return report


# float8 products on the CPU run a reference kernel (about 30 MFLOP/s): the fp8 phase trains
# one 16-token sequence a micro-batch and evaluates on two, as little as shows each layout's bits
FP8_SHAPE = {"micro_batch": 1, "seq_len": 16, "eval_samples": 2}


def fp8(out: Path, rank: int) -> dict[str, Any]:
    """fp8 (bf16 whose block linears multiply in float8) on dp 2 (ZeRO 0, 1, 3) and pp 2 against
    one process; bf16 beside it, to show float8 really ran; tp 2 refused."""
    report: dict[str, Any] = {}
    rowwise = (torch_release() or (2, 13)) >= (2, 13)  # else refused on the CPU (plait.rules.check_fp8_device)
    if rank == 0:
        report.update(one_process(out, {"fp8-phase-one-fp8": {"precision": "fp8"},
                                        "fp8-phase-one-bf16": {"precision": "bf16"},
                                        **({"fp8-phase-one-rowwise": {"precision": "fp8", "fp8_scaling": "rowwise"}}
                                           if rowwise else {})},
                                  grad_accum=2, steps=3, **FP8_SHAPE))
    dp = init_mesh(dp=2)
    for zero in (0, 1, 3):
        report[f"dp2-zero{zero}-fp8"] = public(train(dp, str(out / f"dp{zero}"), precision="fp8", zero=zero, steps=3,
                                                         **FP8_SHAPE))
    try:
        report["dp2-fp8-rowwise"] = public(train(dp, str(out / "dp-rowwise"), precision="fp8",
                                                 fp8_scaling="rowwise", steps=3, **FP8_SHAPE))
    except PlaitError as exc:
        report["dp2-fp8-rowwise"] = str(exc)
    report["pp2-fp8"] = public(train(init_mesh(pp=2), str(out / "pp"), precision="fp8", grad_accum=2, steps=3,
                                       **FP8_SHAPE))
    try:
        train(init_mesh(tp=2), str(out / "tp"), precision="fp8", steps=1, **FP8_SHAPE)
        report["tp2-fp8"] = "no error"
    except PlaitError as exc:
        report["tp2-fp8"] = str(exc)
    return report


def faults(out: Path, rank: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    kept: dict[str, Any] = {}

    def inject(target: int, value: float, at: int = 1):
        def before(trainer: Any, step: int) -> None:
            if step == at:
                if trainer.mesh.global_rank == target:
                    kept["name"] = poison(trainer, value)
                kept["before"] = snapshot(trainer)
        return before

    tp = init_mesh(tp=2)
    run = train(tp, str(out / "tp"), before_step=inject(1, math.inf), precision="fp16", steps=2)
    report["overflow"] = {**public(run), "untouched": same(kept["before"], snapshot(run["trainer"])),
                          "poisoned": kept.get("name")}
    pp = init_mesh(pp=2)
    try:
        train(pp, str(out / "pp"), before_step=inject(1, math.nan), steps=2)
        report["stop"] = "no error"
    except PlaitError as exc:
        report["stop"] = str(exc)
    report["stop_poisoned"] = kept.get("name")
    run = train(pp, str(out / "pp"), before_step=inject(0, math.nan), skip_nonfinite=True, steps=2)
    report["skip"] = {**public(run), "untouched": same(kept["before"], snapshot(run["trainer"]))}
    return report


def resume(out: Path, rank: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    dp = init_mesh(dp=2)
    whole = train(dp, str(out / "whole"), precision="fp16", loss_scale=131072.0, steps=4, save_every=2)
    step2 = out / "whole" / "checkpoints" / "step-00000002"
    again = train(dp, str(out / "again"), precision="fp16", loss_scale=131072.0, steps=4, resume=str(step2))
    report["resume"] = {"whole": public(whole), "again": public(again),
                        "bitwise": same(snapshot(whole["trainer"]), snapshot(again["trainer"]))}
    train(dp, str(out / "fp32"), steps=2, save_every=2)
    source = out / "fp32" / "checkpoints" / "step-00000002"
    for zero in (0, 1):
        trainer = trainer_for(config(dp, str(out / f"fp16-{zero}"), precision="fp16", zero=zero, steps=3,
                                     resume=str(source)), dp)
        trainer.resume()
        reader = checkpoint_read.Reader(source, verify=False)
        masters = [p for p in checkpoint.local_pieces(trainer.model, trainer.optimizer, dp)
                   if p.name.endswith("/master")]
        exact = [torch.equal(p.tensor.cpu(), reader.read_block("model/" + p.name[len("optim/"):-len("/master")],
                                                                p.offsets, tuple(p.tensor.shape), p.full_shape))
                 for p in masters]
        report[f"masters-zero{zero}"] = {"count": len(masters), "exact": all(exact) and bool(exact),
                                         "dtype": str(masters[0].tensor.dtype) if masters else None}
    return report


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    mesh = init_mesh(dp=2)
    report: dict[str, Any] = {}
    for phase in sys.argv[2:]:
        report.update({"parity": parity, "faults": faults, "resume": resume, "fp8": fp8}[phase](out / phase,
                                                                                              mesh.global_rank))
    save_report(report)
    mesh.close()


if __name__ == "__main__":
    main()
