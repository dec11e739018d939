"""This machine's hardware profile: calibrate it, cache it, and hand it to the time model.

A calibration is cached per machine (host, CPU, GPU, torch version, and how many ranks share
it, which decides each rank's cores) and per version of the calibration method, in the
user's cache directory ($PLAIT_CACHE_DIR, else $XDG_CACHE_HOME/plait, else ~/.cache/plait).
`plait train` reads it for its closing prediction; when there is none it calibrates quickly
(a second or two) and caches that; when the cached one lacks this model's GEMM shapes it
measures just those and adds them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from plait.bench import calibrate as cal
from plait.bench import comm_timing, pace, timing
from plait.estimate.hardware import Hardware, get_hardware, hardware_toml, load_hardware
from plait.estimate.ops import Gemm, activation_op_bytes, fit_gemm_line, gemm_key, outer_precision
from plait.models.gpt.config import GPTConfig
from plait.runtime import comm
from plait.runtime.env import cache_root
from plait.runtime.mesh import Mesh


def device_name(mesh: Mesh) -> str:
    if mesh.device.type == "cuda":
        return torch.cuda.get_device_name(mesh.device)
    return "cpu"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts(mesh: Mesh, optimizer_kernel: str = "fused", precision: str = "fp32") -> dict[str, str]:
    """What a calibration depends on, the method's version, the AdamW kernel and the
    precision it timed included: a cache taken by an older method (fewer fields, other
    definitions), for another kernel or for another precision's update is not read."""
    local = os.environ.get("LOCAL_WORLD_SIZE", str(mesh.env.world_size))
    return {"host": socket.gethostname(), "cpu": cpu_name(), "gpu": device_name(mesh),
            "torch": torch.__version__, "local_ranks": local, "threads": str(torch.get_num_threads()),
            "method": str(cal.METHOD_VERSION), "optimizer": optimizer_kernel, "precision": precision}


def cache_path(facts: dict[str, str]) -> Path:
    key = hashlib.sha256("|".join(f"{k}={facts[k]}" for k in sorted(facts)).encode()).hexdigest()[:16]
    return cache_root() / f"hardware-{key}.toml"


def base_preset(gpu: str) -> Hardware:
    """The preset whose datasheet numbers fill what a calibration does not measure."""
    name = gpu.lower()
    for key, preset in (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
                        ("a100-sxm4-40", "a100-40gb"), ("a100", "a100-80gb"), ("v100", "v100"),
                        ("4090", "rtx4090"), ("3090", "rtx3090")):
        if key in name:
            return get_hardware(preset)
    return get_hardware("cpu")


