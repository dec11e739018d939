"""Pipeline schedules as data: complete, deadlock-free, and with the bubbles theory predicts."""

from __future__ import annotations

import pytest

from plait.errors import PlaitError
from plait.interleave import round_sizes
from plait.schedule.build import (
    Action,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    validate,
    zero_bubble_h1,
)

SIZES = [(pp, m) for pp in (1, 2, 4) for m in (1, 4, 8)]


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def labels(schedule: list[list[Action]]) -> list[str]:
    return [" ".join(a.label() for a in row) for row in schedule]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("pp,m", SIZES)
def test_every_schedule_validates(name: str, pp: int, m: int) -> None:
    validate(build_schedule(name, pp, m), pp, m)


@pytest.mark.parametrize("pp,m", SIZES)
def test_interleaved_validates(pp: int, m: int) -> None:
    validate(build_schedule("interleaved", pp, m, v=2), pp, m, v=2)


def test_interleaved_runs_any_micro_batch_count() -> None:
    """Every m from 1 to 4·pp + 1 on 2 to 8 ranks, 2 to 4 chunks a rank, and pp 16 with 8
    chunks (Llama 3 405B's shape) to m = 40: complete and free of waits in a cycle, with
    Megatron's warm-up count for the largest round (plait.interleave)."""
    cases = [(pp, v, m) for pp in range(2, 9) for v in range(2, 5) for m in range(1, 4 * pp + 2)]
    for pp, v, m in cases + [(16, 8, m) for m in range(1, 41)]:
        validate(build_schedule("interleaved", pp, m, v), pp, m, v)
    assert round_sizes(4, 8) == [4, 4] and round_sizes(4, 11) == [6, 5] and round_sizes(4, 3) == [3]
    assert round_sizes(16, 41) == [21, 20] and round_sizes(16, 48) == [16, 16, 16]


def test_rounds_of_at_least_pp_keep_the_bubble_and_hold_more() -> None:
    """Rounds of at least pp keep every rank busy between its chunks: on 4 ranks with 2
    chunks each micro-batch adds its 3 units of work (F 1 + B 2) to the span, whether pp
    divides m or not, and the bubble stays (p − 1)/v micro-batches. The price is memory: a
    round of N holds (v − 1)(N − pp) more chunk-forwards in the warm-up, 14 on rank 0 at
    m = 7 (one round of 7) against 11 at m = 8."""
    spans, peaks = {}, {}
    for m in range(4, 13):
        timeline = simulate(build_schedule("interleaved", 4, m, 2), 4, 2)
        spans[m], peaks[m] = timeline.makespan, timeline.peak_inflight[0]
    assert spans == {m: 3 * m + 3 * 3 / 2 for m in range(4, 13)}
    assert peaks == {4: 8, 5: 10, 6: 12, 7: 14, 8: 11, 9: 12, 10: 12, 11: 13, 12: 11}


def test_stage_is_round_robin() -> None:
    assert Action("F", 0, chunk=0).stage(rank=1, pp=4) == 1
    assert Action("F", 0, chunk=2).stage(rank=1, pp=4) == 9


def test_one_f_one_b_exact_order() -> None:
    assert labels(one_f_one_b(2, 3)) == [
        "F0 F1 B0 F2 B1 B2",
        "F0 B0 F1 B1 F2 B2",
    ]


def test_gpipe_and_zb_h1_exact_order() -> None:
    assert labels(gpipe(2, 2)) == ["F0 F1 B0 B1", "F0 F1 B0 B1"]
    assert labels(zero_bubble_h1(2, 3)) == [
        "F0 F1 I0 W0 F2 I1 W1 I2 W2",
        "F0 I0 F1 I1 W0 F2 I2 W1 W2",
    ]


