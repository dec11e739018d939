"""The estimator's pipeline span (plait.estimate.pipeline): the schedule the runner executes,
run with each action's cost, against the textbook bubbles, the schedule's own timing, small
cases worked by hand, and the lower bound the planner prunes with."""

from __future__ import annotations

import random

import pytest

from plait.estimate import pipeline
from plait.estimate.pipeline import lower_bound, makespan
from plait.schedule.build import build_schedule, simulate

THIRD = 1 / 3  # a forward's share of a micro-batch without recomputation


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1),
                                              ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3),
                                              ("zb-h1", 4, 8, 1), ("zb-h1", 6, 12, 1)])
def test_even_stages_give_the_textbook_bubble_and_the_schedules_own_timing(schedule: str, pp: int, m: int,
                                                                            v: int) -> None:
    """Stages alike, 3 s a micro-batch (F 1, B 2; I 1, W 1): (m + p − 1) micro-batches for
    GPipe and 1F1B, m + (p − 1)/v interleaved, m + (p − 1)/3 for ZB-H1 once m ≥ p; and
    always what plait.schedule.build.simulate times for the runner's lists."""
    span = makespan(schedule, pp, m, v, [3.0] * pp, THIRD)
    assert span == pytest.approx(simulate(build_schedule(schedule, pp, m, v), pp, v).makespan, rel=1e-12)
    textbook = {"gpipe": m + pp - 1, "1f1b": m + pp - 1, "interleaved": m + (pp - 1) / v,
                "zb-h1": m + (pp - 1) / 3}[schedule]
    assert span == pytest.approx(3.0 * textbook, rel=1e-12)


def test_zero_bubble_with_fewer_micro_batches_than_stages_is_worked_out_not_assumed() -> None:
    """ZB-H1 on 2 stages with one micro-batch: F0, F1, I1, then I0 and W0 on rank 0 (W1 beside
    them): 5 units, where a third of 1F1B's bubble would say 4."""
    assert makespan("zb-h1", 2, 1, 1, [3.0, 3.0], THIRD) == pytest.approx(5.0, rel=1e-12)


def test_a_lopsided_cut_idles_by_what_its_stages_cost() -> None:
    """1F1B, 2 stages, 2 micro-batches, rank 0 at 3 s a micro-batch (F 1, B 2), rank 1 at 6
    (F 2, B 4): F0 0-1, F1 1-2 on rank 0; rank 1 runs F0 1-3, B0 3-7, F1 7-9, B1 9-13; rank
    0's B0 7-9 and B1 13-15. 15 s: 2 × 6 of the slowest plus its fill and drain, 3. The heavy
    stage first: F0 0-2, F1 2-4, then it waits for B0's gradient (rank 1: F0 2-3, B0 3-5), B0
    5-9, B1 9-13: 13 s, 2 × 6 and 1 idle."""
    assert makespan("1f1b", 2, 2, 1, [3.0, 6.0], THIRD) == pytest.approx(15.0, rel=1e-12)
    assert makespan("1f1b", 2, 2, 1, [6.0, 3.0], THIRD) == pytest.approx(13.0, rel=1e-12)


def test_uneven_chunks_take_their_share_of_the_rank() -> None:
    """Interleaved with a rank's two chunks weighted 3:1 against 1:1: the same work on every
    rank, another span (the heavy chunk sits on the critical path of the fill)."""
    even = makespan("interleaved", 2, 4, 2, [4.0, 4.0], THIRD)
    skewed = makespan("interleaved", 2, 4, 2, [4.0, 4.0], THIRD, [[0.75, 0.25], [0.75, 0.25]])
    assert even == pytest.approx(16 + 4 / 2, rel=1e-12)
    assert skewed != pytest.approx(even, rel=1e-3)


def _lopsided(pp: int, rng: random.Random) -> list[float]:
    """Alike middle stages, the first (embedding) and last (head) heavier or lighter."""
    costs = [1.0] * pp
    costs[0], costs[-1] = rng.uniform(0.9, 1.3), rng.uniform(0.9, 1.5)
    return costs


