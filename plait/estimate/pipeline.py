"""A pipeline step's span, by running the schedule the runner executes with each action's cost.

The runner follows plait.schedule's lists; so does this. Every action (F, B, or a backward's
halves I and W) on pipeline rank r costs a share of that rank's micro-batch (its compute and
the tp, cp and ep traffic it waits for, time.py), scaled by the blocks of the chunk it runs,
and starts once its inputs exist and its rank is free (plait.schedule.build.execute's rule).
An input made on another rank arrives a message later: the p2p transfer is a delay on that
edge of the schedule, not time of either rank (plait posts its sends without waiting). Each
rank's last end is its own path through the schedule (`rank_ends`); the step adds each rank's
accumulation and dp sync to its path, then the clip and the slowest update (time.assemble).
The span's idle time is the bubble: for even stages it comes to the textbook
(p − 1)/(m + p − 1) for GPipe and 1F1B and (p − 1)/v slots interleaved, and ZB-H1's
deferred weight gradients fill what they can; for uneven stages, or a first and last stage
made heavier by the embedding and the head, it is what the schedule does with them.

Shares of a rank's micro-batch: a forward φ (a third; a quarter with full recomputation,
whose backward reruns the forward), its backward the rest; split, the weight gradients W
cost a forward and the input gradients I the remainder.

On a crowded host (Hardware.crowding above 1: more ranks' threads than cores, each rank's
micro-batch priced with all of them at work) a rank that sleeps in its receive leaves its
share of the cores to the ranks at work, which then run faster (`Crowd.speed`): the schedule runs as
events (`_run_shared`), each rank's time at work shorter than its priced micro-batches.

Long schedules are timed at fewer micro-batches: up to FULL_ACTIONS actions are run as they
are; past that, the first m' micro-batches (a multiple of pp where m is, so that
interleaving's rounds stay pp; else m' ≡ m mod pp, rounds a little larger as m's are) are
run and each further micro-batch adds the steady state's pace: the slowest rank's
micro-batch, or the last timed round's pace where unequal chunks leave even that rank idle
(on a crowded host, that round's pace and each rank's work in it).
Against a full run that comes within 0.1% on lopsided end stages, uneven cuts and counts pp
does not divide (tests/test_estimate_pipeline.py).

`lower_bound` is what the planner sorts and prunes shapes by before it runs a schedule: no
rank can start before micro-batch 0's forward reaches it, nor finish before its own work,
nor end the step before its last backward has run back to the first stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

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


@dataclass(frozen=True)
class Crowd:
    """How a host's cores were shared when a rank's micro-batch was priced. `threads`: its
    ranks' threads for each core, every rank at work (Hardware.crowding; 1.0: a core each).
    `lone`: how much faster a rank worked while only as many ranks as cores did
    (Hardware.lone_speedup, the median of its micro-batches' readings; 0.0: `threads`, the cores shared
    without loss). A reading under `threads` is priced as `threads` (`fastest`): a rank that
    keeps a core to itself loses nothing to the ranks asleep, so a lower reading is the host's
    other work in the calibration's minute, which the run's minutes need not share."""

    threads: float = 1.0
    lone: float = 0.0

    @property
    def crowded(self) -> bool:
        return self.threads > 1.0

    @property
    def fastest(self) -> float:
        """The most `speed` gives, whatever the ranks at work: the pruning bounds divide by it.
        1.0 on a host with a core for each thread, whose schedule runs at its price whatever
        lone speedups its file holds; on a crowded one `lone`, never under `threads` (the
        cores shared without loss).

        The floor: eight calibrations on one 2-core host (the 4-rank planner check's runs 40,
        41, 43 and 44, two each) read the lone speedup's median at 1.88-2.03 where `threads`
        was 2.0, a run's two, 15-20 minutes apart, as far as 2.01 and 1.89, or 2.03 and 1.88.
        Two micro-batches of 4 measured 4.6-5.3% over one of 8 in those runs (dp 2 × pp 2),
        which the higher readings priced (+5.1% at 2.03) and the lower did not (-0.7% at 1.88).
        With the floor the four runs' six rank at 0.81, 0.90, 0.81 and 0.81 against their paired
        measurements, where the readings as they were ranked them at 0.35, 0.90, 0.81 and 0.46;
        run 46, priced with the floor (its readings 1.98 and 1.91), ranked 0.81, 0.46 as read;
        run 47 (1.87 both), 0.78, and 0.90 as read with every prediction 6-8% over, its middle
        four measured within 0.7% of each other (benchmarks/RESULTS.md)."""
        return max(self.lone, self.threads) if self.crowded else 1.0

    def speed(self, busy: int, pp: int) -> float:
        """How much faster than priced an action runs while `busy` of the pp pipeline ranks
        work: where their threads fit the cores, `fastest` (`lone`, never under `threads`);
        where they do not, the cores spread over them (pp / busy of the share each had with
        every rank at work). Every replica of the pipeline (dp, and a stage's tp or cp ranks)
        works or waits alike, so the fraction busy is the pipeline's."""
        if self.threads * busy <= pp:
            return self.fastest
        return pp / busy


ALONE = Crowd()


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
             chunk_weights: list[list[float]] | None = None, edge_s: float = 0.0, crowd: Crowd = ALONE) -> float:
    """Seconds from the first forward to the last action of a step of m micro-batches: the
    latest of `rank_ends`."""
    return max(rank_ends(schedule, pp, m, v, rank_s, forward, chunk_weights, edge_s, crowd))


