"""`plait calibrate`: measure this machine for the time model, on every rank at once.

What the model of plait/estimate/ops.py needs, measured the way training will use it (all
local ranks busy at the same time, each on its share of the cores):
* the TFLOP/s of every GEMM the model runs (forward and both backward shapes), in its dtype,
  and of its attention core (forward + backward);
* memory bandwidth at the size of one activation (b·s·h), the rate of the guarded update
  (finite check, clipping, AdamW) at the model's size, and the fixed costs of an op, a view,
  an optimizer tensor and a gradient check;
* the loop's own cost per step (walking the model's states for the report);
* per group size of the first n ranks: a ring step's latency (an 8-byte all-reduce; on a CPU
  between bursts of compute, as a step meets it) and the bus bandwidth of a large all-reduce;
  and a send/recv pair's latency between two ranks, taken the same way.
Each timing is the median of several runs; across ranks the slowest counts. On a crowded
host (more ranks' threads than cores) a compute timing spans every rank's run, and each
collective is timed in every group at once (`crowded`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F

from plait.estimate.ops import (
    OPS_BLOCK,
    OPS_OUTER,
    TENSORS_PER_BLOCK,
    UPDATE_BYTES,
    Gemm,
    attention_key,
    block_gemms,
    gemm_key,
    gemm_precision,
    head_gemm,
    ring_key,
)
from plait.estimate.exposed import HOST_ADAM_BYTES
from plait.models.gpt.config import GPTConfig
from plait.rules import FLOAT8_TILE
from plait.runtime import comm
from plait.runtime.env import keep_freed_memory
from plait.runtime.mesh import Mesh
from plait.runtime.subgroups import first_ranks_axes, group_sizes, tiled_axes
from plait.bench.meter import storage_bytes
from plait.parallel.compose import adamw_kernel

# Raised whenever what is measured, or how, changes: machine.py keys its cache on it.
# 2: the update (norm, clipping, AdamW) timed at the model's size; per-piece check costs.
# 3: the host's AdamW (host_mem_gb_s, for offload) measured, on at least HOST_UPDATE_MIN parameters.
# 4: rates keyed by the size they were taken at (adds, the update); GPU timings queued; the update on
#    the run's precision path (16-bit weights over fp32 masters).
# 5: sizes keyed as the time model reads them (one op's write on a rank in the run's dtype, the
#    parameters a rank steps); attention queued on a GPU too.
# 6: on a GPU the update timed in four tensors (update_chunk): the device's pass, not the host's.
# 7: on a GPU the update timed up to 256 Mi parameters (stream_cap), as far as its free memory allows.
# 8: all-gather's and reduce-scatter's own bus bandwidth (op_links); ring attention's compute per cp.
# 9: on a CPU a collective's step latency taken between bursts of compute, as a step meets it (in_step_s).
# 10: a send/recv pair's latency (p2p_latency_us), for ring attention's steps and pipeline messages.
# 11: fp8's block GEMMs timed as float8 products (they were timed in bf16), its head in bf16.
# 12: on a crowded CPU host (more ranks' threads than cores) a round timed from the first rank's start
#     to the last rank's end (each rank timed alone measured a whole core).
# 13: a CPU add's dispatch taken out of its bandwidth (the model adds it per op); GEMMs and attention
#     timed at each micro-batch asked (--micro-batch 8,4,2,1); training keeps freed memory as timed.
# 14: on a CPU what a collective adds after longer bursts of compute than its latency's (lags).
# 15: the large all-reduce, all-gather and reduce-scatter timed in turns, round by round; on a crowded
#     host the GEMMs' and attention's shapes set against each other by each rank's CPU time.
# 16: Gloo's small all-reduces, all-gathers and reduce-scatters run as one all-to-all (runtime/comm).
# 17: on a CPU that is not crowded the GEMMs' and attention's shapes set against each other by a second
#     run straight after the first (its operands resident), their level by the first runs.
# 18: a crowded host's crowding, and how much faster a lone rank trains at each micro-batch
#     (lone_by_micro_batch): a pipeline's waiting ranks leave their cores to the others.
# 19: a quick calibration times adds at three sizes, as a full one does, and every calibration over
#     BANDWIDTH_ROUNDS rounds (a quick one priced a step's large element-wise ops at its activations').
# 20: on a CPU, how much longer a micro-batch takes with ZB-H1's split backward (split_by_micro_batch).
METHOD_VERSION = 20


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


SPREADS = Spreads()  # this process's timings since the calibration began (plait.bench.machine resets it)


def _median_s(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up: allocations, kernel selection
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median_rounds(mesh: Mesh, fns: list[Callable[[], Any]], rounds: int, watched: bool = False) -> list[float]:
    """Median seconds of each of `fns` over `rounds` passes through all of them, ranks in step.

    Interleaving (rather than one shape's repetitions back to back) spreads a passing
    disturbance over every shape instead of moving one shape's rate; a barrier before each
    timing keeps the ranks on the same shape at the same moment, as training does, where
    they share the caches and the memory bus. On a crowded host (`crowded`) each round runs a
    burst of each and is timed from the first rank's start to the last rank's end (`_spans`);
    the compute timings (`watched`) there take their shapes against each other from each
    rank's own CPU time (`_shaped`); on a CPU that is not, from a second run of each straight
    after the first (`_resident`)."""
    crowd = crowded(mesh)
    shaped = crowd and watched  # CPU time read only where `_shaped` uses it: each read costs about 0.6 µs
    again = watched and not crowd and mesh.device.type == "cpu"  # a second run straight after: `_resident`
    bursts = _bursts(mesh, fns, crowd)
    starts: list[list[float]] = [[] for _ in fns]
    ends: list[list[float]] = [[] for _ in fns]
    worked: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, burst, began, ended, cpu in zip(fns, bursts, starts, ends, worked):
            _in_step(mesh)
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
        times = [[span / burst for span in spans] for spans, burst in zip(_spans(mesh, starts, ends), bursts)]
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
    cpu = _slowest(mesh, cpu)
    if not all(t > 0 for t in cpu):
        return spans
    level = statistics.median(span / t for span, t in zip(spans, cpu))
    return [t * level for t in cpu]


CROWDED_BURST_S = 0.02  # a crowded host's timed burst: a rank's late wake-up (about 0.5 ms on 2 cores) a 40th of it


def _bursts(mesh: Mesh, fns: list[Callable[[], Any]], crowd: bool) -> list[int]:
    """Runs of each of `fns` a timing takes, after one warm-up run each (allocations, kernel
    selection): one, or on a crowded host (`crowd`) enough for CROWDED_BURST_S, from the slowest rank's
    warm-up (every rank runs as many). There the span of a single run paid the last rank's
    wake-up from the barrier: calibrated GEMMs carried a 656 µs fixed cost (61 µs timed
    alone), and 4 ranks' steps were predicted 34% slow."""
    warm = []
    for fn in fns:
        start = time.monotonic()
        fn()
        warm.append(time.monotonic() - start)
    if not crowd:
        return [1] * len(fns)
    return [max(1, min(64, math.ceil(CROWDED_BURST_S / max(t, 1e-6)))) for t in _slowest(mesh, warm)]


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


CROWDING_BURST_S = 0.15  # a burst of the block's steps, every rank at work: wake-ups a few ms of it
CROWDING_ROUNDS = 9  # five measured 1.92-2.23 on 4 ranks on 2 cores


def measure_lone_speedup(mesh: Mesh, config: GPTConfig, micro_batch: int, seq_len: int) -> float:
    """On a crowded host, how much faster a rank trains while only as many ranks as the
    cores hold work, the others asleep in a barrier, than while every rank works: a block at
    the model's widths (one layer, a small vocabulary), forward and backward at `micro_batch`,
    in bursts taken both ways in turns, each timed from the first rank's start to the last
    working rank's end. Shared without loss that is `crowding` (2 for 4 one-thread ranks on 2
    cores); ranks that share cores also share caches, and a block's steps measured 1.99-2.22
    here (micro-batches 16 to 1), not 2. 0.0 where the host is not crowded. A pipeline's
    waiting ranks give the working ones this pace (estimate/pipeline.Crowd)."""
    if not crowded(mesh):
        return 0.0
    from plait.models.gpt.model import build_gpt

    block = one_block(config, seq_len)
    model = build_gpt(block, 0).to(mesh.device)
    ids = torch.randint(0, block.vocab_size, (micro_batch, seq_len), device=mesh.device)

    def train() -> None:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()

    train()
    burst = max(1, math.ceil(CROWDING_BURST_S / max(_slowest(mesh, [_median_s(train, 2)])[0], 1e-6)))
    working = max(1, int(mesh.env.world_size / crowding(mesh)))  # one thread a core
    spans: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(CROWDING_ROUNDS):
        for everyone in (True, False):
            _in_step(mesh)
            works = everyone or mesh.env.rank < working
            start = time.monotonic() if works else math.inf
            for _ in range(burst if works else 0):
                train()
            end = time.monotonic() if works else -math.inf
            spans[everyone].append(_spans(mesh, [[start]], [[end]])[0][0])
    return max(1.0, statistics.median(spans[True]) / statistics.median(spans[False]))


def one_block(config: GPTConfig, seq_len: int) -> GPTConfig:
    """The block a calibration trains to time a rank's pace: one layer at `config`'s widths, a
    vocabulary of 256 (the head a block's share, not the model's), untied (ZB-H1's split needs
    each weight in one module)."""
    return GPTConfig(vocab_size=256, n_layers=1, d_model=config.d_model, n_heads=config.n_heads,
                     n_kv_heads=config.n_kv_heads, ffn_hidden=config.ffn_hidden, max_seq_len=seq_len,
                     tie_embeddings=False)


SPLIT_ROUNDS = 9  # as CROWDING_ROUNDS: each round a whole and a split micro-batch, 0.1-0.4 s on `small`


def measure_split_backward(mesh: Mesh, config: GPTConfig, micro_batch: int, seq_len: int,
                           precision: str = "fp32") -> float:
    """How much longer a micro-batch takes with its backward split in I and W, as ZB-H1 runs it
    (plait.parallel.pipeline.execute.StageWork), than whole: `one_block` in `precision`'s dtype,
    forward and backward both ways in turns, every rank at once, set against each other as the
    GEMMs are (`_median_rounds`, watched), the slowest rank's. On `small`, 1.03-1.13 at
    micro-batches 16 to 1 on 4 ranks sharing 2 cores (benchmarks/RESULTS.md, run 14), where what
    W makes again priced 1.02 (estimate/ops.micro_batch_compute_s reads it). Measured at the
    calibration's sequence and tp 1: a layout's micro-batch reads the nearest micro-batch's."""
    from plait.models.gpt.model import build_gpt
    from plait.parallel.pipeline.execute import StageWork

    block = one_block(config, seq_len)
    ids = torch.randint(0, block.vocab_size, (micro_batch, seq_len), device=mesh.device)
    dtype = _dtype(precision)  # fp8's blocks run bf16 outside their products

    def train(split: bool) -> Callable[[], None]:
        work = StageWork(build_gpt(block, 0).to(mesh.device, dtype), split_backward=split)

        def step() -> None:
            out, state = work.forward(ids, grad_input=False)
            loss = F.cross_entropy(out.flatten(0, 1).float(), ids.flatten())
            if split:  # as the runner hands I the last stage's loss
                state.output, state.loss_input = loss, out
                work.backward_input(state, None)
                work.backward_weight(state)
            else:
                loss.backward()
            work.module.zero_grad(set_to_none=True)
            _sync(mesh)
        return step

    whole, split = _slowest(mesh, _median_rounds(mesh, [train(False), train(True)], SPLIT_ROUNDS, watched=True))
    return split / whole


def _spans(mesh: Mesh, starts: list[list[float]], ends: list[list[float]]) -> list[list[float]]:
    """Each round's seconds from the first rank's start to the last rank's end, on the host's
    monotonic clock (one clock for every process on it): the time all ranks need to run the
    shape once together, as a step's ranks do."""
    first = torch.tensor(starts, dtype=torch.float64)
    last = torch.tensor(ends, dtype=torch.float64)
    comm.all_reduce(first, mesh.axis("world"), op="min", purpose=comm.TELEMETRY)
    comm.all_reduce(last, mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    return (last - first).tolist()


def _in_step(mesh: Mesh) -> None:
    if mesh.env.world_size > 1:
        comm.barrier(mesh.axis("world"))


def _slowest(mesh: Mesh, values: list[float]) -> list[float]:
    """Max over every rank of each value (the slowest rank sets the pace)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=mesh.device)
    comm.all_reduce(tensor, mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    return tensor.tolist()


def _sync(mesh: Mesh) -> None:
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()


def model_shapes(config: GPTConfig, micro_batch: int, seq_len: int, tp_sizes: list[int],
                 precision: str, cp_sizes: list[int] = (), other_micro_batches: Sequence[int] = ()
                 ) -> tuple[list[str], dict[str, Gemm]]:
    """Attention keys (the whole core's at `micro_batch` first, then at the other micro-batches,
    then ring attention's at each cp > 1) and {key: Gemm} of every GEMM the model runs, for
    each tp degree and micro-batch."""
    gemms: dict[str, Gemm] = {}
    attention: list[str] = []
    for batch in [micro_batch, *other_micro_batches]:
        tokens = batch * seq_len
        for tp in tp_sizes:
            blocks = block_gemms(config, tokens, tp) + (block_gemms(config, tokens, tp, moe=True) if config.is_moe else [])
            head = head_gemm(config, tokens, tp)
            for g in [*blocks, head, *(x for g in (*blocks, head) for x in g.backward())]:
                gemms[gemm_key(g, gemm_precision(g, precision))] = g  # fp8 leaves the head, experts bf16
        keys = sorted({attention_key(config, batch, seq_len, tp, precision) for tp in tp_sizes})
        attention += [key for key in keys if key not in attention]
    rings = [ring_key(config, seq_len, tp, cp, precision) for tp in tp_sizes for cp in cp_sizes if cp > 1]
    return attention + sorted(set(rings)), gemms


def _dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def measure_gemms(mesh: Mesh, gemms: dict[str, Gemm], precision: str, reps: int) -> dict[str, float]:
    """{key: TFLOP/s} of each GEMM shape, slowest rank, in the dtype its key names: fp32,
    bf16, or fp8 (a float8 product, as --precision fp8 runs the blocks' linears)."""
    device = mesh.device

    def gemm(key: str, g: Gemm) -> Callable[[], None]:
        dtype_name = key.split()[0]
        if dtype_name == "fp8" and g.k % FLOAT8_TILE == 0 and g.n % FLOAT8_TILE == 0:
            return _queued(mesh, float8_product(g, device))
        dtype = _dtype(dtype_name)  # fp8 shapes off the float8 tiles stay bf16, as fp8 leaves those linears
        a = torch.randn(g.m, g.k, dtype=dtype, device=device)
        b = torch.randn(g.k, g.n, dtype=dtype, device=device)
        return _queued(mesh, lambda: torch.mm(a, b))

    times = _slowest(mesh, _median_rounds(mesh, [gemm(k, g) for k, g in gemms.items()], reps, watched=True))
    return {key: queue_depth(device) * g.flops / t / 1e12 for (key, g), t in zip(gemms.items(), times)}


def float8_product(g: Gemm, device: torch.device) -> Callable[[], torch.Tensor]:
    """`g` as torchao's tensorwise float8 linear runs it: e4m3 operands, one scale each, the
    second operand column-major (what the float8 kernels take), a bf16 result. Only the
    product is timed: the casts that make its operands are element-wise work."""
    a = torch.randn(g.m, g.k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(g.n, g.k, device=device).to(torch.float8_e4m3fn).t()
    scale = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)


def queue_depth(device: torch.device) -> int:
    """Ops issued before each sync when timing one: on a GPU, several, so that the time is
    the device's rate in a stream of kernels (as in training) rather than one launch's round
    trip to the host and back; on a CPU, where nothing queues, one."""
    return 8 if device.type == "cuda" else 1


def _queued(mesh: Mesh, op: Callable[[], Any]) -> Callable[[], None]:
    """A timing run: `op` queue_depth times, each result dropped at once (one output alive, as
    in training), then a sync. Its time over queue_depth is one op's."""
    queued = queue_depth(mesh.device)

    def run() -> None:
        for _ in range(queued):
            op()
        _sync(mesh)

    return run


def measure_attention(mesh: Mesh, config: GPTConfig, micro_batch: int, seq_len: int,
                      tp_sizes: list[int], precision: str, reps: int, cp_sizes: list[int] = (),
                      other_micro_batches: Sequence[int] = ()) -> dict[str, float]:
    """{key: TFLOP/s} of causal scaled-dot-product attention, forward + backward, counted as
    3 · 4·b·s²·h/t FLOPs (the model's convention: no discount for the mask), at `micro_batch`
    and each of the others; and, for each cp > 1, of one rank's ring attention compute
    (`_ring_run`, at `micro_batch`: its key is a rate, read at any), counted as
    3 · 4·b·(s/cp)·s·h/t."""
    out, runs, flops = {}, [], []
    for tp in sorted(set(tp_sizes)):
        heads = max(1, config.n_heads // tp)
        kv_heads = max(1, config.n_kv_heads // tp)
        shape = (micro_batch, heads, seq_len, config.head_dim)
        for batch in sorted({micro_batch, *other_micro_batches}, reverse=True):
            runs.append(_attention_run(mesh, (batch, *shape[1:]), precision))
            flops.append(3 * 4.0 * batch * seq_len * seq_len * heads * config.head_dim)
            out[attention_key(config, batch, seq_len, tp, precision)] = 0.0
        for cp in sorted({cp for cp in cp_sizes if cp > 1 and seq_len % (2 * cp) == 0}):
            runs.append(_ring_run(mesh, shape, kv_heads, cp, precision))
            flops.append(3 * 4.0 * micro_batch * (seq_len // cp) * seq_len * heads * config.head_dim)
            out[ring_key(config, seq_len, tp, cp, precision)] = 0.0
    times = _median_rounds(mesh, runs, reps, watched=True)
    for key, f, t in zip(list(out), flops, _slowest(mesh, times)):
        out[key] = queue_depth(mesh.device) * f / t / 1e12
    return out


def _attention_run(mesh: Mesh, shape: tuple[int, ...], precision: str) -> Callable[[], None]:
    """Forward + backward passes of the causal attention core, queued (`_queued`)."""
    q, k, v = (torch.randn(shape, dtype=_dtype(precision), device=mesh.device, requires_grad=True) for _ in range(3))
    return _queued(mesh, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())


class _Held:
    """A ring 'transfer' that stays on this rank: the block arriving is the one sent (its
    shape is all the compute depends on)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


def _ring_run(mesh: Mesh, shape: tuple[int, ...], kv_heads: int, cp: int, precision: str) -> Callable[[], None]:
    """One rank's forward and backward of ring attention over cp ranks (plait.parallel.context.
    ring's own loops: its calls on blocks of s/(2cp) tokens, merges and accumulations), the
    transfers left out (time.cp_s prices them), queued (`_queued`)."""
    from plait.parallel.context.ring import ring_backward, ring_forward

    batch, heads, seq, head_dim = shape
    dtype, device = _dtype(precision), mesh.device
    q = torch.randn(batch, heads, seq // cp, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(batch, kv_heads, seq // cp, head_dim, dtype=dtype, device=device) for _ in range(2))
    scale = head_dim ** -0.5

    def run() -> None:
        out, lse = ring_forward(q, k, v, cp, 0, _Held, True, scale, None)
        ring_backward(q, k, v, out, lse, torch.ones_like(out), cp, 0, _Held, True, scale, None)

    return _queued(mesh, run)


def measure_memory(mesh: Mesh, elements: int, tensors: int, reps: int, params: int = 0,
                   optimizer_kernel: str = "fused", precision: str = "fp32") -> dict[str, Any]:
    """Bandwidth of allocating adds at `add_sizes(elements)` (`elements`: an activation's size)
    and of the guarded update over `params`
    parameters (its rate in the bytes the time model counts), each keyed by the size it was
    taken at; the loop's walk over `tensors` parameter-like tensors (its per-step
    bookkeeping); and the fixed costs of ops, views, optimizer tensors and gradient checks
    (`measure_dispatch`). The update runs AdamW with the kernel the run will
    (plait.parallel.compose.adamw_kernel), on weights of the run's precision."""
    device = mesh.device
    many = [torch.ones(4, device=device) for _ in range(3 * tensors)]
    walk = _median_s(lambda: storage_bytes(many), reps)
    one = torch.ones(1, device=device)
    view = _median_s(lambda: [one.view(-1) for _ in range(100)], reps) / 100
    block, step, checks = measure_dispatch(mesh, reps, optimizer_kernel)
    walk, view, block, step, checks = _slowest(mesh, [walk, view, block, step, checks])
    op = max(0.0, block - view * DISPATCH_VIEWS) / DISPATCH_OPS
    memory = measure_bandwidth(mesh, add_sizes(elements), BANDWIDTH_ROUNDS, op)
    streamed = min(params, stream_cap(device))
    stream = (streamed, measure_stream(mesh, streamed, optimizer_kernel, reps, precision)) if streamed else None
    return {**({"stream_gb_s": stream[1], "stream_by_size": (stream,)} if stream else {}),
            "memory_gb_s": dict(memory)[elements * 4], "memory_by_size": memory, "op_overhead_us": op * 1e6,
            "view_overhead_us": view * 1e6, "step_overhead_us": walk * 1e6,
            "optimizer_tensor_us": step / DISPATCH_TENSORS * 1e6, "grad_tensor_us": checks / DISPATCH_TENSORS * 1e6}


# Rounds of the adds, quick calibration or full: they take well under a second, and 3 of them took
# their median on the allocator's first, slower passes over the large size (dp 4 on 4 ranks on 2
# cores priced 1.13-1.17 of its measurement in 5 worlds' first attempts of 6; benchmarks/RESULTS.md).
BANDWIDTH_ROUNDS = 11
ADD_SPREAD = 8  # the adds' sizes about an activation's: attention's scores, the FFN's hidden, the logits are larger


def add_sizes(elements: int) -> list[int]:
    """The adds a calibration times about an activation of `elements`: an eighth of it, it,
    and eight times it. Timed at the one size, a quick calibration priced every larger
    element-wise op at an activation's rate (up to four times the large size's on 4 ranks
    sharing 2 cores) and dp 4 there at 0.88-1.02 of its measured step, median 0.94."""
    return sorted({max(1, elements // ADD_SPREAD), elements, elements * ADD_SPREAD})


def measure_bandwidth(mesh: Mesh, sizes: list[int], reps: int, op_s: float = 0.0) -> tuple[tuple[int, float], ...]:
    """((bytes written, GB/s read + written), ...) of an allocating fp32 add, as eager ops
    do, at each of `sizes` elements, queued as `queue_depth` says; the slowest rank counts.

    On a CPU an op's time holds its dispatch, `op_s` (measure_dispatch's), which the time
    model adds for each op on its own (ops.elementwise_s): it is taken out here, so that it
    is not paid twice. Left in, it made small activations' element-wise work dearer than it
    runs (a 196 KiB add: 27 µs, 4.6 of them its dispatch). On a GPU the queued adds leave the
    host's dispatch out already."""
    def adds(elements: int) -> Callable[[], None]:
        x, y = (torch.randn(elements, device=mesh.device) for _ in range(2))
        return _queued(mesh, lambda: torch.add(x, y))

    dispatch = op_s if mesh.device.type == "cpu" else 0.0
    times = _slowest(mesh, _median_rounds(mesh, [adds(n) for n in sizes], reps))
    return tuple((n * 4, 3 * n * 4 * queue_depth(mesh.device) / max(t - dispatch, t / 2) / 1e9)
                 for n, t in zip(sizes, times))


def measure_stream(mesh: Mesh, params: int, optimizer_kernel: str, reps: int, precision: str = "fp32") -> float:
    """GB/s (in ops.py's UPDATE_BYTES a parameter) of the guarded update over `params`
    parameters in `update_chunk`-sized tensors, slowest rank, on the path the run's precision
    takes: fp32 weights clipped in place, or 16-bit weights whose fp32 masters step with the
    clip factor folded in (plait.parallel.masters), which moves other bytes at other speeds
    (the 1 B GPT's bf16 update ran twice the fp32 one's rate a parameter on an H200). The
    tensors' fixed costs are nothing to subtract: on a CPU they are a fraction of a percent
    of this size's pass, and on a GPU the few tensors leave the device's pass alone to time."""
    if mesh.device.type == "cpu":
        keep_freed_memory()
    chunk = update_chunk(mesh.device, params)
    update = _slowest(mesh, [_median_s(_flat_update(mesh, params, optimizer_kernel, precision, chunk), reps)])[0]
    return UPDATE_BYTES * params / update / 1e9


def stream_cap(device: torch.device) -> int:
    """Parameters the timed update steps at most. On a CPU, bounded in time (64 MiB a
    state). On a GPU, 256 Mi parameters where a quarter of the free memory holds their
    weights, gradients, masters and moments: a rate read beyond the largest size timed is
    the last two sizes' marginal, and with 64 Mi the largest, the 1 B GPT's update was
    predicted at 12.5 ms for a measured 19.4 (H200, benchmarks/RESULTS.md, GPU section)."""
    if device.type != "cuda":
        return STREAM_CAP
    free, _ = torch.cuda.mem_get_info(device)
    return max(STREAM_CAP, min(GPU_STREAM_CAP, free // 4 // GPU_UPDATE_STATE_BYTES))


def update_chunk(device: torch.device, params: int) -> int:
    """Parameters per tensor in the timed update. On a CPU, UPDATE_CHUNK: a large weight of a
    model this size. On a GPU, a quarter of the update each: there the host launches each
    tensor's kernels while the device runs earlier ones, and the time model charges those
    per-tensor costs apart (ops.optimizer_s takes the longer of the two), so the timing must
    be the device's pass. In 1 Mi tensors it was the host's: 64 Mi bf16 parameters took 47 ps
    each where the 1 B GPT's whole update took 20 (H200, benchmarks/RESULTS.md, GPU section),
    and read beyond its sizes that rate predicted 46 ms for a 21 ms update."""
    if device.type == "cpu":
        return UPDATE_CHUNK
    return max(UPDATE_CHUNK, -(-params // GPU_UPDATE_TENSORS))


GPU_UPDATE_TENSORS = 4
GPU_STREAM_CAP = 1 << 28  # parameters in the timed update on a GPU, where memory allows
GPU_UPDATE_STATE_BYTES = 20  # a parameter's bytes there at most: 16-bit weight and grad, fp32 master, m, v
HOST_UPDATE_MIN = 1 << 22  # the host's AdamW timed on at least this many parameters: a rate, not overheads
STREAM_CAP = 1 << 24  # parameters in the timed update on a CPU (see stream_cap)
UPDATE_CHUNK = 1 << 20  # parameters per tensor there, about a large weight of a model this size


def measure_host_update(mesh: Mesh, params: int, optimizer_kernel: str, reps: int) -> float:
    """GB/s of AdamW on this host's CPU over `params` fp32 parameters, counted as the 28 bytes
    a parameter the time model charges (plait.estimate.exposed.HOST_ADAM_BYTES): the rate an
    offloaded optimizer steps at. Every rank of the node steps at once, as under offload."""
    _, optimizer = _flat_adamw(params, torch.device("cpu"), optimizer_kernel)
    keep_freed_memory()
    seconds = _slowest(mesh, [_median_s(optimizer.step, reps)])[0]
    return HOST_ADAM_BYTES * params / seconds / 1e9


def _flat_update(mesh: Mesh, params: int, optimizer_kernel: str, precision: str = "fp32",
                 chunk: int = UPDATE_CHUNK) -> Callable[[], None]:
    """The guarded update (finite check, clipping, AdamW) over `params` parameters cut into
    `chunk`-sized tensors: the optimizer states are as large as the model's, so their pass
    runs past the caches at the speed it will in training."""
    return _guarded_update(mesh, *_flat_adamw(params, mesh.device, optimizer_kernel, precision, chunk))


def _flat_adamw(params: int, device: torch.device, optimizer_kernel: str, precision: str = "fp32",
                chunk: int = UPDATE_CHUNK) -> tuple[torch.nn.ParameterList, torch.optim.Optimizer]:
    """`params` parameters on `device` in `chunk`-sized tensors of the precision's dtype,
    each with a gradient, and the AdamW (with the run's kernel; over fp32 masters for 16-bit
    weights, as plait.parallel.compose.build_optimizer builds it) that steps them."""
    from plait.parallel.masters import MasterOptimizer
    from plait.parallel.precision import param_dtype

    dtype = param_dtype(precision)
    sizes = [min(chunk, params - start) for start in range(0, params, chunk)]
    holder = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(n, device=device, dtype=dtype)) for n in sizes)
    for p in holder:
        p.grad = torch.full_like(p, 1e-3)
    kwargs = dict(lr=1e-3, weight_decay=0.1, **adamw_kernel(optimizer_kernel, device))
    if dtype == torch.float32:
        return holder, torch.optim.AdamW(holder.parameters(), **kwargs)
    return holder, MasterOptimizer([{"params": list(holder.parameters())}], torch.optim.AdamW,
                                   compiled_update=optimizer_kernel == "compiled", **kwargs)


def _gradient_checks(mesh: Mesh, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """The step guard's work before the update, minus its all-reduce, as it runs it: one
    read of the gradients for the finite check and the clipping norm, then the clipping,
    in place for fp32 weights, or as the masters' gradient scale for 16-bit ones
    (plait/parallel/precision.py: StepGuard.clip, clip.py)."""
    from plait.parallel.clip import clip_grad_norm, gradient_squares
    from plait.parallel.precision import first_nonfinite

    folds = getattr(optimizer, "grad_scale", None) is not None

    def run() -> None:
        squares = gradient_squares(model)
        first_nonfinite(model, squares)
        if folds:
            clip_grad_norm(model, math.inf, squares)
            optimizer.grad_scale = 0.5  # a clip factor that is not 1, as a clipped step has
        else:
            clip_grad_norm(model, 1.0, squares)
        _sync(mesh)

    return run


def _guarded_update(mesh: Mesh, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    checks = _gradient_checks(mesh, model, optimizer)
    return lambda: (checks(), optimizer.step(), _sync(mesh))


# A 2-block GPT so small (h = 8, 4 tokens) that its time is all fixed costs: the very op
# mix the time model counts per block (plait/estimate/ops.py), forward and backward.
DISPATCH_MODEL = GPTConfig(vocab_size=16, n_layers=2, d_model=8, n_heads=2, n_kv_heads=1,
                           ffn_hidden=16, max_seq_len=4)
GEMMS_PER_BLOCK, GEMMS_OUTER = 8 + 15, 3  # 7 GEMMs and the attention core, forward and backward
DISPATCH_OPS = sum(2 * OPS_BLOCK[b][0] + OPS_OUTER[b][0] for b in (0, 1)) + 2 * GEMMS_PER_BLOCK + GEMMS_OUTER
DISPATCH_VIEWS = sum(2 * OPS_BLOCK[b][1] + OPS_OUTER[b][1] for b in (0, 1))
DISPATCH_TENSORS = 2 * TENSORS_PER_BLOCK + 1  # tied embedding and head, final norm


def measure_dispatch(mesh: Mesh, reps: int, optimizer_kernel: str = "fused") -> tuple[float, float, float]:
    """Seconds of DISPATCH_MODEL's forward + backward (under the activation meter that
    `plait train` runs every forward in), of its AdamW step, and of its gradient checks."""
    from plait.models.gpt.model import build_gpt
    from plait.bench.meter import ActivationMeter

    meter = ActivationMeter()

    model = build_gpt(DISPATCH_MODEL, 0).to(mesh.device)
    ids = torch.randint(0, 16, (1, 4), device=mesh.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                                  **adamw_kernel(optimizer_kernel, mesh.device))

    def train() -> None:
        with meter.track(model):
            logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        _sync(mesh)

    def update() -> None:
        optimizer.step()
        _sync(mesh)

    forward_backward = _median_s(train, reps * 2)
    return forward_backward, _median_s(update, reps * 2), _median_s(_gradient_checks(mesh, model), reps * 2)


def measure_links(mesh: Mesh, large: int, reps: int
                  ) -> tuple[tuple[tuple[int, float, float], ...], tuple[tuple[str, int, float], ...]]:
    """((n, µs per ring step, GB/s busbw) of all-reduce, (op, n, GB/s busbw) of all-gather and
    reduce-scatter) on n ranks, each n: ZeRO's collectives, which Gloo on a CPU runs at a third
    to a half of its all-reduce's rate.

    The three large collectives are timed in turns, round by round (`_median_rounds`), so that
    their rates come from the same minutes: what ZeRO costs over plain data parallelism is
    their difference. Timed one op after another, a host's slow stretch landed on one of them:
    4 ranks' all-gather was calibrated at 0.40 GB/s against 0.58-0.75 in turns, and ZeRO-1 was
    priced 7.8% over plain dp 4 where it measured 2.4% over.

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
        small_t, reduce_t, gather_t, scatter_t = _slowest(mesh, [small_t, *_median_rounds(mesh, timed, reps)])
        step = small_t / (2 * (n - 1))
        wire = (n - 1) / n * elements * 4  # an all-gather's or reduce-scatter's; an all-reduce moves twice it
        links.append((n, step * 1e6, bus_rate(2 * wire, reduce_t, 2 * (n - 1) * step)))
        ops += [(op, n, bus_rate(wire, t, (n - 1) * step)) for op, t in (("all_gather", gather_t),
                                                                          ("reduce_scatter", scatter_t))]
    return tuple(links), tuple(ops)


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
    pick = tiled_axes if crowded(mesh) else first_ranks_axes
    return pick(sizes, mesh.ledger, mesh.global_rank, world)


BURST = (192, 384)  # the compute between two collectives of `in_step_s`: a (192 x 384) @ (384 x 384) product


def latency_s(mesh: Mesh, op: Callable[[], Any], reps: int) -> float:
    """Seconds of a tiny collective or message `op`: back to back on a GPU (the median), on a
    host that runs its own collectives between bursts of compute (`in_step_s`, the mean)."""
    return _median_s(op, reps * 4) if mesh.device.type == "cuda" else in_step_s(op, reps * 40)


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
        _in_step(mesh)
        start = time.monotonic()
        for _ in range(k):
            a @ b
            if synced and axis is not None:
                comm.all_reduce(tiny, axis, purpose=comm.TELEMETRY)
        _in_step(mesh)
        return time.monotonic() - start

    once = _slowest(mesh, [loop(2, True) / 2])[0]
    k = max(LAG_BURSTS, min(1000, math.ceil(loop_s / max(once, 1e-6))))
    plain, synced = [], []
    for _ in range(reps):
        plain.append(loop(k, False))
        synced.append(loop(k, True))
    added = statistics.median(synced) - statistics.median(plain) if axis is not None else 0.0
    plain_s, added_s = _slowest(mesh, [statistics.median(plain), added])
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
    return _slowest(mesh, [taken])[0] * 1e6
