"""hf:DIR's safetensors files as the source of a meta-built model's weights: each rank reads only its slices.

A pretrained model on the meta path is built from its config on the meta device (its seeded
initialisation recorded: plait.parallel.deferred), cut by parallelize, and then each tensor
a rank holds is read from the file that holds it (`model.safetensors`, or the shard
`model.safetensors.index.json` names): only the block the rank's placement says it holds,
through safetensors' slice reads of the mapped file, converted to the model's dtype per
block. A tensor the files lack starts from the seed, and the user is told which (as
`from_pretrained` does). A file is opened for each read and closed after it: the pages a
read touches of the mapped file count in the process's resident memory while the mapping
lives (a block of columns touches nearly every page of its tensor), so keeping every file
open would hold all the pages a rank ever read. Before any of it, every rank compares the files' headers with the
model's names and shapes alike, so a refusal is every rank's:

- a tensor of another shape: refused by name;
- a key the model does not name: transformers may rename or fuse it as it loads (per-expert
  weights stacked into one tensor): such keys are read by blocks through the same
  declarations (converted.py); a conversion that reading cannot honour, or a key no
  conversion names, leaves the model to be built whole by `from_pretrained` (`CannotDefer`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.hf.config import HFModelDir
from plait.models.hf.converted import Fused, conversions
from plait.parallel.deferred import CannotDefer
from plait.parallel.materialize import Source
from plait.parallel.pieces import persistent_buffers


class SafetensorsWeights:
    """Tensors by the model's names from DIR's safetensors files (a block of one on request),
    else from `seed` (the meta build's replay)."""

    def __init__(self, hf: HFModelDir, model: nn.Module, seed: Source):
        from safetensors import safe_open

        self.spec, self.seed = f"hf:{hf.path}", seed
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in hf.weights:
            with self._open(safe_open, path) as handle:
                for key in handle.keys():
                    self.where[key], self.shapes[key] = path, tuple(handle.get_slice(key).get_shape())
        self.key: dict[str, str] = {name: name for name in self.where}  # the model's name -> its key in the files
        self.fused: dict[str, Fused] = {}  # the model's tensors the files keep in pieces (converted.py)
        self._check(model)

    def _open(self, safe_open: Any, path: Path) -> Any:
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
            raise PlaitError(f"--model {self.spec}: {path.name} is not a readable safetensors file "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                             hint="check the file (load it with safetensors), or remove it to start from the seed"
                             ) from None

    def _check(self, model: nn.Module) -> None:
        """Every rank alike, from the headers: shapes, keys the model does not name, and a
        note for the tensors the files lack."""
        named = _state(model)
        if set(self.where) - set(named):  # keys transformers renames or fuses as it loads
            renamed, self.fused = conversions(model, sorted(self.where), self.shapes, named, self.spec)
            self.key = renamed
            unexpected = sorted(set(renamed) - set(named)) + sorted(set(self.fused) - set(named))
            if unexpected:
                raise CannotDefer(f"--model {self.spec}: its files hold {len(unexpected)} tensor(s) the model does "
                                  f"not name, e.g. {unexpected[0]}",
                                  hint="it is loaded whole by from_pretrained on every rank instead")
        for name, tensor in named.items():
            shape = self.fused[name].shape if name in self.fused else self.shapes.get(self.key.get(name, ""))
            if shape is not None and shape != tuple(tensor.shape):
                where = self.where[self.key[name]].name if name in self.key else "its files"
                raise PlaitError(f"--model {self.spec}: {name} has shape {shape} in {where}, "
                                 f"and config.json gives {tuple(tensor.shape)}",
                                 hint="the weights belong to another config.json; use the pair that was "
                                      "saved together")
        missing = sorted(set(named) - set(self.key) - set(self.fused))
        if missing and os.environ.get("RANK", "0") == "0":
            print(f"plait: note: --model {self.spec}: {len(missing)} weight(s) not in its files start from the seed: "
                  f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}", flush=True)

    def __call__(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        return self.block(name, None, None)

    def block(self, name: str, offsets: tuple[int, ...] | None, lengths: tuple[int, ...] | None) -> torch.Tensor:
        """The block of `name` at `offsets` of `lengths` (None: the whole tensor), read alone."""
        from safetensors import safe_open

        if name in self.fused:
            fused = self.fused[name]
            return fused.block(offsets or (0,) * len(fused.shape), lengths or fused.shape, self._slice)
        key = self.key.get(name)
        block = None if offsets is None else tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
        if key is None:
            whole = self.seed(name)
            return whole if block is None else whole[block]
        with safe_open(str(self.where[key]), framework="pt") as handle:  # closed after the read: see the docstring
            return handle.get_tensor(key) if block is None else handle.get_slice(key)[block]

    def _slice(self, key: str, block: tuple[slice, ...]) -> torch.Tensor:
        """A slice of the file's tensor `key`, read alone."""
        from safetensors import safe_open

        with safe_open(str(self.where[key]), framework="pt") as handle:
            return handle.get_slice(key)[block]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of `model` may hold: its parameters (a tied one by its first name,
    as save_pretrained keeps it) and persistent buffers."""
    return {**dict(model.named_parameters()), **dict(persistent_buffers(model))}