def rank_ends(schedule: str, pp: int, m: int, v: int, rank_s: list[float], forward: float,
              chunk_weights: list[list[float]] | None = None, edge_s: float = 0.0,
              crowd: Crowd = ALONE) -> tuple[float, ...]:
    """When each pipeline rank's last action of the step ends, from the first forward.

    `rank_s[r]`: one micro-batch through all of rank r's chunks (forward and backward, without
    its messages); `forward`: the forward's share of it; `chunk_weights[r][c]`: chunk c's share
    of rank r's work (its blocks over the rank's; equal when not given); `edge_s`: a message's
    delay on each edge from one rank's action to another's (pp.message_s); `crowd`: how the
    host's cores were shared when `rank_s` was priced (`Crowd`): where its ranks outnumber its
    cores, a rank the schedule leaves idle gives its share of them to the ranks at work."""
    return rank_paths(schedule, pp, m, v, rank_s, forward, chunk_weights, edge_s, crowd).ends


class Paths(NamedTuple):
    """Each pipeline rank's step as the schedule runs it: when its last action ends (`ends`),
    its seconds at work in the schedule (`busy`), and how long its tail's work then takes
    (`tails`; its collectives after it take their price, `rank_paths`)."""

    ends: tuple[float, ...]
    busy: tuple[float, ...]
    tails: tuple[float, ...]


def rank_paths(schedule: str, pp: int, m: int, v: int, rank_s: list[float], forward: float,
               chunk_weights: list[list[float]] | None = None, edge_s: float = 0.0,
               crowd: Crowd = ALONE, tails: list[float] | None = None, syncs: list[float] | None = None) -> Paths:
    """`rank_ends`, each rank's seconds at work (m·rank_s[r]) and its tail's work, as priced.
    A rank's tail is what it does once its last action ends, up to the clip: its work
    (`tails[r]`, the accumulation), then its collectives (`syncs[r]`, the dp sync). On a
    crowded host the schedule runs as events, where a rank works faster while others wait:
    the last stage's tail, for one, runs while the first stage still works back through its
    backward, the first stage's once the others have finished. A collective is not shortened
    so, and takes its price: the first stage's dp all-reduce, its stage's pair alone at work,
    took 23.0 ms where it was calibrated at 23.8 with every rank at once (4 ranks of `small` on
    2 cores, dp 2 × pp 2), and ZeRO-1's reduce-scatter 32.7 against 35.0; priced at the lone
    pace they read 11.6 and 17.1."""
    weights = tuple(tuple(row) for row in chunk_weights) if chunk_weights else ((1.0 / v,) * v,) * pp
    tails = tuple(tails) if tails else (0.0,) * pp
    syncs = tuple(syncs) if syncs else (0.0,) * pp
    if not crowd.crowded:  # the tails move nothing: one cached run serves every ZeRO option of a shape
        ends, busy, _ = _rank_paths(schedule, pp, m, v, tuple(rank_s), forward, weights, edge_s, crowd,
                                    (0.0,) * pp, (0.0,) * pp)
        return Paths(ends, busy, tails)
    return _rank_paths(schedule, pp, m, v, tuple(rank_s), forward, weights, edge_s, crowd, tails, syncs)


