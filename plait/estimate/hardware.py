"""Device and interconnect presets: what one accelerator can compute, hold and send.

Fields are kept in the units people quote (TFLOP/s, GiB, GB/s, µs) so that a `[hardware]`
table in a TOML file can use the same names; the properties convert to SI for the
arithmetic. GPU figures are the vendors' public datasheet numbers for dense math (no 2:4
sparsity); link bandwidths are per GPU and per direction, which is what a ring collective
is limited by.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

from plait.errors import PlaitError

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. `compute_efficiency` is the fraction of peak that the
    matmuls actually reach while computing (not end-to-end MFU: communication and pipeline
    bubbles are subtracted separately)."""

    name: str
    peak_bf16_tflops: float  # dense 16-bit tensor-core peak (used for bf16 and fp16)
    peak_fp32_tflops: float  # plain fp32 (no TF32: torch leaves TF32 matmuls off by default)
    memory_gib: float
    intra_node_gb_s: float  # per GPU, one direction (NVLink, PCIe, or loopback for CPUs)
    inter_node_gb_s: float  # per GPU, one direction (its share of the node's NICs)
    intra_node_latency_us: float = 3.0  # per ring step
    inter_node_latency_us: float = 8.0
    gpus_per_node: int = 8
    compute_efficiency: float = 0.75
    reserved_gib: float = 2.0  # CUDA context, cuBLAS workspace, NCCL buffers: never ours
    pcie_gb_s: float = 25.0  # host <-> device, used by optimizer offload
    host_mem_gb_s: float = 120.0  # the host's AdamW for optimizer offload, in GB/s of its 28 bytes a parameter
    memory_gb_s: float = 1000.0  # device memory bandwidth: element-wise work on activations
    stream_gb_s: float = 0.0  # the update's pass over gradients and states (ops.py bytes); 0: memory_gb_s
    attention_efficiency: float = 0.4  # fraction of peak a fused attention core reaches
    peak_fp8_tflops: float = 0.0  # dense float8 tensor-core peak; 0: no float8 units (fp8 runs at bf16's)
    op_overhead_us: float = 0.0  # fixed cost of one launched op (eager dispatch, not hidden)
    # A point-to-point message's latency inside a node (a batched send/recv pair, as a ring
    # attention's step and a pipeline's message run it), measured by `plait calibrate`; 0: a
    # ring collective's step latency. On a CPU under Gloo it is taken between bursts of compute.
    p2p_latency_us: float = 0.0
    # A GEMM of no measured shape costs its FLOPs at peak·compute_efficiency plus this: the
    # ramp and tail of a product too small to fill the device (GEMM_RAMP_US below).
    gemm_fixed_us: float = 0.0
    view_overhead_us: float = 0.0  # fixed cost of a view (reshape, transpose)
    step_overhead_us: float = 0.0  # the training loop's own cost per step (data, bookkeeping)
    optimizer_tensor_us: float = 0.0  # fixed cost per parameter tensor of an optimizer step
    grad_tensor_us: float = 0.0  # fixed cost per gradient piece of the finite check and clipping
    # A GPU's host queues kernels ahead of the device: the update's fixed per-tensor costs
    # (host launches) overlap its pass over the states instead of adding to it.
    queues_kernels: bool = False
    # Measured by `plait calibrate`: TFLOP/s per GEMM or attention shape ("fp32 MxKxN"; a CPU's
    # products at several micro-batches read on the line through their rows: `rows_tflops`),
    # and (group size, µs per ring step, GB/s bus bandwidth) of the collectives in a node.
    gemm: tuple[tuple[str, float], ...] = ()
    links: tuple[tuple[int, float, float], ...] = ()
    # (op, group size, GB/s bus bandwidth) of the ring collectives whose bandwidth is not the
    # all-reduce's: Gloo's all-gather and reduce-scatter on a CPU move a third to a half of its bytes a
    # second (timed in the same rounds as the all-reduce: plait.bench.comm_timing.measure_links)
    op_links: tuple[tuple[str, int, float], ...] = ()
    # (group size, µs of compute each rank ran before a collective, µs the collective adds
    # beyond its `links` latency), measured by `plait calibrate` on a host that runs its own
    # collectives: ranks computing apart drift apart, so the longer the compute before a
    # collective, the longer its first rank waits for its last. Read by `lag_s`; empty: none.
    lags: tuple[tuple[int, float, float], ...] = ()
    # Rates keyed by the size they were measured at, read between sizes by interpolation
    # (`memory_rate`, `stream_rate`): an element-wise op's GB/s by the bytes it writes, and
    # the update's GB/s by the parameters it steps. A rate taken on a small model is not
    # reused for a large one: the calibration measures the size it lacks.
    memory_by_size: tuple[tuple[int, float], ...] = ()
    stream_by_size: tuple[tuple[int, float], ...] = ()
    # Threads each core ran when the rates above were taken, where a host ran more of its ranks'
    # threads than it has cores (`plait calibrate` on 4 one-thread ranks on 2 cores: 2.0, every
    # rank at work): a pipeline rank that waits leaves its share of the cores to the others
    # (estimate/pipeline.Crowd). 1.0: each thread had a core.
    crowding: float = 1.0
    # On such a host, (micro-batch, how much faster a rank trained a block at it while only as
    # many ranks as cores did) (plait.bench.pace.measure_lone_speedup: 1.99-2.22 on
    # `small` where crowding is 2, the ranks sharing caches too), read as their median
    # (`lone_speedup`), priced never under crowding; empty: crowding, as if shared without loss.
    lone_by_micro_batch: tuple[tuple[int, float], ...] = ()
    # (micro-batch, a one-layer block's forward and split backward (I + W, as ZB-H1 runs it) over
    # its forward and whole backward) on a calibrated CPU (plait.bench.pace.
    # measure_split_backward: 1.03-1.13 on `small`, 4 ranks on 2 cores, benchmarks/RESULTS.md run
    # 14); empty: the split priced by what W makes again (ops.block_ops, split_norm_elements).
    split_by_micro_batch: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # One order for the measured tables, so that equal profiles compare equal.
        for table in _TABLES:
            rows = getattr(self, table)
            if not isinstance(rows, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in rows):
                raise PlaitError(f"hardware {self.name!r}: {table} must be a list of rows, got {rows!r}",
                                 hint=f"write {table} as rows, e.g. {table} = [[\"name\", 1.0]]")
            try:
                ordered = tuple(sorted(tuple(row) for row in rows))
            except TypeError:
                raise PlaitError(f"hardware {self.name!r}: {table}'s rows mix kinds of values: {rows!r}",
                                 hint=f"give every row of {table} the same fields, numbers where numbers go"
                                 ) from None
            object.__setattr__(self, table, ordered)
        for table in _SIZED:
            for size, rate in getattr(self, table):
                if not (isinstance(size, int) and size > 0 and isinstance(rate, (int, float))
                        and math.isfinite(rate) and rate > 0):
                    raise PlaitError(f"hardware {self.name!r}: [hardware.{table}] needs a positive size and "
                                     f"a positive finite rate, got {size!r} = {rate!r}",
                                     hint="sizes in bytes (memory) or parameters (stream), rates in GB/s; "
                                          "lone_by_micro_batch and split_by_micro_batch: a micro-batch and a ratio")
        for row in self.lags:
            if not _lag_row_ok(row):
                raise PlaitError(f"hardware {self.name!r}: [hardware.lags] needs a group of 2 or more ranks, a "
                                 f"positive burst and a lag of 0 or more, got {row!r}",
                                 hint='write "ranks burst_us" = lag_us, e.g. "2 4000.0" = 1200.0')
        if not isinstance(self.queues_kernels, bool):
            raise PlaitError(f"hardware {self.name!r}: queues_kernels must be true or false, "
                             f"got {self.queues_kernels!r}",
                             hint="true for a GPU (its host queues kernels ahead), false for a CPU")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "queues_kernels") or f.name in _TABLES:
                continue
            low_ok = f.name in _MAY_BE_ZERO and value == 0
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or (value <= 0 and not low_ok)):
                raise PlaitError(
                    f"hardware {self.name!r}: {f.name} must be a positive number, got {value!r}",
                    hint="fix the value in the [hardware] table",
                )
        if self.crowding < 1.0:
            raise PlaitError(f"hardware {self.name!r}: crowding must be 1 or more, got {self.crowding!r}",
                             hint="threads for each core while every rank computes: 1.0 where each has its own")
        for table, what, hint in _AT_LEAST_ONE:
            for micro_batch, ratio in getattr(self, table):
                if ratio < 1.0:
                    raise PlaitError(f"hardware {self.name!r}: [hardware.{table}] needs {what} of 1 or more, "
                                     f"got {micro_batch!r} = {ratio!r}", hint=hint)

    def gemm_tflops(self, key: str) -> float:
        """Measured TFLOP/s of a named GEMM or attention shape, 0.0 when not measured."""
        return dict(self.gemm).get(key, 0.0)

    def rows_tflops(self, key: str, axis: int) -> float:
        """TFLOP/s of a measured GEMM ("fp32 MxKxN") whose dimension `axis` (0: M, 1: K) is
        the tokens of a micro-batch, read off the line through every product measured with its
        other two dimensions (`_rows_fit`): on a CPU, where each reading carries noise of its
        own; the reading itself on a GPU, whose queued products are steady, or where fewer than
        FAMILY_MIN were measured. 0.0 when the product was not measured.

        Why: a CPU's time is its fixed part plus the rows' work, and one calibration's readings
        on 4 ranks sharing 2 cores move by about ±10% each (one product at 128 to 2048 rows read
        0.0625, 0.0545, 0.066, 0.0625 and 0.0656 TFLOP/s). Read one by one, a stage's products
        at micro-batch 4 were priced 0.972-1.048 of micro-batch 8's a sequence over ten
        calibrations, and two micro-batches of 4 from +0.5% to +5.5% over one of 8 (measured
        +4.6-6.6%: benchmarks/RESULTS.md, the 4-rank planner check, runs 40 to 47). Over the
        seven calibrations of runs 48 and 49 one block's products there read 1.009-1.029 one by one
        and 1.022-1.027 off their lines. On a slower host (runs 51 and 52) they read 0.97 a sequence
        one by one on 4 ranks, which would have priced two micro-batches of 4 the cheapest of the
        plan's six (measured +4.4% over one of 8), and 1.01-1.02 off their lines; on 2 ranks one by
        one 1.057 and 0.965, pricing the split +7.7% and -0.1%, off their lines +4.8% and +2.9%
        (measured +1.6%)."""
        measured = self.gemm_tflops(key)
        if not measured or self.queues_kernels:
            return measured
        fitted = _rows_fit(self.gemm, key, axis)
        return fitted or measured

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_gb_s * 1e9

    def memory_rate(self, op_bytes: float) -> float:
        """Bytes/s of an element-wise op that writes `op_bytes`: the rate measured at that size
        (read between and beyond the measured sizes by `sized_rate`), else memory_gb_s. Small
        ops reach less of the bandwidth than large ones on every device: none is read faster
        than a larger one was measured (`_no_faster_smaller`)."""
        return (sized_rate(_no_faster_smaller(self.memory_by_size), op_bytes) or self.memory_gb_s) * 1e9

    def stream_rate(self, params: float) -> float:
        """Bytes/s of the update over `params` parameters (ops.py's bytes): the rate measured at
        that size (read by `sized_rate`), else `stream_bytes_per_s`."""
        return (sized_rate(self.stream_by_size, params) * 1e9) or self.stream_bytes_per_s

    @property
    def stream_bytes_per_s(self) -> float:
        """Rate of the update's pass over gradients, parameters and optimizer states, in the bytes
        plait/estimate/ops.py counts. A GPU's is its memory bandwidth; a CPU's, calibrated,
        is well below what an activation-sized add (cache-resident) reaches."""
        return (self.stream_gb_s or self.memory_gb_s) * 1e9

    def link(self, n: int, inter_node: bool) -> tuple[float, float]:
        """(seconds per ring step, bytes/s) for a group of n ranks: the calibrated figures
        of the nearest measured group size inside a node, else the preset's link."""
        if not inter_node and self.links:
            size = _nearest_size((row[0] for row in self.links), n)
            latency_us, gb_s = next(row[1:] for row in self.links if row[0] == size)
            return latency_us * 1e-6, gb_s * 1e9
        return self.latency(inter_node), self.bandwidth(inter_node)

    def message(self, n: int, inter_node: bool) -> tuple[float, float]:
        """(seconds of a point-to-point message's latency, bytes/s) in a group of n ranks: the
        calibrated send/recv latency inside a node where measured, else a ring step's (`link`)."""
        latency, bandwidth = self.link(n, inter_node)
        if not inter_node and self.p2p_latency_us:
            latency = self.p2p_latency_us * 1e-6
        return latency, bandwidth

    def lag_s(self, n: int, burst_s: float) -> float:
        """Seconds a collective of n ranks inside a node adds beyond its calibrated latency
        after `burst_s` of compute (`lags` of the nearest measured group size): read between
        the measured bursts on a line in the burst's logarithm, none below the shortest (the
        burst the latency itself was taken after), the longest's beyond it (the ranks' lag
        stops growing once the scheduler has evened out their shares of the cores)."""
        if not self.lags or burst_s <= 0:
            return 0.0
        size = _nearest_size((row[0] for row in self.lags), n)
        points = [(math.log(burst_us * 1e-6), extra_us * 1e-6) for m, burst_us, extra_us in self.lags if m == size]
        at = math.log(burst_s)
        if at <= points[0][0]:
            return 0.0
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if at <= x1:
                return y0 + (y1 - y0) * (at - x0) / (x1 - x0)
        return points[-1][1]

    @property
    def lone_speedup(self) -> float:
        """How much faster a rank works with a core to itself: the median of
        `lone_by_micro_batch`, whatever the micro-batch; 0.0 where none was measured.

        One figure for the host, not one a micro-batch: a block's bursts read smaller
        micro-batches 1-4% faster alone than 8 in five calibrations (2.05-2.10 at 4, 2.01-2.05
        at 8, on 4 ranks of `small` sharing 2 cores), where a pipeline's own lone actions ran
        the other way (1.90 at 4, 2.01-2.03 at 8), and each reading moves 0.02-0.05 from one
        calibration to the next. Read at each micro-batch, two micro-batches of 4 were priced
        1.5-3.8% over one of 8 and measured 3.7-8.2% over (median 5.2%). Read as the median,
        the 4-rank planner check ranks at 0.99 and 0.81 (runs 16 and 17 repriced; 0.41 and 0.64
        read at each micro-batch), 0.46 (run 18, whose second calibration timed ZeRO's
        collectives 5-10% slower; its first alone 0.99) and 0.99 (run 19): benchmarks/RESULTS.md.
        The split's price follows this figure (+0.4% at 1.9, +5.0% at 2.1 in run 40's first
        calibration), and a host changing pace moves it: run 40's two calibrations read 2.01 and
        1.89, and ranked at 0.35 (1.00 at each micro-batch); run 41, 0.94 either way. A figure
        under `crowding` is priced as `crowding`, the cores shared without loss
        (pipeline.Crowd.fastest: run 40 then ranks at 0.81)."""
        readings = [speedup for _, speedup in self.lone_by_micro_batch]
        return statistics.median(readings) if readings else 0.0

    def split_backward(self, micro_batch: int) -> float:
        """`split_by_micro_batch` made non-increasing in the micro-batch (`_non_increasing`),
        at the nearest measured micro-batch; 0.0 where none was.

        The split's extra over a whole backward is W's many small calls, a larger share of a
        smaller micro-batch's work, so the ratio does not rise with the micro-batch: two
        quiet calibrations read 1.096, 1.074, 1.048, 1.035, 1.033 and 1.084, 1.076, 1.062,
        1.040, 1.040 at micro-batches 1 to 16. A host changing pace breaks that order by
        chance: one calibration read 1.048, 1.082, 1.084, 1.00, 1.167, priced ZB-H1 at micro-batch
        8 as free, and made it the plan's first pick, measured 5.5% over 1F1B (the 4-rank
        planner check's run 43: ranked at 0.49, 0.83 read through the fit; runs 40 and 41
        unchanged: benchmarks/RESULTS.md)."""
        return _at_micro_batch(_non_increasing(self.split_by_micro_batch), micro_batch)

    def op_bandwidth(self, op: str, n: int) -> float:
        """Bytes/s of `op` on n ranks inside a node where it was measured apart from the
        all-reduce (the nearest measured group size), else 0.0."""
        rows = [row for row in self.op_links if row[0] == op]
        if not rows:
            return 0.0
        size = _nearest_size((row[1] for row in rows), n)
        return next(row[2] for row in rows if row[1] == size) * 1e9

    def ring_bandwidth(self, ranks_per_node: int) -> float:
        """Bytes/s through each rank of a ring that spans nodes with `ranks_per_node` of its
        ranks in each: that many ranks' shares of the node's NICs (each rank's ring channels
        cross on all of them; the node's other groups use the rest), up to the link inside
        the node that every other hop of the ring takes."""
        return min(max(1, ranks_per_node) * self.bandwidth(True), self.bandwidth(False))

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for matmuls in `precision`: fp32, 16-bit for bf16/fp16, float8 for the
        products `--precision fp8` runs in float8 (the 16-bit peak on a device without them)."""
        if precision == "fp8" and self.peak_fp8_tflops:
            return self.peak_fp8_tflops * 1e12
        tflops = self.peak_fp32_tflops if precision == "fp32" else self.peak_bf16_tflops
        return tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def usable_bytes(self) -> float:
        """Memory left for plait's tensors once the runtime has taken its share."""
        return (self.memory_gib - self.reserved_gib) * GIB

    def bandwidth(self, inter_node: bool) -> float:
        """Bytes per second one rank can put on the wire."""
        return (self.inter_node_gb_s if inter_node else self.intra_node_gb_s) * 1e9

    def latency(self, inter_node: bool) -> float:
        """Seconds per step of a ring collective (or per point-to-point message)."""
        return (self.inter_node_latency_us if inter_node else self.intra_node_latency_us) * 1e-6


