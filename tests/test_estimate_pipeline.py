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
        pipeline._rank_paths.cache_clear()  # else the whole run reads the part's cached span
        whole = makespan(schedule, pp, m, v, costs, THIRD, weights)
        monkeypatch.undo()
        pipeline._rank_paths.cache_clear()
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


def test_on_a_crowded_host_a_waiting_rank_lends_its_cores_to_the_ranks_at_work() -> None:
    """Prices taken with every rank at work, two threads a core (4 one-thread ranks on 2
    cores: Crowd(2)). A pipeline rank that sleeps in its receive leaves its share of the cores
    to the others (Crowd.speed: one of 2 pipeline ranks at work runs twice as fast, or as fast
    as measured with a core to itself, `lone`; 3 of 4 take the cores 4/3 as much as 4 did).

    1F1B, 2 stages at 3 s a micro-batch (F 1, B 2), worked by hand:
    - one micro-batch: every action alone, all at twice the pace: 3 s, where alone on its
      cores it takes 6; with 0.5 s messages 4 (F 0-0.5, message, F 1-1.5, B 1.5-2.5, message,
      B 3-4); at a measured lone pace of 2.5, 2.4 s;
    - two micro-batches: rank 0's F0 alone (0-0.5), then F1 beside rank 1's F0 (0.5-1.5), rank
      1's B0 alone (1.5-2.5), its F1 beside rank 0's B0 (2.5-3.5), its B1 beside the rest of B0
      (3.5-4.5), the rest of B1 alone (4.5-5), rank 0's B1 alone (5-6): 6 s for 9, each rank
      at work 4.5 of its 6 priced seconds;
    - the same with 0.25 s messages: 6.5 s. A rank whose message is on its way counts as at
      work (its delay is mostly the wait for a core): rank 0's F1 runs at the shared pace from
      0.5, while rank 1's F0 is still a message (0.5-0.75), not at twice it;
    - one micro-batch with a 1 s tail of work on each rank (its accumulation): rank 1's tail
      (2-3) beside rank 0's B, which then ends alone (3-3.5), and rank 0's tail alone
      (3.5-4): each rank's path 4 and 3 s, where priced one after another, 7;
    - a 1 s dp sync instead: rank 1's (2-3) beside the start of rank 0's B, which ends alone
      (3-3.5), rank 0's after it. A collective takes its price whoever else works, so the
      paths' tails are their work's time alone, none here (time.assemble adds each sync at its
      price, tests/test_estimate_assembly.py);
    - both: rank 1's work (2-3) then its sync (3-4) beside rank 0's B, at work in each (2-4),
      then rank 0's work alone (4-4.5) and its sync; without a crowd each rank's work and sync
      simply follow its end."""
    two, measured = pipeline.Crowd(2.0), pipeline.Crowd(2.0, 2.5)
    # a lone rank measured slower than the cores' share is priced at that share, the host's
    # other work in the calibration's minute aside: 1 of 4 ranks as fast as 2 (threads 1.5)
    slow = pipeline.Crowd(1.5, 1.3)
    assert slow.speed(1, 4) == 1.5 and slow.speed(2, 4) == 1.5 and slow.speed(3, 4) == pytest.approx(4 / 3)
    assert slow.fastest == 1.5 and pipeline.Crowd(2.0, 1.88).speed(1, 2) == 2.0
    assert pipeline.Crowd(1.0, 2.2).fastest == 1.0  # a core a thread: the schedule at its price
    assert two.speed(1, 2) == 2.0 and two.speed(2, 2) == 1.0 and measured.speed(1, 2) == 2.5
    assert two.speed(1, 4) == 2.0 and two.speed(2, 4) == 2.0 and two.speed(3, 4) == pytest.approx(4 / 3)
    assert measured.speed(3, 4) == pytest.approx(4 / 3) and measured.speed(4, 4) == 1.0
    assert not pipeline.ALONE.crowded and two.crowded
    paths = pipeline.rank_paths
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, crowd=two) == ((3.0, 2.0), (1.5, 1.5), (0.0, 0.0))
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, crowd=measured).ends == pytest.approx((2.4, 1.6))
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, crowd=two, tails=[1.0, 1.0]) == ((3.5, 2.0), (2.0, 1.5),
                                                                                      (0.5, 1.0))
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, crowd=two, syncs=[1.0, 1.0]) == ((3.5, 2.0), (2.0, 1.5),
                                                                                      (0.0, 0.0))
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, crowd=two, tails=[1.0, 1.0], syncs=[1.0, 1.0]) == (
        (4.0, 2.0), (2.5, 1.5), (0.5, 1.0))
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, tails=[1.0, 1.0]) == ((6.0, 4.0), (3.0, 3.0), (1.0, 1.0))
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, tails=[1.0, 1.0], syncs=[1.0, 1.0]) == ((6.0, 4.0), (3.0, 3.0),
                                                                                             (1.0, 1.0))
    assert makespan("1f1b", 2, 1, 1, [3.0, 3.0], THIRD) == 6.0
    assert paths("1f1b", 2, 1, 1, [3.0, 3.0], THIRD, edge_s=0.5, crowd=two).ends == (4.0, 2.5)
    assert paths("1f1b", 2, 2, 1, [3.0, 3.0], THIRD, crowd=two)[:2] == ((6.0, 5.0), (4.5, 4.5))
    assert makespan("1f1b", 2, 2, 1, [3.0, 3.0], THIRD) == 9.0
    assert paths("1f1b", 2, 2, 1, [3.0, 3.0], THIRD, edge_s=0.25, crowd=two).ends == (6.5, 5.25)


