"""One rank's split model raises inside the probe (rank 1's first MLP, under tp 2), while the
other waits in that MLP's all-reduce: the run must end at once with rank 1's one line, not
when the collective times out (argv: OUT; timeout 120 s)."""

from __future__ import annotations

import os

import torch

import plait
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import GPT

torch.set_num_threads(1)


def main() -> None:
    mesh = plait.init_mesh(tp=2, timeout_s=120)
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    whole = model.blocks[0].mlp.gate_proj.weight.shape[0]

    def lone(module: torch.nn.Module, args: tuple) -> None:
        if int(os.environ["RANK"]) == 1 and module.gate_proj.weight.shape[0] != whole:
            raise RuntimeError("a fault of rank 1's split MLP")

    model.blocks[0].mlp.register_forward_pre_hook(lone)
    plait.parallelize(model, mesh, plait.ParallelConfig())


if __name__ == "__main__":
    main()
