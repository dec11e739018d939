"""Checks that run a forward, on a model no process holds whole: a copy cut to one block of each kind.

plait.parallel.probe runs the whole model on a few tokens before tp, ep and cp, and the split
model after, and refuses a split that changes what the model computes; a transformers
model's adapter also runs it to check its pipeline cut and to find its SP regions. A model
built on the meta device has no values to run. These checks run on a stand-in instead: the
same modules at the full width (embedding, head, norms), but only the first block of each
kind (blocks whose parameters have other names or shapes, such as a dense block before the
mixtures of experts), and at least two. Its tensors come from the same source as the
model's, under the model's names, so the checks see the run's own weights; what they find
in a block (a parameter whose gradient tp must sum, an SP region) holds for every block of
its kind. `stand_in(model)` is what an adapter's forward check runs: the model itself, or the
copy parallelize registered for it.
"""

from __future__ import annotations

import copy
import re
import weakref
from dataclasses import dataclass

from torch import nn

from plait.errors import PlaitError
from plait.parallel.deferred import is_meta
from plait.parallel.seam import adapter_of

MIN_BLOCKS = 2
_STAND_INS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


@dataclass
class ReducedCopy:
    """The copy, and how its names map back to the model's."""

    model: nn.Module
    blocks: str  # the block list's name ("": none, the copy is the whole model)
    kept: list[int]  # the model's index of each block the copy keeps
    kinds: list[int]  # the kind of each block of the model (blocks of one kind have the same parameters)

    def original(self, name: str) -> str:
        """The model's name of the copy's tensor or module `name` (block j of the copy is block kept[j])."""
        index, rest = self._split(name)
        return name if index is None else f"{self.blocks}.{self.kept[index]}{rest}"

    def alike(self, name: str) -> list[str]:
        """The model's names of the model's `name` in every block of the same kind (or `name` itself)."""
        index, rest = self._split(name)
        if index is None:
            return [name]
        return [f"{self.blocks}.{i}{rest}" for i, kind in enumerate(self.kinds) if kind == self.kinds[index]]

    def widen(self, plan: dict[str, str]) -> dict[str, str]:
        """A plan found on the copy (whose keys may name its blocks) for the whole model."""
        return {wide: style for key, style in plan.items() for wide in self.alike(self.original(key))}

    def _split(self, name: str) -> tuple[int | None, str]:
        """(the block index `name` starts with, the rest of it), or (None, name)."""
        match = re.match(rf"^{re.escape(self.blocks)}\.(\d+)(\..*)?$", name) if self.blocks else None
        return (int(match.group(1)), match.group(2) or "") if match else (None, name)


def reduced_copy(model: nn.Module, adapter: object = None) -> ReducedCopy:
    """A meta copy of `model` holding one block of each kind (at least MIN_BLOCKS)."""
    twin = copy.deepcopy(model)
    name, blocks = _block_list(twin, adapter_of(twin, adapter))
    if blocks is None or len(blocks) <= MIN_BLOCKS:
        return ReducedCopy(twin, "", [], [])
    signatures: list[tuple] = []
    kinds, kept = [], []
    for index, block in enumerate(blocks):
        signature = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
        if signature not in signatures or len(kept) < MIN_BLOCKS:
            signatures.append(signature)
            kept.append(index)
        kinds.append(kept[signatures.index(signature)])
    parent, _, attr = name.rpartition(".")
    kept_blocks = [blocks[i] for i in kept]
    setattr(twin.get_submodule(parent) if parent else twin, attr,
            nn.Sequential(*kept_blocks) if isinstance(blocks, nn.Sequential) else nn.ModuleList(kept_blocks))
    return ReducedCopy(twin, name, kept, kinds)


def _block_list(model: nn.Module, adapter: object) -> tuple[str, nn.Module | None]:
    """(name, the ModuleList or Sequential) holding the adapter's blocks, or ("", None)."""
    try:
        wanted = [id(block) for block in adapter.blocks(model)]  # type: ignore[attr-defined]
    except (PlaitError, AttributeError):
        return "", None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and name and [id(m) for m in module] == wanted:
            return name, module
    return "", None


def register_stand_in(model: nn.Module, twin: nn.Module) -> None:
    """`twin` runs the forward checks asked of the meta model `model` (until `model` is gone)."""
    _STAND_INS[model] = twin


def drop_stand_in(model: nn.Module) -> None:
    """Release the copy made for `model` (its memory: a block of each kind, the embedding, the head)."""
    _STAND_INS.pop(model, None)


def stand_in(model: nn.Module) -> nn.Module:
    """The model a forward check runs: `model`, or for a meta model the copy registered for it."""
    if not is_meta(model):
        return model
    twin = _STAND_INS.get(model)
    if twin is None:
        raise PlaitError(f"a check runs a forward of {type(model).__name__}, which is on the meta device",
                         hint="parallelize it with source= (it makes a copy with values for such checks)")
    return twin
