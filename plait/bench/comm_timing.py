"""The links `plait calibrate` measures: per group size of the first n ranks, a ring step's
latency (an 8-byte all-reduce; on a CPU between bursts of compute, as a step meets it,
`in_step_s`) and the bus bandwidth of a large all-reduce, all-gather and reduce-scatter; what a
collective adds after longer bursts of compute (`measure_lags`); a send/recv pair's latency
(`measure_p2p`).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

from plait.bench import timing
from plait.runtime import comm
from plait.runtime.mesh import Mesh
from plait.runtime.subgroups import first_ranks_axes, group_sizes, tiled_axes


def measure_links(mesh: Mesh, large: int, reps: int
                  ) -> tuple[tuple[tuple[int, float, float], ...], tuple[tuple[str, int, float], ...]]:
    """((n, µs per ring step, GB/s busbw) of all-reduce, (op, n, GB/s busbw) of all-gather and
    reduce-scatter) on n ranks, each n: ZeRO's collectives, which Gloo on a CPU runs at a third
    to a half of its all-reduce's rate.

    The three large collectives are timed in turns, round by round (`median_rounds`), so that
    their rates come from the same minutes: what ZeRO costs over plain data parallelism is
    their difference. Timed one op after another, a host's slow stretch landed on one of them:
    4 ranks' all-gather was calibrated at 0.40 GB/s against 0.58-0.75 in turns, and ZeRO-1 was
    priced 7.8% over plain dp 4 where it measured 2.4% over. Their first rounds run slow and
    are not timed (`LINK_WARM_ROUNDS`), and twice `reps` rounds are (`link_rates`).

    On a host that runs its own collectives (a CPU under Gloo) a step's latency is taken
    between bursts of compute, as training meets it (`in_step_s`), not back to back: there the
    transport's threads sleep while the ranks compute, and each collective wakes them. Measured
    on this 2-core machine: an 8-byte all-reduce takes 180 µs back to back, 700 µs on average
    between matmuls; a ring of cp 2 paid that on each of its hundreds of exchanges a step."""
    axes = _link_axes(mesh, group_sizes(mesh.env.world_size))
    links, ops = [], []
    for n, axis in axes.items():
        elements = large // 4 // n * n
        small_t, timed = 0.0, [_nothing] * 3
        if axis is not None:
            tiny = torch.zeros(2, dtype=torch.float32, device=mesh.device)
            small_t = latency_s(mesh, lambda: comm.all_reduce(tiny, axis, purpose=comm.TELEMETRY), reps)
            timed = _large_collectives(mesh, axis, elements)
        small_t, reduce_t, gather_t, scatter_t = timing.slowest(mesh, [small_t, *link_rates(mesh, timed, reps)])
        step = small_t / (2 * (n - 1))
        wire = (n - 1) / n * elements * 4  # an all-gather's or reduce-scatter's; an all-reduce moves twice it
        links.append((n, step * 1e6, bus_rate(2 * wire, reduce_t, 2 * (n - 1) * step)))
        ops += [(op, n, bus_rate(wire, t, (n - 1) * step)) for op, t in (("all_gather", gather_t),
                                                                          ("reduce_scatter", scatter_t))]
    return tuple(links), tuple(ops)


# Untimed rounds of the large collectives before their timed ones. Measured, 4 ranks on 2 cores
# in pairs, 16 MiB: a world's first rounds of all-gather ran at 0.30-0.43 GB/s and then at
# 0.43-0.62; timed from the first round, 11 rounds' medians of five fresh sets of buffers in one
# world spread 0.43-0.54 GB/s (reduce-scatter 0.25-0.31), and with 4 rounds first and 22 timed,
# 0.53-0.54 (0.27-0.29). One calibration had put ZeRO-1 and -2 past two layouts that measured
# slower than them.
LINK_WARM_ROUNDS = 4

# Timed rounds of the large collectives a calibration round (`reps`): on a crowded host each round
# is a burst of runs (timing._bursts), two rounds a rep; elsewhere a single run, six. Measured on
# 2 ranks of this 2-core host, 16 MiB, `measure_links` ten times in one world: over 22 rounds
# the all-gather read 0.49-0.86 GB/s (sd 19% of the mean; all-reduce 10%, reduce-scatter 11%),
# over 66 rounds 0.68-0.83 (6%; 4% and 3%), for 3.4 s more. Run 26's two calibrations read the all-gather at
# 1.04 and 0.93 GB/s, and priced ZeRO-1 past two micro-batches of 4, which measured faster.
LINK_ROUNDS_PER_REP = 6
CROWDED_LINK_ROUNDS_PER_REP = 2


def link_rates(mesh: Mesh, timed: list[Callable[[], Any]], reps: int) -> list[float]:
    """Median seconds of each large collective in `timed`, over LINK_ROUNDS_PER_REP rounds a rep
    (CROWDED_LINK_ROUNDS_PER_REP on a crowded host) in turns after LINK_WARM_ROUNDS untimed
    ones: what a step meets, run after run, is their steady rate."""
    timing.median_rounds(mesh, timed, LINK_WARM_ROUNDS)
    per_rep = CROWDED_LINK_ROUNDS_PER_REP if timing.crowded(mesh) else LINK_ROUNDS_PER_REP
    return timing.median_rounds(mesh, timed, per_rep * reps)


def bus_rate(wire: float, seconds: float, latency_s: float) -> float:
    """GB/s of a collective that moved `wire` bytes in `seconds`, its ring steps' `latency_s`
    taken off, but never more than half of it: the latency is timed between bursts of compute
    and the large collective back to back, so on a loaded host the first can exceed the second.
    Taken off whole, that left 1e-9 s for the bytes: a 2-rank all-gather was calibrated at 1e6
    GB/s, a ZeRO gather priced at nothing. Capped, such a rate is at most twice the plain one."""
    return wire / max(seconds - latency_s, seconds / 2, 1e-9) / 1e9


def _nothing() -> None:
    """A rank outside the timed group takes its turns doing nothing, in step with the others."""


def _large_collectives(mesh: Mesh, axis: Any, elements: int) -> list[Callable[[], Any]]:
    """All-reduce, all-gather and reduce-scatter of `elements` fp32 over `axis`."""
    full = torch.zeros(elements, dtype=torch.float32, device=mesh.device)
    shard = torch.zeros(elements // axis.size, dtype=torch.float32, device=mesh.device)
    return [lambda: comm.all_reduce(full, axis, purpose=comm.TELEMETRY),
            lambda: comm.all_gather(full, shard, axis, purpose=comm.TELEMETRY),
            lambda: comm.reduce_scatter(shard, full, axis, purpose=comm.TELEMETRY)]


def _link_axes(mesh: Mesh, sizes: list[int]) -> dict[int, Any]:
    """{n: this rank's Axis, or None} for timing collectives over n ranks: the first n ranks
    alone, or on a crowded host (`crowded`) every rank in a group of n, all groups at once.
    There a group's collective waits on peers that share cores with the other groups' ranks,
    as in training: timed with the other ranks idle, 4 ranks' tp 2 steps on 2 cores were
    predicted 14% light."""
    world = mesh.env.world_size
    pick = tiled_axes if timing.crowded(mesh) else first_ranks_axes
    return pick(sizes, mesh.ledger, mesh.global_rank, world)


BURST = (192, 384)  # the compute between two collectives of `in_step_s`: a (192 x 384) @ (384 x 384) product


def latency_s(mesh: Mesh, op: Callable[[], Any], reps: int) -> float:
    """Seconds of a tiny collective or message `op`: back to back on a GPU (the median), on a
    host that runs its own collectives between bursts of compute (`in_step_s`, the mean)."""
    return timing.median_s(op, reps * 4) if mesh.device.type == "cuda" else in_step_s(op, reps * 40)


def in_step_s(op: Callable[[], Any], reps: int) -> float:
    """Seconds `op` adds after a burst of compute: the mean of (compute, then op) less the mean
    of compute alone, the two taken in turns so that a passing disturbance meets both. The
    mean, not the median: on 2 cores an 8-byte all-reduce's median there is about 210 µs, but
    one in a few waits milliseconds for a descheduled thread, for a mean near 700 µs, and a
    step pays the mean of its hundreds of collectives."""
    a, b = torch.randn(*BURST), torch.randn(BURST[1], BURST[1])
    op()  # warm-up
    alone, paired = [], []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        alone.append(time.perf_counter() - start)
        start = time.perf_counter()
        a @ b
        op()
        paired.append(time.perf_counter() - start)
    return max(statistics.fmean(paired) - statistics.fmean(alone), 0.0)


# A burst's rows, (rows x 384) @ (384 x 384): the latency's own burst (BURST), then 4 and 16 times
# it; about 1, 5 and 20 ms a rank on 4 ranks sharing 2 cores.
LAG_ROWS = (BURST[0], 4 * BURST[0], 16 * BURST[0])
LAG_LOOP_S = 0.5  # each timed loop of bursts, of at least LAG_BURSTS: one rank's late wake-up is shared out
LAG_BURSTS = 20


def measure_lags(mesh: Mesh, reps: int, loop_s: float = LAG_LOOP_S) -> tuple[tuple[int, float, float], ...]:
    """(n, µs of a burst, µs a collective adds after it beyond what it adds after the shortest
    burst) for an 8-byte all-reduce on n ranks, each n, on a host that runs its own collectives
    (`Hardware.lags`; none on a GPU).

    Each rank runs a loop of bursts of compute, every rank at once, once with an all-reduce after
    each burst and once without: the difference over the loop's length is what a collective
    costs the step, the last rank's lag included. Measured on 2 cores, 4 ranks in pairs: 1.0 ms
    after 1 ms bursts, 2.0 after 4.7 ms and 2.8 after 20 ms; 2 ranks: 0.4, 0.8 and 1.1 ms after
    0.6, 2.2 and 10 ms. The latency (`measure_links`) is taken after the shortest; tp's
    all-reduces follow a block's half, tens of ms on a small model, and dp 2 x tp 2 measured 7%
    over dp 4 where it was priced 3%."""
    if mesh.device.type == "cuda":
        return ()
    axes = _link_axes(mesh, group_sizes(mesh.env.world_size))
    rows = []
    for n, axis in axes.items():
        costs = [_sync_cost(mesh, axis, m, reps, loop_s) for m in LAG_ROWS]
        lag = 0.0
        for burst, cost in costs:  # a lag does not shrink as the ranks compute longer apart: a dip is noise
            lag = max(lag, cost - costs[0][1])
            rows.append((n, burst * 1e6, lag * 1e6))
    return tuple(rows)


def _sync_cost(mesh: Mesh, axis: Any, rows: int, reps: int, loop_s: float) -> tuple[float, float]:
    """(seconds of one burst of `rows`, seconds an 8-byte all-reduce on `axis` adds after it),
    from loops of bursts on every rank at once with and without it, taking turns: the slowest
    rank's burst, and the most any rank's medians differ (a rank outside any group of n runs
    the bursts alone, and adds nothing)."""
    a, b = torch.randn(rows, BURST[1]), torch.randn(BURST[1], BURST[1])
    tiny = torch.zeros(2, dtype=torch.float32, device=mesh.device)

    def loop(k: int, synced: bool) -> float:
        timing.in_step(mesh)
        start = time.monotonic()
        for _ in range(k):
            a @ b
            if synced and axis is not None:
                comm.all_reduce(tiny, axis, purpose=comm.TELEMETRY)
        timing.in_step(mesh)
        return time.monotonic() - start

    once = timing.slowest(mesh, [loop(2, True) / 2])[0]
    k = max(LAG_BURSTS, min(1000, math.ceil(loop_s / max(once, 1e-6))))
    plain, synced = [], []
    for _ in range(reps):
        plain.append(loop(k, False))
        synced.append(loop(k, True))
    added = statistics.median(synced) - statistics.median(plain) if axis is not None else 0.0
    plain_s, added_s = timing.slowest(mesh, [statistics.median(plain), added])
    return plain_s / k, added_s / k


def measure_p2p(mesh: Mesh, reps: int) -> float:
    """µs of a batched send/recv pair between the first two ranks (each the other's peer, as a
    ring of two and a pipeline's neighbours run it), 8 bytes; on a CPU between bursts of compute
    and its mean (`in_step_s`): 860 µs there on 2 cores, against 300 µs a ring step of an
    all-reduce. The other ranks wait."""
    axis = _link_axes(mesh, [2]).get(2)
    taken = 0.0
    if axis is not None:
        tiny, received = (torch.zeros(2, dtype=torch.float32, device=mesh.device) for _ in range(2))
        peer = 1 - axis.rank
        taken = latency_s(mesh, lambda: comm.send_recv(tiny, received, axis, peer, peer,
                                                       purpose=comm.TELEMETRY).wait(), reps)
    return timing.slowest(mesh, [taken])[0] * 1e6
