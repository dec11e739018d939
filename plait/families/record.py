"""The family record: everything plait needs to know about one kind of model, in one place.

torchtitan's model spec is the idea: a family says how `--model` names it, how that name
becomes a checked config, what the estimator reads of its shape, and which training task
(plait.train.loop.task) builds, feeds and scores it. The task in turn names the model's adapter
(plait.parallel.seam) for the strategies. Nothing else in plait branches on the family:
the CLI finds the record by the `--model` text (`plait.families.family_for`), validation
calls its `check`, the rank's run calls its `task`.

Torch-free: `check` and `shape` run before any process starts (`plait train` validates, then
spawns), and `--help` lists the families. A record's `task` may import torch: it is called
on the ranks only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plait.errors import PlaitError


def _unchanged(config: Any) -> Any:
    return config


def _no_shape(spec: str) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring); `config` is a plait.train.config.settings.TrainConfig."""

    name: str  # the family's own name ("gpt", "resnet", "hf")
    models: str  # what `--model` takes, for --help and error hints: "tiny, small (,field=value)"
    matches: Callable[[str], bool]  # whether a `--model` text names this family
    task: Callable[[Any], Any]  # config -> the training task (plait.train.loop.task.Task); ranks only
    check: Callable[[Any], None]  # config -> None, or one PlaitError naming the fix (before spawning)
    resolve: Callable[[Any], Any] = _unchanged  # config -> config, e.g. the vocabulary following the data
    shape: Callable[[str], Any] = _no_shape  # `--model` -> the estimator's shape (a GPTConfig), or None
    memory: Callable[[Any, Any], float] | None = None  # (config, layout) -> estimated bytes per rank (--memory-limit)
    # The settings only some families read (plait.train.config.applies: FAMILY_FIELDS) that this
    # one does: another given a value is refused. None: the family reads them all.
    reads: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise PlaitError(f"a model family's name must be a plain word, got {self.name!r}")