def test_interleaved_exact_order() -> None:
    rows = [" ".join(a.label(v=2) for a in row) for row in interleaved_1f1b(2, 2, 2)]
    assert rows == [
        "F0a F1a F0b F1b B0b B1b B0a B1a",
        "F0a F1a F0b B0b F1b B1b B0a B1a",
    ]


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda: build_schedule("pipedream", 2, 4), ["pipedream"]),
        (lambda: build_schedule("1f1b", 0, 4), ["pp=0"]),
        (lambda: build_schedule("gpipe", 2, 0), ["m=0"]),
        (lambda: build_schedule("gpipe", 2, 4, v=2), ["v=2"]),
        (lambda: build_schedule("interleaved", 2, 4, v=1), ["v=1"]),
    ],
)
def test_bad_requests_name_the_numbers(call, words: list[str]) -> None:  # noqa: ANN001
    with pytest.raises(PlaitError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def test_deadlock_is_caught() -> None:
    # Rank 1 wants micro-batch 1 first, but rank 0 sends it only after B0, which needs rank 1.
    schedule = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
    ]
    with pytest.raises(PlaitError, match="deadlock") as err:
        validate(schedule, pp=2, m=2)
    assert "rank 0 at B0" in str(err.value)
    assert "rank 1 at F1" in str(err.value)


def test_missing_backward_is_caught() -> None:
    schedule = one_f_one_b(2, 3)
    schedule[1] = [a for a in schedule[1] if a != Action("B", 2)]
    with pytest.raises(PlaitError, match="micro-batch 2 on stage 1 has 0 B"):
        validate(schedule, pp=2, m=3)


@pytest.mark.parametrize(
    "row,message",
    [
        ([Action("F", 0), Action("F", 0), Action("B", 0)], "forwarded 2 times"),
        ([Action("B", 0), Action("F", 0)], "runs B before its F"),
        ([Action("F", 0), Action("W", 0), Action("I", 0)], "runs W before its I"),
        ([Action("F", 0), Action("B", 0), Action("W", 0)], "1 B, 0 I, 1 W"),
        ([Action("F", 1), Action("B", 1)], "micro-batch must be < 1"),
    ],
)
def test_broken_single_stage_schedules_are_caught(row: list[Action], message: str) -> None:
    with pytest.raises(PlaitError, match=message):
        validate([row], pp=1, m=1)


def test_wrong_rank_count_is_caught() -> None:
    with pytest.raises(PlaitError, match="1 rank lists but pp=2"):
        validate(gpipe(1, 2), pp=2, m=2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", SIZES)
@pytest.mark.parametrize("cost_f,cost_b", [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0)])
def test_bubble_of_gpipe_and_1f1b(name: str, pp: int, m: int, cost_f: float, cost_b: float) -> None:
    # Makespan is (m + p - 1)(F + B) and each rank works m(F + B), whatever F and B are.
    timeline = simulate(build_schedule(name, pp, m), pp, cost_f=cost_f, cost_b=cost_b)
    assert timeline.makespan == pytest.approx((m + pp - 1) * (cost_f + cost_b))
    assert timeline.bubble == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (2, 8, 3)])
@pytest.mark.parametrize("cost_b", [1.0, 2.0])
def test_bubble_of_interleaved(pp: int, m: int, v: int, cost_b: float) -> None:
    # simulate charges cost/v per chunk, so the work per rank is the same as 1F1B's and
    # only the fill and drain shrink: bubble (p-1)/(v*m + p-1).
    timeline = simulate(build_schedule("interleaved", pp, m, v), pp, v, cost_b=cost_b)
    assert timeline.busy == pytest.approx([m * (1.0 + cost_b)] * pp)
    assert timeline.bubble == pytest.approx((pp - 1) / (v * m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0)])
