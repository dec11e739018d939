"""`plait calibrate`: measure this machine for the time model, on every rank at once.

What the model of plait/estimate/ops.py needs, measured the way training will use it (all
local ranks busy at the same time, each on its share of the cores):
* the TFLOP/s of every GEMM the model runs (forward and both backward shapes), in its dtype,
  and of its attention core (forward + backward);
* memory bandwidth at the size of one activation (b·s·h), the rate of the guarded update
  (finite check, clipping, AdamW) at the model's size, and the fixed costs of an op, a view,
  an optimizer tensor and a gradient check;
* the loop's own cost per step (walking the model's states for the report);
* per group size of the first n ranks: a ring step's latency (an 8-byte all-reduce) and the
  bus bandwidth of a large all-reduce.
Each timing is the median of several runs; across ranks the slowest counts.
"""

from __future__ import annotations

import ctypes
import statistics
import time
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
    head_gemm,
)
from plait.estimate.time import HOST_ADAM_BYTES
from plait.models.gpt.config import GPTConfig
from plait.runtime import comm
from plait.runtime.mesh import Mesh
from plait.runtime.subgroups import first_ranks_axes, group_sizes
from plait.bench.meter import storage_bytes
from plait.parallel.compose import adamw_kernel

# Raised whenever what is measured, or how, changes: machine.py keys its cache on it.
# 2: the update (norm, clipping, AdamW) timed at the model's size; per-piece check costs.
# 3: the host's AdamW (host_mem_gb_s, for offload) measured, on at least HOST_UPDATE_MIN parameters.
METHOD_VERSION = 3


def _median_s(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up: allocations, kernel selection
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median_rounds(mesh: Mesh, fns: list[Callable[[], Any]], rounds: int) -> list[float]:
    """Median seconds of each of `fns` over `rounds` passes through all of them, ranks in step.

    Interleaving (rather than one shape's repetitions back to back) spreads a passing
    disturbance over every shape instead of moving one shape's rate; a barrier before each
    timing keeps the ranks on the same shape at the same moment, as training does, where
    they share the caches and the memory bus."""
    for fn in fns:
        fn()  # warm-up: allocations, kernel selection
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, seen in zip(fns, times):
            _in_step(mesh)
            start = time.perf_counter()
            fn()
            seen.append(time.perf_counter() - start)
    return [statistics.median(seen) for seen in times]


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
                 precision: str) -> tuple[list[str], dict[str, Gemm]]:
    """Attention keys and {key: Gemm} of every GEMM the model runs, for each tp degree."""
    tokens = micro_batch * seq_len
    gemms: dict[str, Gemm] = {}
    attention = []
    for tp in tp_sizes:
        forward = [*block_gemms(config, tokens, tp), head_gemm(config, tokens, tp)]
        for g in forward + [x for g in forward for x in g.backward()]:
            gemms[gemm_key(g, precision)] = g
        attention.append(attention_key(config, micro_batch, seq_len, tp, precision))
    return sorted(set(attention)), gemms


def _dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def measure_gemms(mesh: Mesh, gemms: dict[str, Gemm], precision: str, reps: int) -> dict[str, float]:
    """{key: TFLOP/s} of each GEMM shape, slowest rank."""
    dtype, device = _dtype(precision), mesh.device

    def gemm(g: Gemm) -> Callable[[], Any]:
        a = torch.randn(g.m, g.k, dtype=dtype, device=device)
        b = torch.randn(g.k, g.n, dtype=dtype, device=device)
        return lambda: (torch.mm(a, b), _sync(mesh))

    times = _slowest(mesh, _median_rounds(mesh, [gemm(g) for g in gemms.values()], reps))
    return {key: g.flops / t / 1e12 for (key, g), t in zip(gemms.items(), times)}


