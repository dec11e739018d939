"""Layouts taking turns in one world, step by step: how the planner check (benchmarks/
planner_measured.py) and its slow test (tests/worlds/planner_world.py) measure each layout.

Each round every layout runs one step, so a slow stretch of a shared host lands on all of
them rather than on one. The order is shuffled every round, from one seed, so every rank of
the world runs the same order while no layout always follows the same one: in one 150-round
world of `small`'s 2-rank six, a step measured -0.4% to +0.2% on average after each of the
others (benchmarks/RESULTS.md, runs 32 to 34), which a fixed order leaves on one layout each.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

WARM_STEPS = 2  # each layout's first steps (the allocator grows, pages fault in), left out
ORDER_SEED = 0  # the rounds' shuffled orders, the same on every rank


class Steps(Protocol):
    """What takes a turn: a trainer (plait.train.loop.trainer.Trainer) or a stand-in."""

    def train_step(self, step: int) -> dict[str, Any]: ...


def take_turns(trainers: Sequence[Steps], rounds: int, seed: int = ORDER_SEED) -> list[list[float]]:
    """Each trainer's step times (`step_time_s`) over `rounds` rounds, every trainer once a
    round in an order drawn afresh from `seed`; its first WARM_STEPS left out."""
    times: list[list[float]] = [[] for _ in trainers]
    order, shuffler = list(range(len(trainers))), random.Random(seed)
    for step in range(rounds):
        shuffler.shuffle(order)
        for i in order:
            times[i].append(trainers[i].train_step(step)["step_time_s"])
    return [taken[WARM_STEPS:] for taken in times]
