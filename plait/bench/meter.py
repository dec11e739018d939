"""Measured memory: model states by storage, activations by what autograd saves.

Both measurements work on any device, CPU included, which is what lets the tests compare
them with the formulas in `estimate/`. Storages are deduplicated, so a tied weight, or a
gradient that is a view into a bucket, is counted once, at the size it really occupies.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterable, Iterator

import torch
from torch import nn


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this rank.

    A sharded optimizer (ZeRO) says itself which tensors are its model states: its gradient
    shards and fp32 masters are not reachable from `model.parameters()`. Under ZeRO-3 the
    parameters also count the most whole-unit weights held at once since the last call
    (gathered for a forward or backward, freed after): what a device must have room for.
    """
    if hasattr(optimizer, "model_state_tensors"):
        out = {k: storage_bytes(v) for k, v in optimizer.model_state_tensors(model).items()}
        sync = zero3_sync(model)
        if sync is not None:  # whole units gathered at once since the last reading, as predicted
            out["params"] += sync.peak_gathered_bytes
            sync.peak_gathered_bytes = sync.gathered_bytes
        return out
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.ndim > 0]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optim": storage_bytes(states)}


class ActivationMeter:
    """Peak bytes saved for backward during one forward and still held when it ends, excluding
    the parameters and buffers themselves.

    Use `with meter.track(model):` around a forward, holding its output; `peak` keeps the
    largest seen. What a branch nothing reads saved is not counted (parallel/saved.held_saves).
    """

    def __init__(self) -> None:
        self.peak = 0
        self.last = 0

    @contextlib.contextmanager
    def track(self, model: nn.Module) -> Iterator[None]:
        from plait.parallel.saved import held_saves, resident_storages

        param_ptrs = resident_storages(model)
        zero3 = zero3_sync(model)

        def is_weight(ptr: int) -> bool:
            # ZeRO-3 gathers a unit's weights into fresh storage just before it runs: asked
            # at save time (and only under ZeRO-3), not once up front.
            return ptr in param_ptrs or (zero3 is not None and ptr in zero3.gathered_storages())

        with held_saves(is_weight) as held:
            yield
        storages = [tensor.untyped_storage() for tensor, _ in held]
        self.last = sum({storage.data_ptr(): storage.nbytes() for storage in storages}.values())
        self.peak = max(self.peak, self.last)


def peak_process_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated GPU memory, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reserved_process_bytes(device: torch.device) -> int:
    """Peak bytes the caching allocator reserved on a GPU: the allocated peak plus its
    rounding and the freed blocks it could not reuse for other sizes, what the estimate's
    10% allowance (`estimate/memory.py: FRAGMENTATION`) stands for. 0 on a CPU, which has
    no caching allocator."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


def zero3_sync(model: nn.Module) -> object | None:
    """The ZeRO machinery of a stage-3 model (whose weights are gathered per unit), else None."""
    from plait.parallel.zero.stages import zero_of

    sync = zero_of(model)
    return sync if sync is not None and sync.stage >= 3 else None