def _cut_weights(cut: list[int], pp: int, v: int) -> tuple[list[float], list[list[float]]]:
    """Each rank's micro-batch (its blocks) and its chunks' shares under a --stage-layers cut."""
    chunks = [[cut[c * pp + r] for c in range(v)] for r in range(pp)]
    return [float(sum(ch)) for ch in chunks], [[n / sum(ch) for n in ch] for ch in chunks]


def test_long_schedules_timed_in_part_come_within_a_thousandth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past FULL_ACTIONS the span is the first micro-batches run, then the steady state's pace:
    on lopsided ends, with interleaved counts pp does not divide (m = 261 on 8 ranks, 403 on
    4: rounds a micro-batch or so over pp), and on an uneven interleaved cut (6,2,2,2,2,2,6,6
    over 4 ranks, whose unequal chunks idle even the slowest rank: paced at the slowest rank's
    micro-batch alone, it came 1.5% short), against the whole schedule run."""
    rng = random.Random(7)
    cut_s, cut_weights = _cut_weights([6, 2, 2, 2, 2, 2, 6, 6], 4, 2)
    cases = [("1f1b", 8, 512, 1, _lopsided(8, rng), None), ("interleaved", 8, 256, 2, _lopsided(8, rng), None),
             ("zb-h1", 16, 192, 1, _lopsided(16, rng), None), ("interleaved", 4, 200, 4, _lopsided(4, rng), None),
             ("interleaved", 4, 512, 2, cut_s, cut_weights), ("1f1b", 8, 400, 1, _lopsided(8, rng), None),
             ("interleaved", 8, 261, 2, _lopsided(8, rng), None), ("interleaved", 4, 403, 3, _lopsided(4, rng), None)]
    for schedule, pp, m, v, costs, weights in cases:
        assert pipeline._timed_micro_batches(schedule, pp, m, v) < m
        part = makespan(schedule, pp, m, v, costs, THIRD, weights)
        monkeypatch.setattr(pipeline, "FULL_ACTIONS", 10**9)
        whole = makespan(schedule, pp, m, v, costs, THIRD, weights)
        monkeypatch.undo()
        assert part == pytest.approx(whole, rel=1e-3), (schedule, pp, m, v)
    assert makespan("interleaved", 4, 512, 2, cut_s, THIRD, cut_weights) > 512 * max(cut_s) * 1.01


def test_the_planners_lower_bound_never_exceeds_the_span() -> None:
    """Random costs per rank, every schedule, full recomputation's shares too: the bound the
    planner sorts and prunes shapes by is never above the span it stands for, and is the span
    itself for even stages (the last rank's fill, work and drain)."""
    rng = random.Random(11)
    for case in range(160):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1"])
        pp = rng.choice([2, 3, 4, 8])
        v = rng.choice([2, 3]) if schedule == "interleaved" else 1
        # any m, fewer than pp too (interleaving's rounds then over pp, or one of m), and every tenth
        # case long enough to be timed in part
        m = rng.randint(1, 6 * pp)
        if case % 10 == 0:
            m = pp * 120 + rng.randint(0, pp - 1)
        costs = [rng.uniform(0.5, 1.5) for _ in range(pp)]
        weights = [[w / sum(ws) for w in ws] for ws in ([rng.uniform(0.2, 1.0) for _ in range(v)] for _ in range(pp))]
        forward = 0.25 if schedule != "zb-h1" and rng.random() < 0.3 else THIRD
        span = makespan(schedule, pp, m, v, costs, forward, weights)
        assert lower_bound(schedule, pp, m, v, costs, forward, weights) <= span * (1 + 1e-12), (schedule, pp, m, v)
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        assert lower_bound(schedule, 4, 8, v, [3.0] * 4, THIRD) == pytest.approx(
            makespan(schedule, 4, 8, v, [3.0] * 4, THIRD), rel=1e-12)
