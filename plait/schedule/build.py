"""Pipeline schedules as plain data: which action each rank runs, and in which order.

A schedule is `list[list[Action]]`, one list per pipeline rank, run top to bottom. Keeping
it as data (no torch in this module) means we can prove a schedule correct — every
micro-batch forwarded and backwarded once, no rank waiting forever — and time it, without
starting a process. The executor's only job is to follow the list.

Placement: with `v` virtual stages per rank, rank r holds stages r, r + pp, r + 2pp, ...
(round robin, as in Megatron's interleaved schedule), so stage = chunk * pp + rank.
"""

from __future__ import annotations

from typing import Callable

from plait.errors import PlaitError
from plait.interleave import rank_order
from plait.schedule.action import Action
from plait.schedule.timeline import Slot, Timeline
from plait.rules import SCHEDULES, check_choice, check_virtual_stages

Schedule = list[list[Action]]


def _check_sizes(pp: int, m: int) -> None:
    if pp < 1 or m < 1:
        raise PlaitError(f"a pipeline needs pp >= 1 and m >= 1 micro-batches; got pp={pp}, m={m}")


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe: every forward, then every backward. Simple, but holds m activations."""
    _check_sizes(pp, m)
    order = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return [list(order) for _ in range(pp)]


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B: same bubble as GPipe, but a rank never holds more than pp - rank activations.

    Rank r runs pp - r - 1 warm-up forwards (enough to keep the stages after it busy),
    then alternates one forward with one backward, then drains the remaining backwards.
    """
    _check_sizes(pp, m)
    return [_one_f_one_b_rank(pp, m, rank) for rank in range(pp)]


def _one_f_one_b_rank(pp: int, m: int, rank: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
    return order + [Action("B", i) for i in range(m - warmup, m)]


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): each rank holds v smaller stages.

    The fill and drain of the pipe then take 1/v as long, cutting the bubble v-fold.
    Micro-batches go through in rounds of at least pp (m < pp: one round of m): a rank runs
    a round on chunk 0, then the same round on chunk 1, and so on (plait.interleave).
    """
    _check_sizes(pp, m)
    check_virtual_stages(max(pp, 2), "interleaved", v)  # v >= 2, whatever pp
    return [_interleaved_rank(pp, m, v, rank) for rank in range(pp)]


def _interleaved_rank(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """The rank's actions in Megatron's interleaved order (plait.interleave: one definition,
    which the estimator reads too)."""
    return [Action(kind, mb, chunk) for kind, mb, chunk in rank_order(pp, m, v, rank)]


def zero_bubble_h1(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with each backward split into I and W.

    Forwards and input-grads keep 1F1B's order, so no rank holds more than pp - rank
    activations. Weight-grads are what fill the bubbles: rank r puts its W's off by r
    steps, and the later stages, which would idle while the backward travels back to
    stage 0, spend that time on the W's they put off.
    """
    _check_sizes(pp, m)
    return [_zb_h1_rank(pp, m, rank) for rank in range(pp)]


