"""A pipeline step's span, by running the schedule the runner executes with each action's cost.

The runner follows plait.schedule's lists; so does this. Every action (F, B, or a backward's
halves I and W) on pipeline rank r costs a share of that rank's micro-batch (its compute and
the tp, cp and ep traffic it waits for, time.py), scaled by the blocks of the chunk it runs,
and starts once its inputs exist and its rank is free (plait.schedule.build.execute's rule).
An input made on another rank arrives a message later: the p2p transfer is a delay on that
edge of the schedule, not time of either rank (plait posts its sends without waiting). Each
rank's last end is its own path through the schedule (`rank_ends`); the step adds each rank's
own tail to its path (time.assemble). The span's idle time is the bubble: for even stages it comes to the textbook
(p − 1)/(m + p − 1) for GPipe and 1F1B and (p − 1)/v slots interleaved, and ZB-H1's
deferred weight gradients fill what they can; for uneven stages, or a first and last stage
made heavier by the embedding and the head, it is what the schedule does with them.

Shares of a rank's micro-batch: a forward φ (a third; a quarter with full recomputation,
whose backward reruns the forward), its backward the rest; split, the weight gradients W
cost a forward and the input gradients I the remainder.

Long schedules are timed at fewer micro-batches: up to FULL_ACTIONS actions are run as they
are; past that, the first m' micro-batches (a multiple of pp where m is, so that
interleaving's rounds stay pp; else m' ≡ m mod pp, rounds a little larger as m's are) are
run and each further micro-batch adds the steady state's pace: the slowest rank's
micro-batch, or the last timed round's pace where unequal chunks leave even that rank idle.
Against a full run that comes within 0.1% on lopsided end stages, uneven cuts and counts pp
does not divide (tests/test_estimate_pipeline.py).

`lower_bound` is what the planner sorts and prunes shapes by before it runs a schedule: no
rank can start before micro-batch 0's forward reaches it, nor finish before its own work,
nor end the step before its last backward has run back to the first stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from plait.schedule.action import Action
from plait.schedule.build import build_schedule, execute, inputs, output

FULL_ACTIONS = 6144  # actions timed one by one at most; beyond, the steady state's pace


@dataclass(frozen=True)
class Compiled:
    """A schedule's actions in an order where each comes after what it waits for, with the
    index of each one's predecessors (the previous action on its rank, the inputs it needs)."""

    ranks: tuple[int, ...]
    kinds: tuple[str, ...]
    chunks: tuple[int, ...]
    waits: tuple[tuple[int, int, int], ...]  # padded with len(ranks): a start at 0
    crosses: tuple[tuple[bool, bool, bool], ...]  # each wait on another rank's action: a message on that edge


@functools.lru_cache(maxsize=256)
def compiled(schedule: str, pp: int, m: int, v: int) -> Compiled:
    """`schedule` for pp ranks and m micro-batches, v chunks a rank, in the order
    plait.schedule.build.execute starts its actions (which respects every wait)."""
    order: list[tuple[Action, int]] = []

    def record(action: Action, rank: int) -> float:
        order.append((action, rank))
        return 1.0

    execute(build_schedule(schedule, pp, m, v), pp, v, record)
    index: dict[tuple[str, int, int], int] = {}
    last_on_rank: dict[int, int] = {}
    waits: list[tuple[int, ...]] = []
    crosses: list[tuple[bool, ...]] = []
    for i, (action, rank) in enumerate(order):
        stage = action.stage(rank, pp)
        needs = inputs(action, stage, pp * v - 1)
        found = [index[key] for key in needs] + ([last_on_rank[rank]] if rank in last_on_rank else [])
        pad = 3 - len(found)  # at most 3: an I's gradient, forward, rank
        waits.append(tuple(found + [len(order)] * pad))
        crosses.append(tuple([order[j][1] != rank for j in found] + [False] * pad))
        index[output(action, stage)] = i
        last_on_rank[rank] = i
    return Compiled(tuple(r for _, r in order), tuple(a.kind for a, _ in order),
                    tuple(a.chunk for a, _ in order), tuple(waits), tuple(crosses))


def shares(forward: float) -> dict[str, float]:
    """Each kind's share of a micro-batch on a rank, given the forward's share."""
    return {"F": forward, "B": 1.0 - forward, "W": forward, "I": 1.0 - 2.0 * forward}


def makespan(schedule: str, pp: int, m: int, v: int, rank_s: list[float], forward: float,
             chunk_weights: list[list[float]] | None = None, edge_s: float = 0.0) -> float:
    """Seconds from the first forward to the last action of a step of m micro-batches: the
    latest of `rank_ends`."""
    return max(rank_ends(schedule, pp, m, v, rank_s, forward, chunk_weights, edge_s))