def _lag_row_ok(row: tuple) -> bool:
    """A `lags` row: (a group of 2 or more ranks, a positive burst in µs, a lag of 0 or more µs)."""
    if len(row) != 3:
        return False
    n, burst_us, extra_us = row
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  for v in (burst_us, extra_us))
    return isinstance(n, int) and not isinstance(n, bool) and n > 1 and numbers and burst_us > 0 and extra_us >= 0


def _nearest_size(sizes: Iterable[int], n: int) -> int:
    """The measured group size nearest n, the larger on a tie: what a calibration that did not
    time n ranks says of them."""
    return min(sizes, key=lambda size: (abs(size - n), -size))


def _non_increasing(table: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """The closest non-increasing fit of a (micro-batch, ratio) table, in the least-squares
    sense: each run of readings that rises with the micro-batch is replaced by its mean, and
    runs are merged until none rises (pooled adjacent violators)."""
    def mean(pool: list[tuple[int, float]]) -> float:
        return statistics.fmean(ratio for _, ratio in pool)

    pools: list[list[tuple[int, float]]] = []  # consecutive rows, each pool read as its mean
    for row in sorted(table):
        pools.append([row])
        while len(pools) > 1 and mean(pools[-2]) < mean(pools[-1]):
            rising = pools.pop()
            pools[-1] += rising
    return tuple((micro_batch, mean(pool)) for pool in pools for micro_batch, _ in pool)


def _at_micro_batch(table: tuple[tuple[int, float], ...], micro_batch: int) -> float:
    """A (micro-batch, ratio) table's ratio at the nearest measured micro-batch; 0.0 if empty."""
    if not table:
        return 0.0
    return dict(table)[_nearest_size((row[0] for row in table), micro_batch)]


FAMILY_MIN = 3  # products measured at this many row counts, at least, to read one off their line


def _product(key: str) -> tuple[str, tuple[int, int, int]] | None:
    """("fp32", (M, K, N)) of a GEMM key, None for any other (an attention's)."""
    dtype, _, dims = key.partition(" ")
    parts = dims.split("x")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    m, k, n = (int(part) for part in parts)
    return dtype, (m, k, n)


@functools.cache  # the planner reads every block's products for each layout: one fit a family
def _rows_fit(gemm: tuple[tuple[str, float], ...], key: str, axis: int) -> float:
    """TFLOP/s of `key` on the line time = fixed + rows · per-row through the products of
    `gemm` that share its dtype and its dimensions other than `axis` (`relative_line`); a line
    with a negative fixed part goes through zero. 0.0 where fewer than FAMILY_MIN such products were measured."""
    found = _product(key)
    if found is None:
        return 0.0
    dtype, dims = found
    others = dims[:axis] + dims[axis + 1:]
    points = []  # (rows, seconds)
    for name, tflops in gemm:
        member = _product(name)
        if member is None or member[0] != dtype or tflops <= 0:
            continue
        shape = member[1]
        if shape[:axis] + shape[axis + 1:] == others:
            points.append((shape[axis], 2.0 * math.prod(shape) / (tflops * 1e12)))
    if len(points) < FAMILY_MIN:
        return 0.0
    per_row, fixed = relative_line(points)
    if per_row <= 0 or fixed < 0:
        per_row, fixed = relative_line(points, through_zero=True)
    return 2.0 * math.prod(dims) / ((fixed + per_row * dims[axis]) * 1e12)


def relative_line(points: list[tuple[float, float]], through_zero: bool = False) -> tuple[float, float]:
    """(slope, intercept) of the line t = intercept + slope · x through (x, t) `points` that
    least-squares their relative errors (weights 1/t², so that a small product's error counts
    as much as a large one's); with `through_zero`, the slope of the line through the origin.
    A GEMM's time read by its FLOPs (ops.fit_gemm_line) or by its rows (`_rows_fit`)."""
    weights = [1.0 / t ** 2 for _, t in points]
    sxx = math.fsum(w * x * x for w, (x, _) in zip(weights, points))
    sxt = math.fsum(w * x * t for w, (x, t) in zip(weights, points))
    if through_zero:
        return sxt / sxx, 0.0
    sw = math.fsum(weights)
    sx = math.fsum(w * x for w, (x, _) in zip(weights, points))
    st = math.fsum(w * t for w, (_, t) in zip(weights, points))
    det = sw * sxx - sx ** 2
    slope = (sw * sxt - sx * st) / det if det > 0 else 0.0
    return slope, (st - slope * sx) / sw


_SIZED = ("memory_by_size", "stream_by_size", "lone_by_micro_batch", "split_by_micro_batch")  # (size, a positive rate) rows
_TABLES = ("gemm", "links", "op_links", "lags", *_SIZED)
_AT_LEAST_ONE = (  # (micro-batch, ratio) tables whose ratios cannot be under 1, and why
    ("lone_by_micro_batch", "speedups", "how much faster a rank works with a core of its own than sharing one"),
    ("split_by_micro_batch", "ratios", "a split backward's micro-batch over a whole one's: it does all of its work"),
)


def sized_rate(table: tuple[tuple[int, float], ...], size: float) -> float:
    """The rate of `table` ((size, rate) rows, sorted) at `size`, 0.0 for an empty table.

    An op costs a fixed part plus its size over a rate, so its time is taken as linear in
    size: between the two measured sizes around `size`, and beyond the largest at the
    marginal rate of the last two (a large op amortises the fixed part that a measured one
    still paid), the whole rate rising at most to EXTRAPOLATED times the largest size's (two
    noisy rows must not promise any speed). Below the smallest measured size its rate holds."""
    if not table:
        return 0.0
    if len(table) == 1 or size <= table[0][0]:
        return table[0][1]
    times = [(n, n / rate) for n, rate in table]
    for (low, low_t), (high, high_t) in zip(times, times[1:]):
        if size <= high:
            return size / (low_t + (size - low) * (high_t - low_t) / (high - low))
    (before, before_t), (last, last_t) = times[-2], times[-1]
    marginal = (last - before) / (last_t - before_t) if last_t > before_t else table[-1][1]
    beyond = size / (last_t + (size - last) / max(marginal, table[-1][1]))
    return min(beyond, EXTRAPOLATED * table[-1][1])


EXTRAPOLATED = 2.0  # beyond the largest measured size, a rate rises to at most this times its rate there


@functools.cache  # memory_rate reads it on every element-wise op the planner prices: one table, capped once
def _no_faster_smaller(table: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """An element-wise op's `table`, each rate at most every larger size's: a small op pays its
    fixed part over fewer bytes. A row that timed faster had its data stay in the caches: on 4 ranks
    sharing 2 cores, a burst of one 384 KiB add ran at 57.9 GB/s in one calibration (the
    3 MiB add at 11.3) and 7.8 in the next, and the plan priced micro-batch 2 × 2's element-wise
    work 21 ms under micro-batch 4's, where training measured the split 6.8% over."""
    capped, slowest = [], math.inf
    for size, rate in reversed(table):
        slowest = min(slowest, rate)
        capped.append((size, slowest))
    return tuple(reversed(capped))


_MAY_BE_ZERO = {"op_overhead_us", "gemm_fixed_us", "p2p_latency_us",
                "view_overhead_us", "step_overhead_us", "optimizer_tensor_us", "grad_tensor_us",
                "stream_gb_s", "peak_fp8_tflops"}

# A GEMM's time is its FLOPs at peak·compute_efficiency plus a fixed ramp: fitted
# (ops.fit_gemm_line) to 270 bf16 shapes (m 1k-16k, k 512-16k, n 128-32k) queued on an H200
# (benchmarks/RESULTS.md, GPU section, 2026-11-27): 13.5 µs and 686 TFLOP/s, the 0.69 of peak
# that _HOPPER's efficiency says. The other GPUs take the same ramp, unmeasured.
GEMM_RAMP_US = 13.5
# compute_efficiency is the rate of that line, not the best GEMM's: on the H200 the line's
# 686 TFLOP/s is 0.87 of what an 8192³ product reaches on Hopper (772-797, RESULTS.md). The
# best large 16-bit GEMMs reach ~80% of the datasheet peak on A100 and V100 (cuBLAS at 8192³,
# as published by the vendors); their line is taken at the same 0.87 of that, 0.70, unmeasured.
# Narayanan et al.'s Table 1 bears it out: at 0.80 its rows from 39 B up came 1.06-1.15x fast
# once Megatron's kernels were counted as it ran them (stacks.py). A fused attention core
# (FlashAttention-2, forward + backward) reaches 50-73% of an A100's peak (Dao, 2023; the long
# causal sequences near the top), taken at 0.60 (llm-foundry's MPT-3B at 65,536 tokens, 82% of
# its step in attention, implies 0.62; at 0.50 its A100 table read 0.86 of the published MFU
# where its H100 one reads 1.01), and ~35% on H100 (FlashAttention-3's paper). V100 keeps 0.50.
# Kernel launches hide behind the work on a GPU: no per-op cost. 1 ms per step for the training loop.
_GPU_DEFAULTS = dict(intra_node_latency_us=3.0, inter_node_latency_us=8.0, gpus_per_node=8,
                     step_overhead_us=1000.0, queues_kernels=True, gemm_fixed_us=GEMM_RAMP_US)
# The host's AdamW under offload (the fp32 master, m and v live in CPU memory and the CPU
# steps them): torch's fused CPU AdamW moved 112-133 GB/s of its 28 bytes a parameter at 256 Mi
# to 1 Gi parameters on a 16-core H200 host (benchmarks/RESULTS.md, GPU section, offload's
# host step), about the host memory's speed; a GPU's share of a DGX-class host is about as
# many cores. (The 13.5 GB/s an offload step reached before was its copies allocating fresh
# host memory and converting on the CPU, not AdamW.) `plait calibrate` measures the host at hand.
_AMPERE = dict(compute_efficiency=0.7, attention_efficiency=0.5)
_A100 = dict(_AMPERE, attention_efficiency=0.6)
_HOPPER = dict(compute_efficiency=0.7, attention_efficiency=0.35)

PRESETS: dict[str, Hardware] = {
    # V100 has no bf16 units: the 16-bit figure is fp16's. NVLink 2 (6 x 25 GB/s); a DGX-1's
    # four 100 Gb/s EDR NICs for its eight GPUs: 6.25 GB/s a GPU.
    "v100": Hardware("v100", 125.0, 15.7, 32.0, 150.0, 6.25, pcie_gb_s=16.0, memory_gb_s=900.0,
                     **_AMPERE, **_GPU_DEFAULTS),
    # NVLink 3 (600 GB/s both ways), HDR IB (200 Gb/s per GPU), PCIe 4.
    "a100-40gb": Hardware("a100-40gb", 312.0, 19.5, 40.0, 300.0, 25.0, pcie_gb_s=32.0,
                          memory_gb_s=1555.0, **_A100, **_GPU_DEFAULTS),
    "a100-80gb": Hardware("a100-80gb", 312.0, 19.5, 80.0, 300.0, 25.0, pcie_gb_s=32.0,
                          memory_gb_s=2039.0, **_A100, **_GPU_DEFAULTS),
    # NVLink 4 (900 GB/s both ways), NDR IB (400 Gb/s per GPU), PCIe 5.
    "h100-sxm": Hardware("h100-sxm", 989.0, 67.0, 80.0, 450.0, 50.0, pcie_gb_s=64.0,
                         memory_gb_s=3350.0, peak_fp8_tflops=1979.0, **_HOPPER, **_GPU_DEFAULTS),
    # No NVLink switch: GPUs in a box talk over PCIe 5.
    "h100-pcie": Hardware("h100-pcie", 756.0, 51.0, 80.0, 64.0, 25.0, pcie_gb_s=64.0,
                          memory_gb_s=2000.0, peak_fp8_tflops=1513.0, **_HOPPER, **_GPU_DEFAULTS),
    # H100's compute with 141 GB of HBM3e.
    "h200": Hardware("h200", 989.0, 67.0, 141.0, 450.0, 50.0, pcie_gb_s=64.0, memory_gb_s=4800.0,
                     peak_fp8_tflops=1979.0, **_HOPPER, **_GPU_DEFAULTS),
    # Consumer cards: 16-bit tensor figure with fp32 accumulation (what torch uses); no
    # NVLink, peers talk over PCIe 4; one 100 Gb/s NIC assumed between boxes of four, so a
    # GPU's share of it is a quarter.
    "rtx3090": Hardware("rtx3090", 71.0, 35.6, 24.0, 25.0, 3.125, gpus_per_node=4,
                        reserved_gib=1.0, memory_gb_s=936.0, **_AMPERE, step_overhead_us=1000.0,
                        queues_kernels=True, gemm_fixed_us=GEMM_RAMP_US),
    "rtx4090": Hardware("rtx4090", 165.2, 82.6, 24.0, 25.0, 3.125, gpus_per_node=4,
                        reserved_gib=1.0, memory_gb_s=1008.0, **_AMPERE, step_overhead_us=1000.0,
                        peak_fp8_tflops=330.3, queues_kernels=True, gemm_fixed_us=GEMM_RAMP_US),
    # The 2-core AMD EPYC VM plait was written on (AVX2 only, 23.5 GiB RAM), measured on
    # 2026-11-22 with torch 2.13 on 2 threads: the best 1024x1024 fp32 matmuls of several
    # runs reached 160-175 GFLOP/s (40-70 while another job shared the cores); bf16 matmuls, with no AVX512-bf16 to use, ran at ~1.3 GFLOP/s
    # (256x256). The link is Gloo over loopback between 2 processes: a 64 MiB all-reduce
    # put 1.2 GB/s on the wire per rank, a 4-byte one took ~280 µs (two ring steps). A
    # tensor copy ran at 8.8 GB/s. Training the 9.5 M-parameter `small` preset (fp32,
    # 8 x 256 tokens) reached 108 GFLOP/s of model FLOPs: ~0.7 of the matmul peak.
    "cpu": Hardware(
        "cpu", peak_bf16_tflops=0.0013, peak_fp32_tflops=0.16, memory_gib=23.5,
        intra_node_gb_s=1.2, inter_node_gb_s=1.2, intra_node_latency_us=140.0,
        inter_node_latency_us=140.0, gpus_per_node=2, compute_efficiency=0.7,
        reserved_gib=1.0, pcie_gb_s=8.8, host_mem_gb_s=8.8, memory_gb_s=8.8,
        attention_efficiency=0.3, op_overhead_us=10.0, view_overhead_us=2.0,
        step_overhead_us=2000.0, optimizer_tensor_us=100.0, grad_tensor_us=100.0,
    ),
}


def get_hardware(name: str) -> Hardware:
    """Look up a preset, with an error that lists the names that exist."""
    if name not in PRESETS:
        raise PlaitError(
            f"unknown hardware {name!r}",
            hint=f"choose one of: {', '.join(PRESETS)}, or pass --hardware-file FILE.toml",
        )
    return PRESETS[name]


def load_hardware(path: str | Path, base: str | None = None) -> Hardware:
    """Read a `[hardware]` table from a TOML file.

    Keys are `Hardware`'s field names; any not given come from the preset named by the
    table's `base` key (or `base` here), so a file can say just "like h100-sxm, but with
    200 Gb/s between nodes".
    """
    path = Path(path)
    tomllib = _toml_reader()
    try:
        table = tomllib.loads(path.read_text()).get("hardware")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PlaitError(f"cannot read hardware file {str(path)!r}: {exc}",
                         hint="give a readable TOML file with a [hardware] table") from exc
    if not isinstance(table, dict):
        raise PlaitError(f"{str(path)!r} has no [hardware] table",
                         hint="put the device's numbers under a [hardware] heading")
    return hardware_from_table(dict(table), base)


def _toml_reader() -> Any:
    """The stdlib's tomllib (3.11+), or tomli on 3.10. Imported only when a file is read, so
    `plait estimate` and `plait plan` with presets need nothing beyond the standard library."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError as exc:
            raise PlaitError("reading a --hardware-file on Python 3.10 needs the tomli package",
                             hint="pip install tomli (plait's own install brings it), or use Python 3.11+") from exc
    return tomllib


def hardware_from_table(table: dict[str, object], base: str | None = None) -> Hardware:
    """Build a `Hardware` from a dict of field values, optionally starting from a preset."""
    base_name = str(table.pop("base", base or ""))
    _measured_tables(table)
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise PlaitError(f"unknown [hardware] keys: {', '.join(unknown)}",
                         hint=f"valid keys: base, {', '.join(sorted(known))}")
    if base_name:
        start = get_hardware(base_name)
        return replace(start, **{"name": table.pop("name", f"{base_name}*"), **table})
    missing = sorted(known - set(table) - _OPTIONAL)
    if missing:
        raise PlaitError(f"[hardware] table lacks {', '.join(missing)}",
                         hint="give these keys, or base = \"<preset>\" to inherit them")
    return Hardware(**table)  # type: ignore[arg-type]


def _measured_tables(table: dict[str, object]) -> None:
    """`[hardware.gemm]` ("fp32 MxKxN" = TFLOP/s) and `[hardware.links]` ("n" = {latency_us,
    gb_s}) sub-tables, as the tuples `Hardware` keeps."""
    try:
        if isinstance(table.get("gemm"), dict):
            table["gemm"] = tuple(sorted((str(k), float(v)) for k, v in table["gemm"].items()))
        if isinstance(table.get("links"), dict):
            table["links"] = tuple(sorted((int(k), float(v["latency_us"]), float(v["gb_s"]))
                                          for k, v in table["links"].items()))
        if isinstance(table.get("op_links"), dict):
            table["op_links"] = tuple(sorted((str(k).split()[0], int(str(k).split()[1]), float(v))
                                             for k, v in table["op_links"].items()))
        if isinstance(table.get("lags"), dict):
            table["lags"] = tuple(sorted(_lag_entry(str(k), v) for k, v in table["lags"].items()))
        for sized in _SIZED:
            if isinstance(table.get(sized), dict):
                table[sized] = tuple(sorted((int(k), float(v)) for k, v in table[sized].items()))
    except (TypeError, ValueError, KeyError) as exc:
        raise PlaitError(f"bad [hardware.gemm], [hardware.links], [hardware.op_links], [hardware.lags], "
                         f"[hardware.memory_by_size], [hardware.stream_by_size], "
                         f"[hardware.lone_by_micro_batch] or [hardware.split_by_micro_batch] entry: {exc}",
                         hint='gemm: "fp32 MxKxN" = TFLOP/s; links: "2" = {latency_us = .., gb_s = ..}; '
                              'op_links: "all_gather 2" = GB/s; lags: "2 4000.0" = µs; memory_by_size: "bytes" = GB/s; '
                              'stream_by_size: "parameters" = GB/s; lone_by_micro_batch and split_by_micro_batch: '
                              '"micro-batch" = ratio') from None


def _lag_entry(key: str, value: object) -> tuple[int, float, float]:
    """`"ranks burst_us" = lag_us` as a `lags` row; ValueError for anything else."""
    ranks, burst_us = key.split()  # exactly two words
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key!r} = {value!r}: the lag is a number of µs")
    return int(ranks), float(burst_us), float(value)


def hardware_toml(hw: Hardware, header: dict[str, str] | None = None) -> str:
    """`hw` as a TOML file that `load_hardware` reads back to an equal Hardware."""
    lines = [f"# {key}: {value}" for key, value in (header or {}).items()]
    lines.append("[hardware]")
    for f in fields(Hardware):
        value = getattr(hw, f.name)
        if f.name not in _TABLES:
            lines.append(f"{f.name} = {_toml_value(value)}")
    lines.append("\n[hardware.gemm]")
    lines += [f'"{key}" = {rate!r}' for key, rate in hw.gemm]
    lines.append("\n[hardware.links]")
    lines += [f'"{n}" = {{ latency_us = {lat!r}, gb_s = {bw!r} }}' for n, lat, bw in hw.links]
    lines.append("\n[hardware.op_links]")
    lines += [f'"{op} {n}" = {bw!r}' for op, n, bw in hw.op_links]
    lines.append("\n[hardware.lags]")
    lines += [f'"{n} {burst!r}" = {extra!r}' for n, burst, extra in hw.lags]
    for sized in _SIZED:
        lines.append(f"\n[hardware.{sized}]")
        lines += [f'"{size}" = {rate!r}' for size, rate in getattr(hw, sized)]
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


# Fields with defaults may be left out of a table that names no base preset.
_OPTIONAL = {f.name for f in fields(Hardware) if f.default is not MISSING}


def resolve_hardware(hardware: str | Hardware, hardware_file: str | Path | None = None) -> Hardware:
    """A Hardware from a preset name, an object, or a TOML file (the file wins)."""
    if hardware_file is not None:
        return load_hardware(hardware_file, base=hardware if isinstance(hardware, str) else None)
    if isinstance(hardware, Hardware):
        return hardware
    return get_hardware(hardware)
