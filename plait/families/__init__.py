"""The model families `plait train` knows, found by the `--model` text.

Each family is one record (plait.families.record.Family) in one file: plait's GPT
(`gpt.py`), the ResNets (`resnet.py`), a local Hugging Face directory (`hf.py`). A user's
family is one file too: it calls `register(Family(...))` when imported, and
`plait train --imports MODULE` imports it on every rank before `--model` is looked up (as
torchtitan's custom imports do). The first family whose `matches` accepts the text wins;
built-in families are asked last, so a user's family may take any name.

Torch-free: the CLI validates and spawns with it, and `--help` lists what it holds.
"""

from __future__ import annotations

import importlib
from typing import Any

from plait.errors import PlaitError
from plait.families.gpt import record as gpt
from plait.families.hf import record as hf
from plait.families.resnet import record as resnet
from plait.families.record import Family

__all__ = ["Family", "family_for", "family_of", "import_families", "register", "registered", "shape_of"]

BUILT_IN: tuple[Family, ...] = (hf.FAMILY, resnet.FAMILY, gpt.FAMILY)
_added: list[Family] = []


def register(family: Family) -> Family:
    """Make `family` available to `--model` (a user's module calls this when imported)."""
    if any(f.name == family.name for f in registered()):
        raise PlaitError(f"a model family named {family.name!r} is already registered",
                         hint="give the family another name")
    _added.append(family)
    return family


def registered() -> tuple[Family, ...]:
    """Every family, users' first."""
    return (*_added, *BUILT_IN)


def family_for(model: str) -> Family:
    """The family `--model MODEL` names; one PlaitError listing what plait trains otherwise."""
    for family in registered():
        if family.matches(model):
            return family
    raise PlaitError(f"unknown --model {model!r}",
                     hint="plait trains: " + "; ".join(f"{f.models}" for f in registered()))


def family_of(config: Any) -> Family:
    """The family of a TrainConfig's `--model`, after importing its `--imports`."""
    import_families(config.imports)
    return family_for(config.model)


def shape_of(model: str) -> object:
    """What `plait estimate` and `plait plan` read of `--model`'s shape (a GPTConfig), or a
    PlaitError naming the families that have one."""
    shape = family_for(model).shape(model)
    if shape is None:
        raise PlaitError(f"plait estimate has no shape for --model {model!r}",
                         hint="estimate a transformer: a GPT preset or hf:DIR (or give --params N)")
    return shape


def import_families(modules: str) -> None:
    """Import each of `modules` ("a.b,c"): a module that registers a family, for --imports."""
    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise PlaitError(f"--imports {name}: cannot import it ({exc})",
                             hint="give a module on the Python path (python -c 'import MODULE' must work)") from None