def calibrate(mesh: Mesh, config: GPTConfig, *, micro_batch: int, seq_len: int, tp_sizes: list[int],
              precision: str, quick: bool = False, optimizer_kernel: str = "fused",
              cp_sizes: list[int] = (), other_micro_batches: Sequence[int] = (),
              data_parallel_only: bool = False) -> Hardware:
    """Measure everything the time model uses (ring attention's compute at each cp in
    `cp_sizes`); every rank calls this. The GEMMs and attention are timed at `micro_batch`
    and at each of `other_micro_batches`, so that a plan weighing several micro-batches reads
    each one's shapes as measured rather than off a line fitted to another's.

    `data_parallel_only`: the layouts this calibration will price split no model (data
    parallelism and ZeRO alone). The ranks' lag, which only tp, cp and ep collectives pay,
    and the send/recv latency of pipeline messages and ring attention's steps are then not
    timed (priced as none: 13 s of a full calibration's 19-20 s on 2 CPU ranks, the lag's
    loops 12 s of it whatever the host's pace); what such a layout is priced at is unchanged."""
    reps = 3 if quick else 11  # rounds: a full calibration spreads over enough time to ride out a slow second
    attention, gemms = cal.model_shapes(config, micro_batch, seq_len, tp_sizes, precision, cp_sizes,
                                        other_micro_batches)
    rates = cal.measure_gemms(mesh, gemms, precision, reps)
    rates.update(cal.measure_attention(mesh, config, micro_batch, seq_len, tp_sizes, precision, reps, cp_sizes,
                                       other_micro_batches))
    activation = int(activation_op_bytes(config.d_model, micro_batch * seq_len, 1, False, precision)) // 4
    memory = cal.measure_memory(mesh, activation, 9 * config.n_layers + 3, reps,
                                params=config.num_params(), optimizer_kernel=optimizer_kernel,
                                precision=precision)
    host_params = max(min(config.num_params(), cal.STREAM_CAP), cal.HOST_UPDATE_MIN)
    memory["host_mem_gb_s"] = cal.measure_host_update(mesh, host_params, optimizer_kernel, reps)
    links, op_links = comm_timing.measure_links(mesh, (2 if quick else 16) * 2**20, reps) if mesh.env.world_size > 1 \
        else ((), ())
    splits = bool(links) and not data_parallel_only  # the lag and send/recv price tp, cp, ep and pp alone
    p2p_us = comm_timing.measure_p2p(mesh, reps) if splits else 0.0
    lags = comm_timing.measure_lags(mesh, 4) if splits and not quick else ()  # a quick calibration prices no lag
    facts = machine_facts(mesh, optimizer_kernel, precision)
    base = base_preset(facts["gpu"])
    fields: dict[str, object] = {
        "name": f"calibrated {facts['host']}", "compute_efficiency": 1.0, "gemm": tuple(sorted(rates.items())),
        "links": links, "op_links": op_links, "lags": lags, "p2p_latency_us": p2p_us, **memory, **gemm_line(rates, precision, memory["op_overhead_us"], mesh.device.type, base)}
    if attention:
        fields.update(attention_efficiency(rates.get(attention[0], 0.0), fields, precision))
    if links:
        n, latency, gb_s = links[-1]
        fields.update(intra_node_latency_us=latency, intra_node_gb_s=gb_s)
    fields["queues_kernels"] = mesh.device.type == "cuda"
    if mesh.device.type == "cpu":
        batches = sorted({micro_batch, *other_micro_batches})
        lone = tuple((mb, pace.measure_lone_speedup(mesh, config, mb, seq_len)) for mb in batches) \
            if splits and not quick and timing.crowded(mesh) else ()  # pipelines alone read it
        # ZB-H1's alone; never under 1: the split does all of a whole backward's work
        split = tuple((mb, max(1.0, pace.measure_split_backward(mesh, config, mb, seq_len, precision)))
                      for mb in batches) if splits and not quick else ()
        fields.update(pcie_gb_s=memory["memory_gb_s"], crowding=timing.crowding(mesh), lone_by_micro_batch=lone,
                      split_by_micro_batch=split,
                      gpus_per_node=max(base.gpus_per_node, mesh.env.world_size))
        if links:
            fields.update(inter_node_latency_us=links[-1][1], inter_node_gb_s=links[-1][2])
    return replace(base, **fields)


def gemm_line(rates: dict[str, float], precision: str, op_overhead_us: float, device: str,
              base: Hardware) -> dict[str, float]:
    """The peak and fixed cost that price a GEMM shape the calibration did not measure: the
    line through the measured ones (plait.estimate.ops.fit_gemm_line), on a GPU never above
    the device's datasheet peak. On a CPU the measured times hold each op's dispatch, which
    ops.gemm_s adds on its own; on a GPU the queued timings do not. Where no line can be
    trusted (the shapes all of a size), a GPU keeps its preset's rate and ramp and a CPU
    (whose rate changes little with size) the best rate measured.

    fp8 has two lines: its blocks' float8 products give the float8 peak, and the 16-bit
    GEMMs it leaves (the head) the 16-bit peak and the ramp."""
    fields = _gemm_line(rates, outer_precision(precision), op_overhead_us, device, base)
    if precision == "fp8":
        float8 = _gemm_line(rates, "fp8", op_overhead_us, device, base)
        fields["peak_fp8_tflops"] = float8.pop(peak_field("fp8"))
    return fields


