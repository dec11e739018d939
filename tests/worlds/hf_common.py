"""What the transformers worlds share: the training loop, called as user code calls the model."""

from __future__ import annotations

from typing import Any

import torch

from plait.runtime import comm


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
