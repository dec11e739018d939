"""What the transformers worlds share: the training loop, called as user code calls the model,
and the comparison of `plait train`'s runs with one process's."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from plait.runtime import comm
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import init_mesh

Run = Callable[[Any, Any], tuple[dict[str, Any], dict[str, torch.Tensor] | None]]  # (config, mesh) -> (report, weights)


def against_one_process(run: Run, one: Any, configs: dict[str, Any]) -> dict[str, Any]:
    """One model's reports: rank 0 alone runs `one` (the one-process reference), then every rank
    runs each of `configs` by name; rank 0 adds to each the largest relative difference of its
    final weights from the reference's (`max_rel`)."""
    found: dict[str, Any] = {}
    rank = int(os.environ["RANK"])
    if rank == 0:
        found["one"], reference = run(one, init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500)))
    for layout, config in configs.items():
        found[layout], weights = run(config, init_mesh(config.layout))
        if rank == 0:
            found[layout]["max_rel"] = max_rel(weights, reference)
    return found


def max_rel(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor from the reference's, relative to its largest value."""
    assert weights.keys() == reference.keys(), sorted(set(weights) ^ set(reference))
    return max(((weights[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() for k, v in reference.items())


def train(model: torch.nn.Module, batches: list[torch.Tensor], optimizer: Any, clip: Any,
          ledger: Any = None) -> dict[str, Any]:
    """SGD steps on `model(input_ids=, labels=).loss`; the tp all-reduces of the first backward."""
    losses, backward_all_reduces = [], None
    for step, ids in enumerate(batches):
        loss = model(input_ids=ids, labels=ids).loss
        before = ledger.tallies[(comm.TRAIN, "tp", "all_reduce")].calls if ledger else 0
        loss.backward()
        if ledger is not None and step == 0:
            backward_all_reduces = ledger.tallies[(comm.TRAIN, "tp", "all_reduce")].calls - before
        clip()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "backward_tp_all_reduces": backward_all_reduces}


def pipeline_steps(stages: Any, mesh: Any, batches: list[torch.Tensor], micro_batches: int, loss_fn: Any,
                   optimizer: Any) -> dict[str, Any]:
    """Steps of a 1F1B pipeline over `stages`: each batch's rows cut into `micro_batches`,
    next-token targets; the losses, and the parameters this rank's stages hold, by the whole
    model's names (a tied head's copy left out)."""
    from plait import PipelineRunner
    from plait.parallel.pipeline.split import logical_parameters

    runner, losses = PipelineRunner(stages, mesh, "1f1b"), []
    for rows in batches:
        micro = rows.chunk(micro_batches)
        losses.append(float(runner.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro], loss_fn)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "held": {name: param for name, param, replica in logical_parameters(stages)
                                        if not replica}}