def _gemm_line(rates: dict[str, float], precision: str, op_overhead_us: float, device: str,
               base: Hardware) -> dict[str, float]:
    """gemm_line for the GEMMs keyed in one `precision`."""
    dtype = gemm_key(Gemm(1, 1, 1), precision).split()[0]  # how its GEMMs are keyed: fp32, bf16 or fp8
    mine = {k: r for k, r in rates.items() if k.split()[0] == dtype}
    field = peak_field(precision)
    line = fit_gemm_line(mine)
    if line is None:
        if device == "cpu":
            return {field: max(mine.values(), default=getattr(base, field)), "gemm_fixed_us": 0.0}
        return {field: base.peak_flops(precision) / 1e12 * base.compute_efficiency, "gemm_fixed_us": base.gemm_fixed_us}
    tflops, fixed_us = line
    if device == "cpu":
        return {field: tflops, "gemm_fixed_us": max(0.0, fixed_us - op_overhead_us)}
    return {field: min(tflops, base.peak_flops(precision) / 1e12), "gemm_fixed_us": fixed_us}


def attention_efficiency(rate: float, line: dict[str, object], precision: str) -> dict[str, float]:
    """{"attention_efficiency": the attention core's measured TFLOP/s over the 16-bit (or fp32)
    peak of `line` (gemm_line's fields): attention runs outside fp8. {} without a rate."""
    peak = line[peak_field(outer_precision(precision))]
    return {"attention_efficiency": min(1.0, rate / peak)} if rate and peak else {}


def peak_field(precision: str) -> str:
    """The Hardware field a calibration's measured peak goes to: fp32's, float8's, or the
    16-bit one."""
    return {"fp32": "peak_fp32_tflops", "fp8": "peak_fp8_tflops"}.get(precision, "peak_bf16_tflops")


