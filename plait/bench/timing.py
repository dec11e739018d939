"""How `plait calibrate` times what it measures, on every rank at once: the median of rounds
through every timing with the ranks in step, the slowest rank's; on a crowded host (more
ranks' threads than cores) each round spans every rank's run, and the compute timings take
their shapes from each rank's CPU time (`_shaped`). calibrate.py, pace.py and comm_timing.py
time through these.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Callable

import torch

from plait.runtime import comm
from plait.runtime.mesh import Mesh


class Spreads:
    """How much the repeats of each compute timing (the GEMMs, attention) disagreed, for telling
    a busy machine's calibration from a quiet one's: the spread of their middle half over their
    median, for every timing long enough to mean it (one slow repeat, a page fault or a
    collection, moves none)."""

    MIN_S = 1e-3  # shorter timings jitter on any machine

    def __init__(self) -> None:
        self.seen: list[float] = []

    def add(self, times: list[float]) -> None:
        middle = statistics.median(times)
        if len(times) >= 3 and middle >= self.MIN_S:
            low, _, high = statistics.quantiles(times, n=4, method="inclusive")
            self.seen.append((high - low) / middle)

    def worst(self) -> float:
        return max(self.seen, default=0.0)


SPREADS = Spreads()  # this process's timings since the calibration began (machine.py and calibrate_cli.py reset it)


def median_s(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of `reps` runs of `fn` on this rank alone, after one warm-up run: what
    needs no other rank in step (a dispatch, a device's queued kernels)."""
    fn()  # warm-up: allocations, kernel selection
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_rounds(mesh: Mesh, fns: list[Callable[[], Any]], rounds: int, watched: bool = False,
                  computes: bool = False) -> list[float]:
    """Median seconds of each of `fns` over `rounds` passes through all of them, ranks in step.

    Interleaving (rather than one shape's repetitions back to back) spreads a passing
    disturbance over every shape instead of moving one shape's rate; a barrier before each
    timing keeps the ranks on the same shape at the same moment, as training does, where
    they share the caches and the memory bus. On a crowded host (`crowded`) each round runs a
    burst of each and is timed from the first rank's start to the last rank's end (`round_spans`);
    the compute timings (`watched`) there take their shapes against each other from each
    rank's own CPU time (`_shaped`); on a CPU that is not, from a second run of each straight
    after the first (`_resident`). A compute timing, watched or not (`computes`: an add's
    bandwidth), counts its runs a burst from CPU time (`_bursts`)."""
    crowd = crowded(mesh)
    shaped = crowd and watched  # CPU time read only where `_shaped` uses it: each read costs about 0.6 µs
    again = watched and not crowd and mesh.device.type == "cpu"  # a second run straight after: `_resident`
    bursts = _bursts(mesh, fns, crowd, crowd and (watched or computes))
    starts: list[list[float]] = [[] for _ in fns]
    ends: list[list[float]] = [[] for _ in fns]
    worked: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, burst, began, ended, cpu in zip(fns, bursts, starts, ends, worked):
            in_step(mesh)
            began.append(time.monotonic())
            on_cpu = time.process_time() if shaped else 0.0
            for _ in range(burst):
                fn()
            if shaped:
                cpu.append((time.process_time() - on_cpu) / burst)
            ended.append(time.monotonic())
            if again:
                fn()
                cpu.append(time.monotonic() - ended[-1])
    if crowd:
        times = [[span / burst for span in spans] for spans, burst in zip(round_spans(mesh, starts, ends), bursts)]
    else:
        times = [[end - start for start, end in zip(began, ended)] for began, ended in zip(starts, ends)]
    if watched:  # the compute timings: two ranks sharing the memory bus spread the bandwidth ones anyway
        for seen in times:
            SPREADS.add(seen)
    medians = [statistics.median(seen) for seen in times]
    if shaped:
        return _shaped(mesh, medians, [statistics.median(cpu) for cpu in worked])
    if again:
        return _resident(medians, [statistics.median(hot) for hot in worked])
    return medians


def _resident(first: list[float], second: list[float]) -> list[float]:
    """Each compute timing on a CPU that is not crowded: its second run straight after the
    first (its operands in the caches), times the first runs' total over the second runs'.

    The first run after the barrier pays a cost of its own, its operands fetched from memory
    after every other shape ran, that a training step's calls, one after another, do not: it
    priced `small`'s GEMMs at 4 sequences a micro-batch 4% over 8 sequences' on 2 ranks (two
    calibrations: 1.039, 1.043), where a profile of training at the two measures 0.6% (aten::mm
    385 ms a step against 383). The second runs set the shapes against each other (1.01-1.03),
    the first runs' total their level, which the large shapes a step spends its time in set.
    Scaled by the median ratio instead, the small shapes' (their first run dearest) put every
    GEMM 16% over. As a crowded host's bursts do (`_shaped`)."""
    if not all(t > 0 for t in second):
        return first
    level = math.fsum(first) / math.fsum(second)
    return [t * level for t in second]


