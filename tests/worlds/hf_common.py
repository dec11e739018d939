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