@functools.lru_cache(maxsize=4096)
def _rank_paths(schedule: str, pp: int, m: int, v: int, rank_s: tuple[float, ...], forward: float,
                weights: tuple[tuple[float, ...], ...], edge_s: float, crowd: Crowd,
                tails: tuple[float, ...], syncs: tuple[float, ...]) -> Paths:
    """rank_paths, cached: the planner asks again for every ZeRO option of a shape (on a
    crowded host each option's tails make a run of their own)."""
    timed = _timed_micro_batches(schedule, pp, m, v)
    if not crowd.crowded:  # each rank works m·rank_s, then its tail: exactly so, that the step's digits stay put
        ends = _run(compiled(schedule, pp, timed, v), rank_s, shares(forward), weights, edge_s)
        if timed < m:
            ends = _paced(schedule, pp, m, v, timed, rank_s, forward, weights, edge_s, ends)
        return Paths(ends, tuple(m * s for s in rank_s), tails)
    if timed == m:
        return _run_shared(compiled(schedule, pp, m, v), rank_s, shares(forward), weights, edge_s, crowd, tails,
                           syncs)
    # past FULL_ACTIONS on a crowded host: the steady state's pace and each rank's work in it
    # read off the last group of pp timed (the slowest rank runs faster there while lighter
    # ones wait); the tails at their price after it
    none = (0.0,) * pp
    ends, busy, _ = _run_shared(compiled(schedule, pp, timed, v), rank_s, shares(forward), weights, edge_s, crowd,
                                none, none)
    earlier = _run_shared(compiled(schedule, pp, timed - pp, v), rank_s, shares(forward), weights, edge_s, crowd,
                          none, none)
    more, pace = m - timed, (max(ends) - max(earlier.ends)) / pp
    return Paths(tuple(end + more * pace for end in ends),
                 tuple(b + more * (b - e) / pp for b, e in zip(busy, earlier.busy)), tails)


def _paced(schedule: str, pp: int, m: int, v: int, timed: int, rank_s: tuple[float, ...], forward: float,
           weights: tuple[tuple[float, ...], ...], edge_s: float, ends: tuple[float, ...]) -> tuple[float, ...]:
    """Each rank's end after m micro-batches from its end after the `timed` first: each further
    one adds the steady state's pace, the slowest rank's micro-batch, or slower where chunks of
    unequal weight (or messages) leave even that rank idle (read off the last group of pp timed)."""
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