def _shaped(mesh: Mesh, spans: list[float], cpu: list[float]) -> list[float]:
    """Each timing's seconds on a crowded host: its CPU time (the slowest rank's) times the
    median over all of them of span / CPU time.

    The CPU time is the rank's, every thread's (`time.process_time`): with more than one
    thread a rank, a product's intra-op workers do part of its work, which the main thread's
    clock alone left out (a 2-thread GEMM read at half its cost against a 1-thread one).

    A span moves by the scheduler's slices, a few milliseconds of a 20 ms burst: two
    calibrations of 4 ranks on 2 cores gave each GEMM shape's rate ±15%, their shapes' rates
    correlating 0.15-0.29 from one to the next (0.91 on 2 ranks), enough to flip how the plan
    priced one micro-batch against another. A rank's own CPU time is not cut by the
    scheduler: it sets the shapes against each other, and the spans, read over every shape
    at once, set their level (the cores shared, the caches thrashed)."""
    cpu = slowest(mesh, cpu)
    if not all(t > 0 for t in cpu):
        return spans
    level = statistics.median(span / t for span, t in zip(spans, cpu))
    return [t * level for t in cpu]


CROWDED_BURST_S = 0.02  # a crowded host's timed burst: a rank's late wake-up (about 0.5 ms on 2 cores) a 40th of it
# A crowded host's compute burst. Measured, 4 ranks on 2 cores, `small`'s 23 GEMM shapes timed
# four times in one world, bursts counted from CPU time: each shape's rate spread 4.6% from one
# timing to the next in 20 ms bursts, 1.5% in 40 ms and 1.5% in 80 ms, and a timing took 5.6,
# 10.6 and 18.9 s.
CROWDED_COMPUTE_BURST_S = 0.04


def _bursts(mesh: Mesh, fns: list[Callable[[], Any]], crowd: bool, on_cpu: bool = False) -> list[int]:
    """Runs of each of `fns` a timing takes, after one warm-up run each (allocations, kernel
    selection): one, or on a crowded host (`crowd`) enough for CROWDED_BURST_S, from the slowest rank's
    warm-up (every rank runs as many). There the span of a single run paid the last rank's
    wake-up from the barrier: calibrated GEMMs carried a 656 µs fixed cost (61 µs timed
    alone), and 4 ranks' steps were predicted 34% slow.

    A compute timing's warm-up (`on_cpu`) is read in CPU time, times the share of a core a
    rank's threads get (`_core_share`): its wall time waited for a core by chance, so the same
    GEMM got 3 runs a burst in one calibration and 10 or 23 in the next, and each shape's cost
    moved with its count. Measured, 4 ranks on 2 cores, `small`'s 23 shapes timed four times
    in one world: each shape's rate spread 7-9% from one timing to the next with the counts
    read from wall time, and 1.7% from CPU time, their counts within one or two of each
    other (in bursts of 40 ms, CROWDED_COMPUTE_BURST_S). An add's bandwidth, timed four times
    in one world, read 4.4-17.2 GB/s at 196 KiB with 4 to 64 runs a burst, 7.2-12.3 at 1.5 MiB
    (4 to 30). A collective's warm-up stays in wall time: it waits on its peers, not on a core."""
    warm, share = [], _core_share(mesh)
    for fn in fns:
        start, cpu = time.monotonic(), time.process_time()
        fn()
        warm.append((time.process_time() - cpu) / share if on_cpu else time.monotonic() - start)
    if not crowd:
        return [1] * len(fns)
    burst_s = CROWDED_COMPUTE_BURST_S if on_cpu else CROWDED_BURST_S
    return [max(1, min(64, math.ceil(burst_s / max(t, 1e-6)))) for t in slowest(mesh, warm)]


def _core_share(mesh: Mesh) -> float:
    """Cores' worth of time a rank gets while every rank computes, its threads together: its
    threads over the host's crowding (the host's cores over its ranks where it is crowded, its
    own threads where not; a rank's CPU time over this is its wall time)."""
    return torch.get_num_threads() / crowding(mesh)


def crowded(mesh: Mesh) -> bool:
    """Whether one host runs more ranks' threads than it has cores (4 one-thread ranks on 2
    cores). There a rank the barrier released waits for a core, and starts its clock only when
    it gets one: timed alone, each of 4 ranks measured a whole core's rate, 0.34 TFLOP/s in all
    on a 2-core machine whose ceiling is 0.155, and the 4-rank steps were predicted at half
    their measurement. Only where every rank is on this host: the spans read one clock."""
    return crowding(mesh) > 1.0


def crowding(mesh: Mesh) -> float:
    """Threads for each of the host's cores while every rank computes: its ranks' threads over
    its cores where more than 1 (`crowded`), else 1.0. Recorded as Hardware.crowding: a
    pipeline rank that waits leaves its share of the cores to the ranks at work."""
    if mesh.device.type != "cpu" or mesh.env.world_size == 1:
        return 1.0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.env.world_size))
    if local != mesh.env.world_size:
        return 1.0
    return max(1.0, local * torch.get_num_threads() / (os.cpu_count() or 1))


def round_spans(mesh: Mesh, starts: list[list[float]], ends: list[list[float]]) -> list[list[float]]:
    """Each round's seconds from the first rank's start to the last rank's end, on the host's
    monotonic clock (one clock for every process on it): the time all ranks need to run the
    shape once together, as a step's ranks do."""
    first = torch.tensor(starts, dtype=torch.float64)
    last = torch.tensor(ends, dtype=torch.float64)
    comm.all_reduce(first, mesh.axis("world"), op="min", purpose=comm.TELEMETRY)
    comm.all_reduce(last, mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    return (last - first).tolist()


def in_step(mesh: Mesh) -> None:
    if mesh.env.world_size > 1:
        comm.barrier(mesh.axis("world"))


def slowest(mesh: Mesh, values: list[float]) -> list[float]:
    """Max over every rank of each value (the slowest rank sets the pace)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=mesh.device)
    comm.all_reduce(tensor, mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    return tensor.tolist()


def device_sync(mesh: Mesh) -> None:
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
