"""What a meter of the bytes autograd saves for backward counts, and what it hands autograd back:
the one rule both meters follow (plait.bench.meter.ActivationMeter around a forward, the
pipeline's StageWork around each action: plait.parallel.pipeline.execute)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn


# A tensor that its module can make again from what autograd keeps anyway (plait's GPT makes
# SwiGLU's product again for the down projection's backward: models/gpt/lean.gated_down) names
# its maker, a function of nothing that returns its values, under this attribute. A recorder
# that would keep the tensor itself (the zero-bubble W's inputs: parallel/pipeline/execute)
# keeps the maker instead, or it would hold what the block let go.
REMADE = "plait_remade"


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


@contextlib.contextmanager
def held_saves(resident: Callable[[int], bool]) -> Iterator[list[tuple[torch.Tensor, bool]]]:
    """While inside, what autograd saves for backward is noted, but storages `resident` names by
    address (weights, buffers, gathered units) and empty ones; on leaving, the list it yields holds
    each save autograd still holds, with whether it was a leaf. A branch nothing reads frees what
    it saved before the forward ends: counted at save time by address, such a tensor stayed in a
    meter's sum (MiniMax's lightning attention, 4 KiB of a tiny model's 300)."""
    noted: list[tuple[weakref.ref, bool]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        alias = handed_back(tensor)
        if storage.nbytes() and not resident(storage.data_ptr()):
            noted.append((weakref.ref(alias), tensor.grad_fn is None))  # alive while autograd holds it
        return alias

    held: list[tuple[torch.Tensor, bool]] = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield held
    held.extend((tensor, leaf) for tensor, leaf in ((ref(), leaf) for ref, leaf in noted) if tensor is not None)
