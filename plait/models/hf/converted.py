"""Checkpoints transformers converts as it loads, read a block at a time.

Mixtral, Qwen-MoE, OLMoE, DeepSeek and their kin keep one matrix per expert in their files
(`...experts.3.w1.weight`), while the model holds each layer's experts as one tensor
(`...experts.gate_up_proj`: every expert's gate and up stacked, then concatenated). Their
keys may also be renamed on the way (`.block_sparse_moe.` to `.mlp.`). transformers declares
each conversion (its `conversion_mapping`); `from_pretrained` applies it to whole tensors.

Here the same declarations are read backwards, per block: the block of a fused tensor a rank
holds (an ep rank's experts, a tp rank's rows of each) is the stack over its experts of the
matching slice of each expert's matrix, read from the file alone. Only the conversions that
are a stack over experts and a concatenation (or either alone) are read this way; any other
is refused with `CannotDefer`, and the model is then loaded whole by `from_pretrained`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.parallel.deferred import CannotDefer

SliceReader = Callable[[str, tuple[slice, ...]], torch.Tensor]  # (checkpoint key, slices) -> that block


@dataclass(frozen=True)
class Fused:
    """One model tensor made of checkpoint tensors: each source's keys (one per expert when
    `stacked`) stacked along dim 0, and the sources concatenated along `dim`."""

    sources: tuple[tuple[str, ...], ...]
    shapes: tuple[tuple[int, ...], ...]  # one key's shape, per source
    stacked: bool
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The model tensor's shape, as the conversion makes it."""
        sizes = [self._size(keys, shape) for keys, shape in zip(self.sources, self.shapes)]
        whole = list(sizes[0])
        whole[self.dim] = sum(size[self.dim] for size in sizes)
        return tuple(whole)

    def _size(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        return ((len(keys),) + shape) if self.stacked else shape

    def block(self, offsets: tuple[int, ...], lengths: tuple[int, ...], read: SliceReader) -> torch.Tensor:
        """The block at `offsets` of `lengths` of the model tensor, from each key's slice."""
        lead = 1 if self.stacked else 0
        parts, start = [], 0
        for keys, shape in zip(self.sources, self.shapes):
            size = self._size(keys, shape)
            lo, hi = max(offsets[self.dim], start), min(offsets[self.dim] + lengths[self.dim], start + size[self.dim])
            start += size[self.dim]
            if lo >= hi:
                continue
            spans = [slice(o, o + n) for o, n in zip(offsets, lengths)]
            spans[self.dim] = slice(lo - (start - size[self.dim]), hi - (start - size[self.dim]))
            inner = tuple(spans[lead:])
            if self.stacked:
                parts.append(torch.stack([read(keys[e], inner) for e in range(spans[0].start, spans[0].stop)]))
            else:
                parts.append(read(keys[0], inner))
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0]


def conversions(model: nn.Module, keys: list[str], shapes: dict[str, tuple[int, ...]],
                named: dict[str, torch.Tensor], spec: str) -> tuple[dict[str, str], dict[str, Fused]]:
    """How the checkpoint `keys` become the model's tensors: ({model name: key} for the keys
    only renamed, {model name: Fused} for the fused ones), by transformers' declarations for
    `model`. CannotDefer for a conversion this reading cannot honour."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (Concatenate, MergeModulelist, WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
    except ImportError:
        raise CannotDefer(f"--model {spec}: this transformers declares no conversions to read by blocks",
                          hint="it is loaded whole by from_pretrained on every rank instead") from None
    try:
        transforms = get_model_conversion_mapping(model)
    except Exception as exc:  # noqa: BLE001 - a family's mapping may fail on a meta model
        raise CannotDefer(f"--model {spec}: transformers' conversions for it cannot be read ({type(exc).__name__})",
                          hint="it is loaded whole by from_pretrained on every rank instead") from None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, str] = {}
    grouped: dict[str, dict[str, list[str]]] = {}
    ops: dict[str, list[Any]] = {}
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, named)
        if pattern is None:
            renamed[target] = key
            continue
        grouped.setdefault(target, {}).setdefault(pattern, []).append(key)
        ops[target] = next(c for c in converters if pattern in c.source_patterns).operations
    fused = {}
    for target, by_pattern in grouped.items():
        kinds = [type(op) for op in ops[target]]
        stacked = bool(kinds) and kinds[0] is MergeModulelist and ops[target][0].dim == 0
        rest = ops[target][1:] if stacked else ops[target]
        if len(rest) > 1 or (rest and type(rest[0]) is not Concatenate) or (not stacked and not rest):
            raise CannotDefer(f"--model {spec}: {target} is made by a conversion plait cannot read by blocks "
                              f"({', '.join(k.__name__ for k in kinds)})",
                              hint="it is loaded whole by from_pretrained on every rank instead")
        dim = rest[0].dim if rest else 1
        sources = tuple(tuple(by_pattern[p]) for p in _in_declared_order(by_pattern, converters))
        fused[target] = Fused(sources, tuple(shapes[keys_[0]] for keys_ in sources), stacked, dim)
        if (stacked and dim == 0) or any(shapes[k] != shapes[keys_[0]] for keys_ in sources for k in keys_):
            raise CannotDefer(f"--model {spec}: {target}'s pieces in the files differ in shape",
                              hint="it is loaded whole by from_pretrained on every rank instead")
    return renamed, fused


def _in_declared_order(by_pattern: dict[str, list[str]], converters: list[Any]) -> list[str]:
    """The source patterns in the order their converter declares them (the concatenation's)."""
    declared = next(c.source_patterns for c in converters if set(by_pattern) <= set(c.source_patterns))
    return [p for p in declared if p in by_pattern]
