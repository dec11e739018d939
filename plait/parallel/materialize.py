"""Give a model split on the meta device its values: each rank allocates only what it holds.

`parallelize` cuts a model built on the meta device (plait.parallel.deferred) as it would cut
a real one: tensor and expert parallelism replace layers by their slices, the pipeline keeps
this rank's stages. Nothing has memory yet. `materialize` then walks what this rank holds,
by the whole model's names (a pipeline stage's "layers.0" is the model's "layers.4"), asks
a source for each tensor whole, keeps the part the parameter's placement says this rank
holds (plait.parallel.placement: the one record of how a parameter is split), and puts it on
the device. One tensor is whole at a time, so a rank's peak is its share plus the largest
tensor, never the model.

ZeRO-3 keeps less than that share: `placeholders` gives each parameter a handle with its
shape and one element of memory instead, and returns what draws a handle's part, from
which ZeRO fills only its shard (plait.parallel.zero.stages).

A source is a function from a name to the whole tensor on the host: the seed's replay
(`Deferred.draw_named`), a safetensors file, a checkpoint. Tied parameters (one Parameter
under two names) are filled once and stay tied; the attributes strategies set on a
parameter (its placement, its gradient hooks) move to the new one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.pipeline.split import is_pipeline
from plait.parallel.placement import placement_of
from plait.parallel.tensor.layers import carry_grad_sum

Source = Callable[[str], torch.Tensor]
Fill = Callable[[nn.Parameter], torch.Tensor]  # a placeholder parameter -> this rank's part, whole, on its device


def logical_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(the whole model's name, tensor) for every parameter and buffer this rank holds,
    non-persistent buffers (rotary tables) included; a tied one once, by its first name."""
    if not is_pipeline(model):
        return _named(model, lambda name: name)
    out, seen = [], set()
    for stage in model:
        for name, tensor in _named(stage, lambda name, stage=stage: stage.replica_of.get(name, stage.global_name(name))):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append((name, tensor))
    return out


def _named(module: nn.Module, rename: Callable[[str], str]) -> list[tuple[str, torch.Tensor]]:
    return [(rename(name), tensor) for name, tensor in [*module.named_parameters(), *module.named_buffers()]]


def materialize(model: nn.Module, device: torch.device, source: Source) -> int:
    """Replace every meta parameter and buffer of `model` by this rank's part of `source(name)`
    on `device`, in its dtype; return the bytes allocated. Parameters stay Parameters (same
    requires_grad and attributes) wherever the model holds them."""
    made = _replace(model, lambda name, tensor: _parameter(tensor, _part(tensor, name, source, device)))
    return sum(t.numel() * t.element_size() for t in made.values())


def placeholders(model: nn.Module, device: torch.device, source: Source) -> Fill:
    """Fill `model`'s meta buffers and frozen parameters (ZeRO shards only what trains); make
    each other meta parameter a handle (its shape and dtype, one element of memory); return
    what gives a handle's part (this rank's, whole) on `device`."""
    names: dict[int, str] = {}

    def handle(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter) or not tensor.requires_grad:
            return _parameter(tensor, _part(tensor, name, source, device))
        param = _parameter(tensor, torch.zeros((), dtype=tensor.dtype, device=device))
        param.data = param.data.expand(tensor.shape)
        names[id(param)] = name
        return param

    _replace(model, handle)

    def fill(param: nn.Parameter) -> torch.Tensor:
        if id(param) not in names:
            raise PlaitError("a parameter to fill is not one of the model's placeholders",
                             hint="fill the parameters placeholders() made")
        return _part(param, names[id(param)], source, device)

    return fill


def _replace(model: nn.Module, make: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
    """Swap each meta tensor for `make(name, tensor)` wherever a module holds it; a tied one once."""
    made: dict[int, torch.Tensor] = {}
    for name, tensor in logical_tensors(model):
        if tensor.is_meta:
            made[id(tensor)] = make(name, tensor)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is not None and id(tensor) in made:
                    table[key] = made[id(tensor)]
    left = [name for name, tensor in logical_tensors(model) if tensor.is_meta]
    if left:
        raise PlaitError(f"{len(left)} tensor(s) stayed on the meta device, e.g. {left[0]}",
                         hint="a module holds it outside its parameters and buffers; build this model whole")
    return made


def _part(tensor: torch.Tensor, name: str, source: Source, device: torch.device) -> torch.Tensor:
    """This rank's part of `name`'s whole tensor, shaped and typed as `tensor`, on `device`. A
    source that reads blocks (`block(name, offsets, lengths)`: a file's slices) is asked for
    the part alone, where the part is one block of the whole."""
    placement = placement_of(tensor) if isinstance(tensor, nn.Parameter) else None
    reads_blocks = callable(getattr(source, "block", None))
    if reads_blocks and placement is not None and placement.splits and all(s.fused == 1 for s in placement.splits):
        part = source.block(name, placement.offsets, placement.local_shape)  # type: ignore[attr-defined]
        shown = f"a block {tuple(part.shape)}"
    else:
        whole = source(name)
        part = placement.take(whole) if placement is not None and placement.splits else whole
        shown = f"{tuple(whole.shape)}, of which this rank's part is {tuple(part.shape)}"
    if tuple(part.shape) != tuple(tensor.shape):
        raise PlaitError(f"{name}: the source gives {shown}, and the split model holds {tuple(tensor.shape)}",
                         hint="the weights belong to another config; use the pair that was saved together")
    return part.to(device=device, dtype=tensor.dtype).contiguous()


def _parameter(like: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """`data` as `like` was: a Parameter with its requires_grad, attributes and gradient hook."""
    if not isinstance(like, nn.Parameter):
        return data
    param = nn.Parameter(data, requires_grad=like.requires_grad)
    param.__dict__.update(like.__dict__)  # placement, gradient hooks a strategy set
    carry_grad_sum(like, param)
    return param
