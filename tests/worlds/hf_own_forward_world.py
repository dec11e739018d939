"""tp 2 (± SP) × pp 2 on 4 ranks, for transformers families whose pipeline stages run the
model's own forward (plait/models/hf/own_forward.py), against one process.

The sweep runs pp alone on 2 ranks. Here the own-forward stages meet tensor parallelism
and sequence parallelism: on a later stage the forward's start runs on stand-in ids of the
whole sequence (its masks, ALiBi biases and position embeddings), while the hidden states
it takes in hold the stage's slice. Each family: 2 AdamW steps of 2 micro-batches (1F1B); the
report holds the losses and the worst difference of a held parameter, gathered over tp.
Then GPT-Neo at dp 2 × pp 2 with ZeRO-3 and full recomputation (its blocks gathered, freed
and rerun inside the forward the stage runs): the dp-mean losses.
"""

from __future__ import annotations

import sys
import warnings

import torch

import plait
from plait.parallel.placement import placement_of
from plait.parallel.tensor.ops import all_gather_stacked
from plait.runtime import comm
from tests.worldlib import save_report
from tests.worlds import hf_sweep_world as sweep
from tests.worlds.hf_common import pipeline_steps

warnings.filterwarnings("ignore")
CASES = {"gpt_neo": True, "mpt": False, "deepseek_v32": True, "biogpt": False}  # family: under SP


def whole(param: torch.Tensor, mesh: plait.Mesh) -> torch.Tensor:
    """A parameter gathered over tp, as one process holds it."""
    placement, tensor = placement_of(param), param.detach()
    if placement.split("tp") is not None:
        tensor = placement.join(all_gather_stacked(tensor.contiguous(), mesh.axis("tp"), comm.TELEMETRY), "tp")
    return tensor


def case(family: str, mesh: plait.Mesh, batches: list[torch.Tensor]) -> dict[str, object]:
    expected = sweep.reference(family, batches)
    stages = plait.parallelize(sweep.build(family), mesh, plait.ParallelConfig())
    optimizer = plait.build_optimizer(stages, torch.optim.AdamW, **sweep.ADAM)
    out = pipeline_steps(stages, mesh, batches, sweep.ACCUM, sweep.loss_fn, optimizer)
    worst = max((whole(param, mesh) - expected["params"][name]).abs().max().item()
                for name, param in out["held"].items())
    return {"losses": out["losses"], "expected": expected["losses"], "worst": worst,
            "own": stages[0]._adapter._own is not None}


def zero3_recompute(family: str, batches: list[torch.Tensor]) -> dict[str, object]:
    mesh = plait.init_mesh(dp=2, pp=2, zero=3, schedule="1f1b")
    expected = sweep.reference(family, batches)
    stages = plait.parallelize(sweep.build(family), mesh, plait.ParallelConfig(recompute="full"))
    optimizer = plait.build_optimizer(stages, torch.optim.AdamW, **sweep.ADAM)
    half = [rows.chunk(2)[mesh.rank("dp")] for rows in batches]
    out = pipeline_steps(stages, mesh, half, sweep.ACCUM, sweep.loss_fn, optimizer)
    return {"losses": [sweep.dp_mean(loss, mesh) for loss in out["losses"]], "expected": expected["losses"]}


def main() -> None:
    plait.init_mesh()
    families = sys.argv[1].split(",")
    meshes = {sp: plait.init_mesh(tp=2, pp=2, sp=sp, schedule="1f1b") for sp in set(CASES.values())}
    batches = sweep.data()
    report = {family: case(family, meshes[CASES[family]], batches) for family in families}
    report["zero3"] = zero3_recompute("gpt_neo", batches)
    save_report(report)


if __name__ == "__main__":
    main()