def measure_attention(mesh: Mesh, config: GPTConfig, micro_batch: int, seq_len: int,
                      tp_sizes: list[int], precision: str, reps: int) -> dict[str, float]:
    """{key: TFLOP/s} of causal scaled-dot-product attention, forward + backward, counted as
    3 · 4·b·s²·h/t FLOPs (the model's convention: no discount for the mask)."""
    out, runs, flops = {}, [], []
    for tp in sorted(set(tp_sizes)):
        heads = max(1, config.n_heads // tp)
        shape = (micro_batch, heads, seq_len, config.head_dim)
        runs.append(_attention_run(mesh, shape, precision))
        flops.append(3 * 4.0 * micro_batch * seq_len * seq_len * heads * config.head_dim)
        out[attention_key(config, micro_batch, seq_len, tp, precision)] = 0.0
    times = _median_rounds(mesh, runs, reps)
    for key, f, t in zip(list(out), flops, _slowest(mesh, times)):
        out[key] = f / t / 1e12
    return out


def _attention_run(mesh: Mesh, shape: tuple[int, ...], precision: str) -> Callable[[], None]:
    q, k, v = (torch.randn(shape, dtype=_dtype(precision), device=mesh.device, requires_grad=True) for _ in range(3))

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        _sync(mesh)

    return run


def measure_memory(mesh: Mesh, elements: int, tensors: int, reps: int, params: int = 0,
                   optimizer_kernel: str = "fused") -> dict[str, float]:
    """Bandwidth of an allocating add on `elements` floats (an activation's size) and of the
    guarded update over `params` parameters (its rate in the bytes the time model counts);
    the loop's walk over `tensors` parameter-like tensors (its per-step bookkeeping); and
    the fixed costs of ops, views, optimizer tensors and gradient checks (`measure_dispatch`).
    The updates run AdamW with the kernel the run will (plait.parallel.compose.adamw_kernel)."""
    device = mesh.device
    x, y = (torch.randn(elements, device=device) for _ in range(2))
    many = [torch.ones(4, device=device) for _ in range(3 * tensors)]
    add = _median_s(lambda: (torch.add(x, y), _sync(mesh)), reps)  # allocating, as eager ops do
    walk = _median_s(lambda: storage_bytes(many), reps)
    one = torch.ones(1, device=device)
    view = _median_s(lambda: [one.view(-1) for _ in range(100)], reps) / 100
    block, step, checks = measure_dispatch(mesh, reps, optimizer_kernel)
    streamed = min(params, STREAM_CAP)
    if device.type == "cpu":
        keep_heap_like_training()
    update = _median_s(_flat_update(mesh, streamed, optimizer_kernel), reps) if streamed else 0.0
    add, walk, view, block, step, checks, update = _slowest(mesh, [add, walk, view, block, step, checks, update])
    op = max(0.0, block - view * DISPATCH_VIEWS) / DISPATCH_OPS
    per_tensor = (step + checks) / DISPATCH_TENSORS
    pieces = -(-streamed // UPDATE_CHUNK)
    net = max(update - pieces * per_tensor, 1e-9)
    stream = {"stream_gb_s": UPDATE_BYTES * streamed / net / 1e9} if streamed else {}
    return {**stream, "memory_gb_s": 3 * elements * 4 / add / 1e9, "op_overhead_us": op * 1e6,
            "view_overhead_us": view * 1e6, "step_overhead_us": walk * 1e6,
            "optimizer_tensor_us": step / DISPATCH_TENSORS * 1e6, "grad_tensor_us": checks / DISPATCH_TENSORS * 1e6}


HOST_UPDATE_MIN = 1 << 22  # the host's AdamW timed on at least this many parameters: a rate, not overheads
STREAM_CAP = 1 << 24  # parameters in the timed update (64 MiB each state): past any cache, bounded
UPDATE_CHUNK = 1 << 20  # parameters per tensor there, about a large weight of a model this size


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_heap_like_training() -> None:
    """Let glibc keep freed memory, as it ends up doing in a training process.

    There, activations of several MiB are freed every step, which raises glibc's dynamic
    mmap and trim thresholds: the update's temporaries then reuse the heap. A fresh
    calibration process has not seen that, so it hands the temporaries back to the OS and
    faults them in again each time, which ran this update 2-4x slower than training does
    (measured on the 2-core CPU: 100-200 ms against 41-56 ms for `small`). Setting the two
    thresholds as training leaves them removes that difference. A no-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    except (OSError, AttributeError):
        pass


def measure_host_update(mesh: Mesh, params: int, optimizer_kernel: str, reps: int) -> float:
    """GB/s of AdamW on this host's CPU over `params` fp32 parameters, counted as the 28 bytes
    a parameter the time model charges (plait.estimate.time.HOST_ADAM_BYTES): the rate an
    offloaded optimizer steps at. Every rank of the node steps at once, as under offload."""
    _, optimizer = _flat_adamw(params, torch.device("cpu"), optimizer_kernel)
    keep_heap_like_training()
    seconds = _slowest(mesh, [_median_s(optimizer.step, reps)])[0]
    return HOST_ADAM_BYTES * params / seconds / 1e9


def _flat_update(mesh: Mesh, params: int, optimizer_kernel: str) -> Callable[[], None]:
    """The guarded update (finite check, clipping, AdamW) over `params` parameters cut into
    UPDATE_CHUNK-sized tensors: the optimizer states are as large as the model's, so their
    pass runs past the caches at the speed it will in training."""
    return _guarded_update(mesh, *_flat_adamw(params, mesh.device, optimizer_kernel))


def _flat_adamw(params: int, device: torch.device, optimizer_kernel: str) -> tuple[torch.nn.ParameterList,
                                                                                  torch.optim.AdamW]:
    """`params` parameters on `device` in UPDATE_CHUNK-sized tensors, each with a gradient,
    and the AdamW (with the run's kernel) that steps them: what the timed updates run."""
    sizes = [min(UPDATE_CHUNK, params - start) for start in range(0, params, UPDATE_CHUNK)]
    holder = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(n, device=device)) for n in sizes)
    for p in holder:
        p.grad = torch.full_like(p, 1e-3)
    return holder, torch.optim.AdamW(holder.parameters(), lr=1e-3, weight_decay=0.1,
                                     **adamw_kernel(optimizer_kernel, device))


def _gradient_checks(mesh: Mesh, model: torch.nn.Module) -> Callable[[], None]:
    """The step guard's work before the update, minus its all-reduce, as it runs it: one
    read of the gradients for the finite check and the clipping norm, then the clipping
    (plait/parallel/precision.py, clip.py)."""
    from plait.parallel.clip import clip_grad_norm, gradient_squares
    from plait.parallel.precision import first_nonfinite

    def run() -> None:
        squares = gradient_squares(model)
        first_nonfinite(model, squares)
        clip_grad_norm(model, 1.0, squares)
        _sync(mesh)

    return run


def _guarded_update(mesh: Mesh, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    checks = _gradient_checks(mesh, model)
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


def measure_links(mesh: Mesh, large: int, reps: int) -> tuple[tuple[int, float, float], ...]:
    """(n, µs per ring step, GB/s busbw) of all-reduce on the first n ranks, each n."""
    world = mesh.env.world_size
    axes = first_ranks_axes(group_sizes(world), mesh.ledger, mesh.global_rank, world)
    rows = []
    for n, axis in axes.items():
        small_t = large_t = 0.0
        if axis is not None:
            tiny = torch.zeros(2, dtype=torch.float32, device=mesh.device)
            big = torch.zeros(large // 4, dtype=torch.float32, device=mesh.device)
            small_t = _median_s(lambda: comm.all_reduce(tiny, axis, purpose=comm.TELEMETRY), reps * 4)
            large_t = _median_s(lambda: comm.all_reduce(big, axis, purpose=comm.TELEMETRY), reps)
        small_t, large_t = _slowest(mesh, [small_t, large_t])
        step = small_t / (2 * (n - 1))
        wire = 2 * (n - 1) / n * large
        rows.append((n, step * 1e6, wire / max(large_t - 2 * (n - 1) * step, 1e-9) / 1e9))
    return tuple(rows)