def _run_shared(plan: Compiled, rank_s: tuple[float, ...], share: dict[str, float],
                weights: tuple[tuple[float, ...], ...], edge_s: float,
                crowd: Crowd, tails: tuple[float, ...], syncs: tuple[float, ...] = ()) -> Paths:
    """`_run` on a crowded host, each rank's tail after its last action: the ranks at work
    share the cores, so every action's pace changes whenever a rank starts or stops
    (`Crowd.speed`). Run as events: each rank takes its next action once its waits have ended
    (a wait on another rank `edge_s` later), and all running actions advance together at the
    pace their number allows.

    A rank whose message is on its way counts as at work: on a crowded host a message's
    delay is mostly its receiver waiting for a core (a send/recv pair calibrated at 3.1-3.5 ms
    on 4 ranks sharing 2 cores, 0.8-0.9 ms on 2 ranks with a core each). A rank whose input
    is not yet being made sleeps in its receive and frees its core. A tail waits for its
    rank's last action alone, and its collectives (`syncs`) for its work: they take their
    price whoever else works (`rank_paths`), and a rank in one counts as at work."""
    pp, n = max(plan.ranks) + 1, len(plan.ranks)
    syncs = syncs or (0.0,) * pp
    queues: list[list[int]] = [[] for _ in range(pp)]
    for i, rank in enumerate(plan.ranks):
        queues[rank].append(i)
    waits = (list(zip(plan.waits, plan.crosses)) + [((), ())] + [((queue[-1],), (False,)) for queue in queues]
             + [((n + 1 + r,), (False,)) for r in range(pp)])
    synced = n + 1 + pp  # the first sync's index
    for r in range(pp):
        queues[r] += [n + 1 + r, synced + r]  # its tail's work, then its sync: after n actions and the padded wait
    ends: list[float | None] = [None] * n + [0.0] + [None] * 2 * pp  # n: what a padded wait reads
    left = [rank_s[rank] * share[kind] * weights[rank][chunk]
            for rank, kind, chunk in zip(plan.ranks, plan.kinds, plan.chunks)] + [0.0] + list(tails) + list(syncs)
    following, running, now = [0] * pp, {}, 0.0  # running: rank -> the action it works on
    close = 1e-12 * max(rank_s + tails + syncs)  # seconds that count as now: what adding up the steps leaves
    last, busy, tail = [0.0] * pp, [0.0] * pp, [0.0] * pp
    while running or any(following[r] < len(queues[r]) for r in range(pp)):
        arriving = {}  # rank -> when its next action's last message lands
        for r in range(pp):
            if r in running or following[r] == len(queues[r]):
                continue
            i = queues[r][following[r]]
            waited = [(ends[w], x) for w, x in zip(*waits[i])]
            if any(end is None for end, _ in waited):
                continue
            at = max(end + edge_s * x for end, x in waited)
            if at <= now + close:
                running[r] = i
                following[r] += 1
            else:
                arriving[r] = at
        pace = crowd.speed(len(running) + len(arriving), pp)
        paces = {i: 1.0 if i >= synced else pace for i in running.values()}
        step = min([left[i] / paces[i] for i in running.values()] + [at - now for at in arriving.values()])
        now += step
        for r, i in list(running.items()):
            left[i] -= step * paces[i]
            if i < n:
                busy[r] += step
            elif i < synced:  # its tail's work; its sync takes its price
                tail[r] += step
            if left[i] <= close:
                ends[i] = now
                if i < n:
                    last[r] = now
                del running[r]
    return Paths(tuple(last), tuple(busy), tuple(tail))


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
                chunk_weights: list[list[float]] | None = None, edge_s: float = 0.0, crowd: Crowd = ALONE) -> float:
    """A span no run of the schedule beats (so the planner may prune by it): for every rank,
    micro-batch 0's forward through the chunk 0 of the ranks before it, then its own m
    micro-batches, then (but for ZB-H1, whose last action may be a deferred weight gradient
    that nothing waits on) its last backward, of chunk 0 in every schedule, run back through
    those ranks. On a crowded host (`crowd`) that span at the fastest pace any rank reaches
    (`Crowd.fastest`)."""
    weights = chunk_weights or [[1.0 / v] * v for _ in range(pp)]
    share = shares(forward)
    best, head, tail = 0.0, 0.0, 0.0
    for rank in range(pp):
        busy = m * rank_s[rank]
        best = max(best, head + busy + (0.0 if schedule == "zb-h1" else tail))
        step = rank_s[rank] * weights[rank][0]
        head += step * share["F"] + edge_s  # and its message on to the next rank
        tail += step * share["B"] + edge_s
    return best / crowd.fastest