def test_a_crowded_run_with_a_core_for_every_thread_is_the_plain_run_and_stays_above_its_bounds() -> None:
    """Random schedules, costs, chunk weights and messages: the event run with a core for each
    thread ends every rank where the plain run does; at two threads a core, a lone rank 2.2
    times as fast, no rank ends later than plainly, nor before 1/2.2 of it, and no span beats
    the planner's bound or the ranks' work spread over every core."""
    rng = random.Random(5)
    for _ in range(60):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1"])
        pp = rng.choice([2, 3, 4])
        v = rng.choice([2, 3]) if schedule == "interleaved" else 1
        m = rng.randint(1, 4 * pp)
        costs = tuple(rng.uniform(0.5, 1.5) for _ in range(pp))
        weights = tuple(tuple(w / sum(ws) for w in ws) for ws in ([rng.uniform(0.2, 1.0) for _ in range(v)]
                                                                  for _ in range(pp)))
        edge = rng.choice([0.0, 0.05, 0.3])
        plan = pipeline.compiled(schedule, pp, m, v)
        share = pipeline.shares(THIRD)
        plain = pipeline._run(plan, costs, share, weights, edge)
        alike, busy, _ = pipeline._run_shared(plan, costs, share, weights, edge, pipeline.ALONE, (0.0,) * pp)
        assert alike == pytest.approx(plain, rel=1e-9) and busy == pytest.approx([m * c for c in costs], rel=1e-9)
        ends, busy, _ = pipeline.rank_paths(schedule, pp, m, v, list(costs), THIRD, [list(w) for w in weights],
                                            edge, crowd=pipeline.Crowd(2.0, 2.2))
        for end, alone in zip(ends, plain):
            assert alone / 2.2 - 1e-9 <= end <= alone + 1e-9, (schedule, pp, m, v)
        assert max(ends) >= m * sum(costs) / pp / 1.1 - 1e-9
        assert all(b <= m * c + 1e-9 for b, c in zip(busy, costs))
        for crowd in (pipeline.Crowd(2.0, 2.2), pipeline.Crowd(1.5, 1.3), pipeline.Crowd(3.0)):
            span = makespan(schedule, pp, m, v, list(costs), THIRD, [list(w) for w in weights], edge, crowd)
            assert lower_bound(schedule, pp, m, v, list(costs), THIRD, [list(w) for w in weights], edge,
                               crowd=crowd) <= span * (1 + 1e-12), (schedule, pp, m, v, crowd)


def test_a_long_crowded_schedule_timed_in_part_is_the_whole_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past FULL_ACTIONS a crowded run, too, is its first micro-batches and then the steady
    state's pace, read off the last group of pp timed with each rank's work in it: on lopsided
    ends the slowest rank works faster there while lighter ones wait, which a floor at its
    priced micro-batch put 2.4% over the whole run of a zb-h1 on 4 ranks."""
    rng = random.Random(3)
    for schedule, pp, m, v in (("1f1b", 4, 800, 1), ("zb-h1", 4, 600, 1), ("interleaved", 4, 403, 3)):
        costs = _lopsided(pp, rng)
        assert pipeline._timed_micro_batches(schedule, pp, m, v) < m
        part = pipeline.rank_paths(schedule, pp, m, v, costs, THIRD, edge_s=0.01, crowd=pipeline.Crowd(2.0, 2.2))
        monkeypatch.setattr(pipeline, "FULL_ACTIONS", 10**9)
        pipeline._rank_paths.cache_clear()
        whole = pipeline.rank_paths(schedule, pp, m, v, costs, THIRD, edge_s=0.01, crowd=pipeline.Crowd(2.0, 2.2))
        monkeypatch.undo()
        pipeline._rank_paths.cache_clear()
        assert part[0] == pytest.approx(whole[0], rel=1e-9) and part[1] == pytest.approx(whole[1], rel=1e-9)
