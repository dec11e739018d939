"""What a meter of the bytes autograd saves for backward counts, and what it hands autograd back:
the one rule both meters follow (plait.bench.meter.ActivationMeter around a forward, the
pipeline's StageWork around each action: plait.parallel.pipeline.execute)."""

from __future__ import annotations

import torch
from torch import nn


def resident_storages(module: nn.Module) -> set[int]:
    """The storages of the module's own tensors, its weights and buffers: resident whatever
    runs, so never activations (a saved view of a rope table holds no bytes of its own)."""
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def handed_back(tensor: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor hook returns for `tensor`. An op's output goes back as an alias: the
    tensor itself, saved by its own op, would hold its grad_fn, a cycle through autograd's C++
    that no collector sees (the pipeline's I and W keep graphs alive, and every micro-batch's
    activations leaked: 80 MB a step a rank on `small`). A leaf (no grad_fn, no cycle) goes
    back as itself, as autograd keeps it, so an object shared by reference stays shared
    (plait.parallel.packed.dense_mask)."""
    return tensor if tensor.grad_fn is None else tensor.detach()
