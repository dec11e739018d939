"""Expert parallelism's placement rule: where this ep rank's experts sit among all of them.

An experts module's parameters (experts, ...) keep experts / ep of their first dimension on
each ep rank, and the edp ranks hold the same ones: split over "ep" along dimension 0,
replicated over "edp" (plait/parallel/placement.py). Gradient sync, ZeRO, the gradient norm
and checkpoints read that placement as they read any other; none asks "is this an expert?".
"""

from __future__ import annotations

from plait.parallel.placement import Placement, Split
from plait.runtime.mesh import EXPERT, EXPERT_SYNC

def expert_placement(rank: int, parts: int, full_shape: tuple[int, ...]) -> Placement:
    """The rule: ep rank `rank` of `parts` holds its block of the first dimension (the
    experts), replicated over the edp ranks, which hold the same experts."""
    return Placement(tuple(full_shape), (Split(EXPERT, 0, rank, parts),), replicate=EXPERT_SYNC)

