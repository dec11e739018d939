"""`plait calibrate`: measure this machine for the time model, on every rank at once.

What the model of plait/estimate/ops.py needs, measured the way training will use it (all
local ranks busy at the same time, each on its share of the cores):
* the TFLOP/s of every GEMM the model runs (forward and both backward shapes), in its dtype,
  and of its attention core (forward + backward);
* memory bandwidth at the size of one activation (b·s·h), the rate of the guarded update
  (finite check, clipping, AdamW) at the model's size, and the fixed costs of an op, a view,
  an optimizer tensor and a gradient check;
* the loop's own cost per step (walking the model's states for the report).
Each timing is the median of several runs; across ranks the slowest counts; on a crowded host
(more ranks' threads than cores) a compute timing spans every rank's run (timing.py). The
links and the ranks' lag are comm_timing.py's; a crowded host's pipeline pace, pace.py's;
machine.py calls them all and keeps the profile.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
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
from plait.models.gpt.model import causal_attention
from plait.rules import FLOAT8_TILE
from plait.runtime.env import keep_freed_memory
from plait.runtime.mesh import Mesh
from plait.bench import timing
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
# 21: the large collectives' first rounds untimed; on a crowded host a compute timing's bursts counted
#     from CPU time and 40 ms long, and each GEMM's second operand read cold (`ColdOperands`).
# 22: on a host that is not crowded the large collectives timed over three times the rounds.
# 23: attention timed as the model calls it, its grouped K/V heads unexpanded (it had every query head's).
METHOD_VERSION = 23




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


def dtype_of(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def measure_gemms(mesh: Mesh, gemms: dict[str, Gemm], precision: str, reps: int) -> dict[str, float]:
    """{key: TFLOP/s} of each GEMM shape, slowest rank, in the dtype its key names: fp32,
    bf16, or fp8 (a float8 product, as --precision fp8 runs the blocks' linears)."""
    device = mesh.device

    cold = ColdOperands(device) if timing.crowded(mesh) else None  # crowded: a CPU host

    def gemm(key: str, g: Gemm) -> Callable[[], None]:
        dtype_name = key.split()[0]
        if dtype_name == "fp8" and g.k % FLOAT8_TILE == 0 and g.n % FLOAT8_TILE == 0:
            return _queued(mesh, float8_product(g, device))
        dtype = dtype_of(dtype_name)  # fp8 shapes off the float8 tiles stay bf16, as fp8 leaves those linears
        a = torch.randn(g.m, g.k, dtype=dtype, device=device)
        if cold is not None:
            weights = cold.cycle(g.k, g.n, dtype)
            return _queued(mesh, lambda: torch.mm(a, next(weights)))
        b = torch.randn(g.k, g.n, dtype=dtype, device=device)
        return _queued(mesh, lambda: torch.mm(a, b))

    times = timing.slowest(mesh, timing.median_rounds(mesh, [gemm(k, g) for k, g in gemms.items()], reps, watched=True))
    return {key: queue_depth(device) * g.flops / t / 1e12 for (key, g), t in zip(gemms.items(), times)}


COLD_POOL_BYTES = 64 << 20  # each dtype's pool: 16 times a core's 4 MiB L2 on the 2-core host measured


class ColdOperands:
    """Second operands a GEMM timing reads in turn from one pool of COLD_POOL_BYTES, so that each
    run finds its weight out of the caches, as training does: between one micro-batch's use
    of a layer's weights and the next, the other layers' weights and activations, and on a
    crowded host the other ranks sharing the core, pass through them.

    Timed with its weight resident, as a burst of one product leaves it, a crowded host's
    GEMMs priced `small`'s two micro-batches of 4 sequences 3-5% over one of 8, in five
    planner checks on 4 ranks sharing 2 cores, where they measured 4.6-8.3% over; training's
    forward at 4 took 3.3-4.9% more a sequence than at 8 (one process, one thread). Read
    cold, the products at 4 sequences come 1.8-3.1% a sequence dearer against those at 8
    than resident, in one world timing both twice.
    Only where `crowded`: on 2 ranks with a core each, a profile of training measured 0.6%
    between the two, which the resident timing gives (`timing._resident`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pools: dict[torch.dtype, torch.Tensor] = {}

    def cycle(self, rows: int, cols: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """Endless (rows, cols) views of `dtype`'s pool, one after another through it (a
        tensor of its own where one is larger than the pool: no cache holds it)."""
        pool = self.pools.get(dtype)
        if pool is None:
            pool = self.pools[dtype] = torch.randn(COLD_POOL_BYTES // torch.finfo(dtype).bits * 8,
                                                   device=self.device).to(dtype)
        size = rows * cols
        views = [pool[start:start + size].view(rows, cols) for start in range(0, pool.numel() - size + 1, size)]
        return itertools.cycle(views or [torch.randn(rows, cols, device=self.device).to(dtype)])


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
        timing.device_sync(mesh)

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
            runs.append(_attention_run(mesh, (batch, *shape[1:]), precision, kv_heads))
            flops.append(3 * 4.0 * batch * seq_len * seq_len * heads * config.head_dim)
            out[attention_key(config, batch, seq_len, tp, precision)] = 0.0
        for cp in sorted({cp for cp in cp_sizes if cp > 1 and seq_len % (2 * cp) == 0}):
            runs.append(_ring_run(mesh, shape, kv_heads, cp, precision))
            flops.append(3 * 4.0 * micro_batch * (seq_len // cp) * seq_len * heads * config.head_dim)
            out[ring_key(config, seq_len, tp, cp, precision)] = 0.0
    times = timing.median_rounds(mesh, runs, reps, watched=True)
    for key, f, t in zip(list(out), flops, timing.slowest(mesh, times)):
        out[key] = queue_depth(mesh.device) * f / t / 1e12
    return out


def _attention_run(mesh: Mesh, shape: tuple[int, ...], precision: str,
                   kv_heads: int | None = None) -> Callable[[], None]:
    """Forward + backward passes of the causal attention core as the model calls it
    (`causal_attention`): `kv_heads` grouped K/V heads, unexpanded (every query head's own
    where None), queued (`_queued`).

    Timed with K and V at every query head, `small`'s attention (6 query heads, 2 K/V) read
    11% dearer than the grouped call it runs (4 ranks on 2 cores, six timings in one world;
    18% one thread alone), and its 4 sequences 1.3% cheaper a sequence than its 8 (one thread
    alone 10%), where the grouped call reads them 0.6% dearer (one thread: 0.8% cheaper). So
    a crowded host priced a pipeline's two micro-batches of 4 against one of 8 with attention
    1.5-6% cheaper a sequence, which a profile of training did not show (3.8% dearer, on 2
    ranks)."""
    batch, heads, seq, head_dim = shape
    dtype, device = dtype_of(precision), mesh.device
    q = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    grouped = (batch, heads if kv_heads is None else kv_heads, seq, head_dim)
    k, v = (torch.randn(grouped, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    return _queued(mesh, lambda: causal_attention(q, k, v).sum().backward())


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
    dtype, device = dtype_of(precision), mesh.device
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
    walk = timing.median_s(lambda: storage_bytes(many), reps)
    one = torch.ones(1, device=device)
    view = timing.median_s(lambda: [one.view(-1) for _ in range(100)], reps) / 100
    block, step, checks = measure_dispatch(mesh, reps, optimizer_kernel)
    walk, view, block, step, checks = timing.slowest(mesh, [walk, view, block, step, checks])
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
    times = timing.slowest(mesh, timing.median_rounds(mesh, [adds(n) for n in sizes], reps, computes=True))
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
    update = timing.slowest(mesh, [timing.median_s(_flat_update(mesh, params, optimizer_kernel, precision, chunk), reps)])[0]
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
    seconds = timing.slowest(mesh, [timing.median_s(optimizer.step, reps)])[0]
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
        timing.device_sync(mesh)

    return run


def _guarded_update(mesh: Mesh, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    checks = _gradient_checks(mesh, model, optimizer)
    return lambda: (checks(), optimizer.step(), timing.device_sync(mesh))


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
        timing.device_sync(mesh)

    def update() -> None:
        optimizer.step()
        timing.device_sync(mesh)

    forward_backward = timing.median_s(train, reps * 2)
    return forward_backward, timing.median_s(update, reps * 2), timing.median_s(_gradient_checks(mesh, model), reps * 2)
