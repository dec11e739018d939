"""Products of strategies in fp16 and bf16 on 4 or 8 ranks, against one process (rank 0 alone).

argv: OUT LAYOUT...; a layout is NAME:dp,tp,pp:zero:precision, e.g. dp2pp2:2,1,2:1:fp16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from plait.runtime.mesh import init_mesh
from tests.worlds.precision_common import public, single_mesh, train
from tests.worldlib import save_report


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    world = init_mesh()
    report = {}
    layouts = [arg.split(":") for arg in sys.argv[2:]]
    if world.global_rank == 0:
        one = single_mesh()
        for precision in sorted({layout[3] for layout in layouts}):
            report[f"one-{precision}"] = public(train(one, str(out / f"one-{precision}"), precision=precision,
                                                      grad_accum=4, steps=2))
    for name, degrees, zero, precision in layouts:
        dp, tp, pp = map(int, degrees.split(","))
        mesh = init_mesh(dp=dp, tp=tp, pp=pp)
        report[name] = public(train(mesh, str(out / name), precision=precision, zero=int(zero),
                                    grad_accum=4 // dp, steps=2))
    save_report(report)
    world.close()


if __name__ == "__main__":
    main()
