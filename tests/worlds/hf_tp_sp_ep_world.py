"""tp 2 + SP × dp 2 × ep 2 on 4 ranks, for transformers MoE families, against one process.

Under SP an MoE block with experts kept whole for ep runs on its sequence slice, so each tp
rank's expert gradient is partial and summed over tp by a tensor hook; expert parallelism
then slices those parameters anew, and the slice must carry the hook (it once did not: the
experts learned from 1/tp of the tokens, and the tp copies drifted apart). The sweep runs tp,
SP and ep only one at a time. Each family: 2 AdamW steps of 2 micro-batches, each dp rank its
half of every batch; the report holds the losses and the worst parameter difference, the
split parameters gathered whole.
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

warnings.filterwarnings("ignore")


def whole(param: torch.Tensor, mesh: plait.Mesh) -> torch.Tensor:
    """A parameter gathered over ep and tp, as one process holds it."""
    placement, tensor = placement_of(param), param.detach()
    for axis in ("ep", "tp"):
        if placement.split(axis) is not None:
            tensor = placement.join(all_gather_stacked(tensor.contiguous(), mesh.axis(axis), comm.TELEMETRY), axis)
    return tensor


def case(family: str, mesh: plait.Mesh, batches: list[torch.Tensor]) -> dict[str, object]:
    expected = sweep.reference(family, batches)
    model = plait.parallelize(sweep.build(family), mesh, plait.ParallelConfig())
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, **sweep.ADAM)
    half = [rows.chunk(2)[mesh.rank("dp")] for rows in batches]
    losses = [sweep.dp_mean(loss, mesh) for loss in sweep.train(model, half, optimizer, sync=plait.no_sync)]
    worst = max((whole(param, mesh) - expected["params"][name]).abs().max().item()
                for name, param in model.named_parameters())
    return {"losses": losses, "expected": expected["losses"], "worst": worst}


def main() -> None:
    plait.init_mesh()
    mesh = plait.init_mesh(tp=2, dp=2, ep=2, sp=True)
    batches = sweep.data()
    save_report({family: case(family, mesh, batches) for family in sys.argv[1].split(",")})


if __name__ == "__main__":
    main()
