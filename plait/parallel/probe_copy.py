"""The split check on a model no process holds whole: a copy cut to one block of each kind.

plait.parallel.probe runs the whole model on a few tokens before tp, ep and cp, and the split
model after, and refuses a split that changes what the model computes. A model built on the
meta device has no values to run. Its split is checked on a copy instead: the same modules
at the full width (embedding, head, norms), but only the first block of each kind (blocks
whose parameters have other names or shapes, such as a dense block before the mixtures of
experts), and at least two. The copy's tensors come from the same source as the model's,
under the model's names, so the check sees the run's own weights; what it learns (the
parameters whose gradient tp must sum) is applied to every block of the same kind.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from torch import nn

from plait.errors import PlaitError
from plait.parallel.seam import pipeline_parts

MIN_BLOCKS = 2


@dataclass
class ReducedCopy:
    """The copy, and how its names map back to the model's."""

    model: nn.Module
    blocks: str  # the block list's name ("" : none, the copy is the whole model)
    kept: list[int]  # the model's index of each block the copy keeps
    kinds: list[int]  # the kind of each block of the model (blocks of one kind have the same parameters)

    def original(self, name: str) -> str:
        """The model's name of the copy's tensor `name` (block j of the copy is block kept[j])."""
        index = self._block_index(name)
        if index is None:
            return name
        return f"{self.blocks}.{self.kept[index]}.{name[len(self.blocks) + len(str(index)) + 2:]}"

    def alike(self, name: str) -> list[str]:
        """The model's names of `name` in every block of the same kind (or `name` itself)."""
        index = self._block_index(name)
        if index is None:
            return [name]
        rest, kind = name[len(self.blocks) + len(str(index)) + 2:], self.kinds[self.kept[index]]
        return [f"{self.blocks}.{i}.{rest}" for i, each in enumerate(self.kinds) if each == kind]

    def _block_index(self, name: str) -> int | None:
        if not self.blocks:
            return None
        match = re.match(rf"^{re.escape(self.blocks)}\.(\d+)\.", name)
        return int(match.group(1)) if match else None


def reduced_copy(model: nn.Module, adapter: object) -> ReducedCopy:
    """A meta copy of `model` holding one block of each kind (at least MIN_BLOCKS)."""
    twin = copy.deepcopy(model)
    try:
        name = pipeline_parts(twin, adapter, 1).blocks
    except PlaitError:
        name = ""
    blocks = twin.get_submodule(name) if name else None
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) <= MIN_BLOCKS:
        return ReducedCopy(twin, "", [], [])
    signatures: list[tuple] = []
    kinds, kept = [], []
    for index, block in enumerate(blocks):
        signature = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
        if signature not in signatures or len(kept) < MIN_BLOCKS:
            signatures.append(signature)
            kept.append(index)
        kinds.append(signatures.index(signature))
    parent, _, attr = name.rpartition(".")
    owner = twin.get_submodule(parent) if parent else twin
    setattr(owner, attr, type(blocks)(*[blocks[i] for i in kept]) if isinstance(blocks, nn.Sequential)
            else nn.ModuleList(blocks[i] for i in kept))
    return ReducedCopy(twin, name, kept, kinds)