def _zb_h1_rank(pp: int, m: int, rank: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    weights = iter(range(m))
    for i in range(m):
        if i < m - warmup:
            order.append(Action("F", warmup + i))
        order.append(Action("I", i))
        if i >= rank:
            order.append(Action("W", next(weights)))
    return order + [Action("W", i) for i in weights]


def build_schedule(name: str, pp: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved" or "zb-h1")."""
    check_choice("schedule", name, SCHEDULES)
    if name == "interleaved":
        return interleaved_1f1b(pp, m, v)
    check_virtual_stages(pp, name, v)
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1}
    return builders[name](pp, m)


def validate(schedule: Schedule, pp: int, m: int, v: int = 1) -> None:
    """Raise PlaitError unless `schedule` is complete, ordered and cannot deadlock.

    Complete: every (micro-batch, stage) is forwarded once and backwarded once, either by
    one B or by one I then one W. Deadlock-free: running the ranks' lists as blocking
    processes (an action waits for the activation or gradient it receives; sends never
    block, like isend) finishes every list.
    """
    if len(schedule) != pp:
        raise PlaitError(f"schedule has {len(schedule)} rank lists but pp={pp}")
    _check_coverage(schedule, pp, m, v)
    execute(schedule, pp, v, lambda action, rank: 1.0)


def _check_coverage(schedule: Schedule, pp: int, m: int, v: int) -> None:
    seen: dict[tuple[str, int, int], list[int]] = {}
    for rank, actions in enumerate(schedule):
        for pos, act in enumerate(actions):
            if not (0 <= act.microbatch < m and 0 <= act.chunk < v):
                raise PlaitError(f"rank {rank} runs {act.label(v)}: "
                                 f"micro-batch must be < {m}, chunk < {v}")
            seen.setdefault((act.kind, act.microbatch, act.stage(rank, pp)), []).append(pos)
    problems = [p for mb in range(m) for stage in range(pp * v)
                if (p := _coverage_problem(seen, mb, stage))]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise PlaitError("invalid schedule: " + "; ".join(problems[:3]) + more)


def _coverage_problem(seen: dict[tuple[str, int, int], list[int]], mb: int, stage: int) -> str:
    """What is wrong with micro-batch `mb` on `stage`, or "" if nothing."""
    count = {k: len(seen.get((k, mb, stage), [])) for k in "FBIW"}
    where = f"micro-batch {mb} on stage {stage}"
    if count["F"] != 1:
        return f"{where} is forwarded {count['F']} times, not once"
    if (count["B"], count["I"], count["W"]) not in ((1, 0, 0), (0, 1, 1)):
        return (f"{where} has {count['B']} B, {count['I']} I, {count['W']} W; "
                "needs one B, or one I and one W")
    back = "B" if count["B"] else "I"
    if seen[(back, mb, stage)][0] < seen[("F", mb, stage)][0]:
        return f"{where} runs {back} before its F"
    if back == "I" and seen[("W", mb, stage)][0] < seen[("I", mb, stage)][0]:
        return f"{where} runs W before its I"
    return ""


def inputs(act: Action, stage: int, last_stage: int) -> list[tuple[str, int, int]]:
    """Results this action must wait for: (what, micro-batch, stage) keys. A forward waits
    for the stage before's forward; a backward (or input gradient) for the stage after's
    gradient and its own forward; a weight gradient for its input gradient."""
    mb = act.microbatch
    if act.kind == "F":
        return [("F", mb, stage - 1)] if stage > 0 else []
    if act.kind == "W":
        return [("grad", mb, stage)]
    upstream = [("grad", mb, stage + 1)] if stage < last_stage else []
    return upstream + [("F", mb, stage)]


def output(act: Action, stage: int) -> tuple[str, int, int]:
    """What `act` on `stage` makes, as `inputs` names it: a forward its activation, a backward
    or input gradient the gradient the stage before waits for, a weight gradient its own."""
    return ("grad" if act.kind in "BI" else act.kind, act.microbatch, stage)


Done = dict[tuple[str, int, int], float]  # (what, micro-batch, stage) -> time it finished


def execute(schedule: Schedule, pp: int, v: int,
            cost: Callable[[Action, int], float]) -> list[list[Slot]]:
    """Run every rank's list in order, each action starting once its inputs exist and its rank
    is free, `cost(action, rank)` seconds long: the timing the estimator prices a pipeline
    step with (plait.estimate.pipeline), and `simulate`'s.

    A rank runs until an input is missing, then waits on that input; producing it wakes the
    ranks waiting on it. Each action is looked at a bounded number of times, so a 64-rank
    schedule of tens of thousands of actions takes a fraction of a second."""
    done: Done = {}
    rows: list[list[Slot]] = [[] for _ in schedule]
    waiting: dict[tuple[str, int, int], list[int]] = {}
    ready = list(range(len(schedule)))
    while ready:
        rank = ready.pop()
        actions, row = schedule[rank], rows[rank]
        while len(row) < len(actions):
            act = actions[len(row)]
            stage = act.stage(rank, pp)
            needs = inputs(act, stage, pp * v - 1)
            missing = next((key for key in needs if key not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            start = max([row[-1].end if row else 0.0] + [done[key] for key in needs])
            row.append(Slot(act, start, start + cost(act, rank)))
            made = output(act, stage)
            done[made] = row[-1].end
            ready.extend(waiting.pop(made, ()))
    _raise_if_stuck(schedule, rows, pp, v, done)
    return rows


def _raise_if_stuck(schedule: Schedule, rows: list[list[Slot]], pp: int, v: int,
                    done: Done) -> None:
    stuck = []
    for rank, actions in enumerate(schedule):
        if len(rows[rank]) < len(actions):
            act = actions[len(rows[rank])]
            missing = [k for k in inputs(act, act.stage(rank, pp), pp * v - 1) if k not in done]
            waits = ", ".join(f"{what} of micro-batch {mb} on stage {s}" for what, mb, s in missing)
            stuck.append(f"rank {rank} at {act.label(v)} (waits for {waits})")
    if stuck:
        raise PlaitError("schedule deadlocks: " + "; ".join(stuck),
                         hint="order each rank's list so that what it receives is sent first")


def simulate(schedule: Schedule, pp: int, v: int = 1, cost_f: float = 1.0, cost_b: float = 2.0,
             cost_i: float = 1.0, cost_w: float = 1.0) -> Timeline:
    """Time `schedule` with fixed action costs and free communication.

    Costs are for one micro-batch through all the layers a rank holds; with v chunks per
    rank each action covers 1/v of them and so costs cost/v. That keeps totals equal
    across schedules: only the idle time differs.
    """
    costs = {"F": cost_f, "B": cost_b, "I": cost_i, "W": cost_w}
    rows = execute(schedule, pp, v, lambda action, rank: costs[action.kind] / v)
    return Timeline(pp=pp, v=v, rows=tuple(tuple(row) for row in rows))