def save(hw: Hardware, path: Path, facts: dict[str, str]) -> None:
    """Write atomically: several runs may calibrate the same machine at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(hardware_toml(hw, {"plait calibration of": ", ".join(f"{k} {v}" for k, v in facts.items())}))
    os.replace(scratch, path)


def machine_hardware(mesh: Mesh, config: GPTConfig, *, micro_batch: int, seq_len: int, tp: int,
                     precision: str, optimizer_kernel: str = "fused") -> tuple[Hardware, str]:
    """This machine's profile for the closing prediction, and where it came from.

    A cached calibration is read for what it measured at this run's sizes: the GEMM and
    attention shapes, an activation's bytes and the update's parameters. What it lacks is
    measured now and added to the cache, so that a calibration taken on a small model is
    never stretched over a large one."""
    facts = machine_facts(mesh, optimizer_kernel, precision)
    path = cache_path(facts)
    cached = _load_or_none(path)
    layout = mesh.layout
    rings = [layout.cp] if layout.cp > 1 and layout.cp_kind == "ring" else []  # its ring's compute, measured
    attention, gemms = cal.model_shapes(config, micro_batch, seq_len, [tp], precision, rings)
    # The sizes the time model will read, keyed as it reads them (ops.elementwise_s, ops.optimizer_s):
    # one activation's write on this rank, and the parameters this rank updates.
    op_bytes = activation_op_bytes(config.d_model, micro_batch * seq_len // layout.cp, tp, layout.sp, precision)
    owned = config.num_params() // (tp * layout.pp) // (layout.zero_ranks if layout.zero else 1)
    streamed = min(max(owned, 1), cal.stream_cap(mesh.device))
    lacks = _lacks(cached, gemms, attention, op_bytes, streamed)
    need = torch.tensor([float(cached is None), *map(float, lacks)], device=mesh.device)
    comm.all_reduce(need, mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    timing.SPREADS.seen.clear()
    if need[0].item():
        hw = calibrate(mesh, config, micro_batch=micro_batch, seq_len=seq_len, tp_sizes=[tp],
                       precision=precision, quick=True, optimizer_kernel=optimizer_kernel, cp_sizes=rings)
        source = f"quick calibration, cached in {path}"
    elif need[1:].any().item():
        hw = _add_sizes(mesh, cached, config, [bool(x) for x in need[1:].tolist()], gemms,
                        (micro_batch, seq_len, tp, precision), max(1, int(op_bytes) // 4), streamed, optimizer_kernel,
                        rings)
        source = f"cached calibration {path} (+ what it lacked at this model's sizes)"
    else:
        return cached, f"cached calibration {path}"
    busy = noisy(mesh)
    if busy:
        return hw, f"a NOISY calibration ({busy}), not cached: the prediction rests on a busy machine's timings"
    if mesh.is_main:
        save(hw, path, facts)
    return hw, source


NOISY_SPREAD = 0.5  # a timing whose repeats differ by half its median: something else ran


def noisy(mesh: Mesh) -> str | None:
    """Why the calibration just taken cannot be trusted, or None: the repeats of one of its
    timings (a millisecond or more) disagreed by more than NOISY_SPREAD of their median, on
    any rank (collective). The timings themselves are the evidence: a load average lags by a
    minute and counts this job's own ranks."""
    worst = torch.tensor([timing.SPREADS.worst()], dtype=torch.float64, device=mesh.device)
    comm.all_reduce(worst, mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    spread = worst.item()
    return f"repeats of one timing {spread:.0%} apart" if spread > NOISY_SPREAD else None


def _near(table: tuple[tuple[int, float], ...], size: int) -> bool:
    """A size measured within a factor of two of `size`: close enough to interpolate from."""
    return any(size / 2 <= row[0] <= size * 2 for row in table)


def _lacks(cached: Hardware | None, gemms: dict[str, object], attention: list[str], activation_bytes: int,
           streamed: int) -> tuple[bool, bool, bool]:
    """What a cached profile has not measured for this run: (GEMM or attention shapes, an
    activation's bandwidth, the update's rate)."""
    if cached is None:
        return True, True, True
    shapes = any(not cached.gemm_tflops(k) for k in [*gemms, *attention])
    return shapes, not _near(cached.memory_by_size, activation_bytes), bool(streamed) and not _near(
        cached.stream_by_size, streamed)


def _add_sizes(mesh: Mesh, cached: Hardware, config: GPTConfig, lacks: list[bool], gemms: dict[str, object],
               shape: tuple[int, int, int, str], activation: int, streamed: int, optimizer_kernel: str,
               rings: list[int]) -> Hardware:
    """`cached` with what it lacked measured and merged in by key (every rank calls this; a
    size this rank had is replaced, not written twice)."""
    micro_batch, seq_len, tp, precision = shape
    add: dict[str, object] = {}
    if lacks[0]:
        attention = cal.measure_attention(mesh, config, micro_batch, seq_len, [tp], precision, 3, rings)
        rates = {**dict(cached.gemm), **cal.measure_gemms(mesh, gemms, precision, 3), **attention}
        add["gemm"] = tuple(sorted(rates.items()))
        add.update(gemm_line(rates, precision, cached.op_overhead_us, mesh.device.type,
                             base_preset(device_name(mesh))))
        add.update(attention_efficiency(next(iter(attention.values()), 0.0), add, precision))
    if lacks[1]:
        measured = cal.measure_bandwidth(mesh, cal.add_sizes(activation), cal.BANDWIDTH_ROUNDS,
                                         cached.op_overhead_us * 1e-6)
        add["memory_by_size"] = _merged(cached.memory_by_size, measured)
    if lacks[2]:
        rate = cal.measure_stream(mesh, streamed, optimizer_kernel, 3, precision)
        add["stream_by_size"] = _merged(cached.stream_by_size, ((streamed, rate),))
    return replace(cached, **add)


def _merged(table: tuple[tuple[int, float], ...], rows: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """`table` with `rows` in it, one row per size (a new measurement replaces an old one)."""
    return tuple(sorted({**dict(table), **dict(rows)}.items()))


def _load_or_none(path: Path) -> Hardware | None:
    try:
        return load_hardware(path) if path.exists() else None
    except Exception:  # noqa: BLE001 - a damaged cache is recalibrated, never fatal
        return None
