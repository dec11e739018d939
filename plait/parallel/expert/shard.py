"""Where this rank's experts sit among all of them: the mark an expert-parallel parameter carries.

An experts module's 3-D parameters (experts, ...) keep experts / ep of their first
dimension on each ep rank. The mark says which, so that gradient sync (over the ranks that
hold the same experts), the gradient norm (summed over the ranks that hold others) and
checkpoints (each block at its offset in the full tensor) need no other record. Imports
nothing of plait's, so every strategy may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXPERT_ATTR = "plait_expert_shard"


@dataclass(frozen=True)
class ExpertShard:
    """This ep rank's block of a parameter whose first dimension counts experts."""

    rank: int  # this rank's index along ep
    parts: int  # ep
    full_shape: tuple[int, ...]

    @property
    def offset(self) -> int:
        """The first expert this rank holds."""
        return self.rank * self.full_shape[0] // self.parts


def expert_shard_of(param: torch.Tensor) -> ExpertShard | None:
    """The mark of an expert-parallel parameter, or None for one every ep rank holds whole."""
    return getattr(param, EXPERT_ATTR, None)