def rank_ends(schedule: str, pp: int, m: int, v: int, rank_s: list[float], forward: float,
              chunk_weights: list[list[float]] | None = None, edge_s: float = 0.0) -> tuple[float, ...]:
    """When each pipeline rank's last action of the step ends, from the first forward.

    `rank_s[r]`: one micro-batch through all of rank r's chunks (forward and backward, without
    its messages); `forward`: the forward's share of it; `chunk_weights[r][c]`: chunk c's share
    of rank r's work (its blocks over the rank's; equal when not given); `edge_s`: a message's
    delay on each edge from one rank's action to another's (pp.message_s)."""
    weights = tuple(tuple(row) for row in chunk_weights) if chunk_weights else ((1.0 / v,) * v,) * pp
    return _rank_ends(schedule, pp, m, v, tuple(rank_s), forward, weights, edge_s)


@functools.lru_cache(maxsize=4096)
def _rank_ends(schedule: str, pp: int, m: int, v: int, rank_s: tuple[float, ...], forward: float,
               weights: tuple[tuple[float, ...], ...], edge_s: float) -> tuple[float, ...]:
    """rank_ends, cached: the planner asks again for every ZeRO option of a shape."""
    timed = _timed_micro_batches(schedule, pp, m, v)
    ends = _run(compiled(schedule, pp, timed, v), rank_s, shares(forward), weights, edge_s)
    if timed == m:
        return ends
    # The steady state's pace: the slowest rank's micro-batch, or slower where chunks of
    # unequal weight (or messages) leave even that rank idle (read off the last group of pp timed).
    earlier = _run(compiled(schedule, pp, timed - pp, v), rank_s, shares(forward), weights, edge_s)
    pace = max(max(rank_s), (max(ends) - max(earlier)) / pp)
    return tuple(end + (m - timed) * pace for end in ends)


def _run(plan: Compiled, rank_s: tuple[float, ...], share: dict[str, float],
         weights: tuple[tuple[float, ...], ...], edge_s: float) -> tuple[float, ...]:
    """Each rank's last end in a compiled schedule: each action ends its cost after the last of
    its waits, a wait on another rank's action `edge_s` later (the message)."""
    costs = [rank_s[rank] * share[kind] * weights[rank][chunk]
             for rank, kind, chunk in zip(plan.ranks, plan.kinds, plan.chunks)]
    ends = [0.0] * (len(costs) + 1)  # the last: what a padded wait reads
    last = [0.0] * (max(plan.ranks) + 1)
    for i, ((a, b, c), (x, y, z)) in enumerate(zip(plan.waits, plan.crosses)):
        ends[i] = max(ends[a] + edge_s * x, ends[b] + edge_s * y, ends[c] + edge_s * z) + costs[i]
        last[plan.ranks[i]] = ends[i]
    return tuple(last)


def _timed_micro_batches(schedule: str, pp: int, m: int, v: int) -> int:
    """m, or the most micro-batches (at least 3·pp, so that the last round runs in the steady
    state, and as many over a multiple of pp as m, so that interleaving's rounds are as close
    to m's as that many allow) whose schedule has no more than FULL_ACTIONS actions."""
    actions_per_micro_batch = pp * v * (3 if schedule == "zb-h1" else 2)
    if m * actions_per_micro_batch <= FULL_ACTIONS:
        return m
    groups = max(3, FULL_ACTIONS // (actions_per_micro_batch * pp))
    timed = groups * pp + m % pp
    return m if timed >= m else timed


def lower_bound(schedule: str, pp: int, m: int, v: int, rank_s: list[float], forward: float,
                chunk_weights: list[list[float]] | None = None, edge_s: float = 0.0) -> float:
    """A span no run of the schedule beats (so the planner may prune by it): for every rank,
    micro-batch 0's forward through the chunk 0 of the ranks before it, then its own m
    micro-batches, then (but for ZB-H1, whose last action may be a deferred weight gradient
    that nothing waits on) its last backward, of chunk 0 in every schedule, run back through
    those ranks."""
    weights = chunk_weights or [[1.0 / v] * v for _ in range(pp)]
    share = shares(forward)
    best, head, tail = 0.0, 0.0, 0.0
    for rank in range(pp):
        busy = m * rank_s[rank]
        best = max(best, head + busy + (0.0 if schedule == "zb-h1" else tail))
        step = rank_s[rank] * weights[rank][0]
        head += step * share["F"] + edge_s  # and its message on to the next rank
        tail += step * share["B"] + edge_s
    return best