def test_zb_h1_idle_is_p_minus_1_times_f_plus_i_minus_w(
    pp: int, m: int, f: float, i: float, w: float
) -> None:
    # Qi et al.: each rank idles (p-1)(F + I - W), against (p-1)(F + I + W) for 1F1B (m >= p).
    timeline = simulate(zero_bubble_h1(pp, m), pp, cost_f=f, cost_i=i, cost_w=w)
    assert timeline.makespan - m * (f + i + w) == pytest.approx((pp - 1) * (f + i - w))


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 64)])
def test_zb_h1_idles_a_third_of_1f1b(pp: int, m: int) -> None:
    # Same work per rank (F=I=W=1 against F=1, B=2): idle time is exactly a third, so the
    # bubble fraction (p-1)/(3m+p-1) tends to a third of 1F1B's (p-1)/(m+p-1) as m grows.
    zb = simulate(zero_bubble_h1(pp, m), pp, cost_f=1, cost_i=1, cost_w=1)
    ofob = simulate(one_f_one_b(pp, m), pp, cost_f=1, cost_b=2)
    assert zb.idle == pytest.approx(ofob.idle / 3)
    assert zb.bubble == pytest.approx((pp - 1) / (3 * m + pp - 1))


@pytest.mark.parametrize("pp,m", [(pp, m) for pp, m in SIZES if pp > 1])
def test_zb_h1_beats_1f1b(pp: int, m: int) -> None:
    zb = simulate(zero_bubble_h1(pp, m), pp, cost_f=1, cost_i=1, cost_w=1).bubble
    ofob = simulate(one_f_one_b(pp, m), pp, cost_f=1, cost_b=2).bubble
    assert zb < ofob


@pytest.mark.parametrize("pp,m", SIZES)
def test_peak_inflight(pp: int, m: int) -> None:
    expected_1f1b = tuple(min(pp - rank, m) for rank in range(pp))
    assert simulate(gpipe(pp, m), pp).peak_inflight == (m,) * pp
    assert simulate(one_f_one_b(pp, m), pp).peak_inflight == expected_1f1b
    zb = simulate(zero_bubble_h1(pp, m), pp)
    assert zb.peak_inflight == expected_1f1b
    # Even counting a put-off W as a whole activation, no rank exceeds 1F1B's peak.
    assert max(zb.peak_live) == max(expected_1f1b)
    assert zb.peak_pending_w == tuple(min(rank + 1, m) for rank in range(pp))


def test_interleaved_peak_inflight_counts_chunks() -> None:
    # Rank r holds its warm-up (v-1)p + 2(p-r-1) chunk activations plus one.
    pp, m, v = 4, 8, 2
    peak = simulate(interleaved_1f1b(pp, m, v), pp, v).peak_inflight
    assert peak == tuple((v - 1) * pp + 2 * (pp - r - 1) + 1 for r in range(pp))


def test_the_held_frontier_gives_every_walks_peak() -> None:
    """plait.interleave.held_frontier keeps only the states that can set a peak; priced with
    random chunk bytes and gradient shares, the most held, and the most held beside the
    gradients made, are the full walk's over the rank's order, step by step."""
    import random

    from plait.interleave import held_frontier, rank_order

    rng = random.Random(5)
    for pp, m, v in [(2, 3, 2), (4, 8, 2), (4, 9, 3), (3, 7, 4), (8, 20, 2), (16, 32, 8)]:
        for rank in range(pp):
            frontier = held_frontier(pp, m, v, rank)
            for _ in range(5):
                weights, shares = [rng.random() for _ in range(v)], [rng.random() for _ in range(v)]
                held = alone = together = made = 0.0
                begun: set[int] = set()
                for kind, _, chunk in rank_order(pp, m, v, rank):
                    if kind == "F":
                        held += weights[chunk]
                    elif chunk not in begun:
                        begun.add(chunk)
                        made += shares[chunk]
                    alone, together = max(alone, held), max(together, held + made)
                    if kind == "B":
                        held -= weights[chunk]
                priced = [(sum(n * w for n, w in zip(h, weights)), sum(s for s, on in zip(shares, b) if on))
                          for h, b in frontier]
                assert max(a for a, _ in priced) == pytest.approx(alone)
                assert max(a + g for a, g in priced) == pytest.approx(together)
            assert len(frontier) < 2 * m * v  # it keeps fewer states than the walk takes steps
