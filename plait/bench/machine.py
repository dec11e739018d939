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
from dataclasses import replace
from pathlib import Path

import torch

from plait.bench import calibrate as cal
from plait.estimate.hardware import Hardware, get_hardware, hardware_toml, load_hardware
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


def machine_facts(mesh: Mesh, optimizer_kernel: str = "fused") -> dict[str, str]:
    """What a calibration depends on, the method's version and the AdamW kernel it timed
    included: a cache taken by an older method (fewer fields, other definitions) or for
    another kernel is not read."""
    local = os.environ.get("LOCAL_WORLD_SIZE", str(mesh.env.world_size))
    return {"host": socket.gethostname(), "cpu": cpu_name(), "gpu": device_name(mesh),
            "torch": torch.__version__, "local_ranks": local, "threads": str(torch.get_num_threads()),
            "method": str(cal.METHOD_VERSION), "optimizer": optimizer_kernel}


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
              precision: str, quick: bool = False, optimizer_kernel: str = "fused") -> Hardware:
    """Measure everything the time model uses; every rank calls this."""
    reps = 3 if quick else 11  # rounds: a full calibration spreads over enough time to ride out a slow second
    attention, gemms = cal.model_shapes(config, micro_batch, seq_len, tp_sizes, precision)
    rates = cal.measure_gemms(mesh, gemms, precision, reps)
    rates.update(cal.measure_attention(mesh, config, micro_batch, seq_len, tp_sizes, precision, reps))
    memory = cal.measure_memory(mesh, micro_batch * seq_len * config.d_model, 9 * config.n_layers + 3, reps,
                                params=config.num_params(), optimizer_kernel=optimizer_kernel)
    host_params = max(min(config.num_params(), cal.STREAM_CAP), cal.HOST_UPDATE_MIN)
    memory["host_mem_gb_s"] = cal.measure_host_update(mesh, host_params, optimizer_kernel, reps)
    links = cal.measure_links(mesh, (2 if quick else 16) * 2**20, reps) if mesh.env.world_size > 1 else ()
    facts = machine_facts(mesh, optimizer_kernel)
    base = base_preset(facts["gpu"])
    peak = max((r for k, r in rates.items() if not k.startswith("attn")), default=0.0)
    peak_field = "peak_fp32_tflops" if precision == "fp32" else "peak_bf16_tflops"
    fields: dict[str, object] = {
        "name": f"calibrated {facts['host']}", peak_field: peak, "compute_efficiency": 1.0,
        "gemm": tuple(sorted(rates.items())), "links": links, **memory}
    if attention and rates.get(attention[0]):
        fields["attention_efficiency"] = min(1.0, rates[attention[0]] / peak)
    if links:
        n, latency, gb_s = links[-1]
        fields.update(intra_node_latency_us=latency, intra_node_gb_s=gb_s)
    if mesh.device.type == "cpu":
        fields.update(pcie_gb_s=memory["memory_gb_s"],
                      gpus_per_node=max(base.gpus_per_node, mesh.env.world_size))
        if links:
            fields.update(inter_node_latency_us=links[-1][1], inter_node_gb_s=links[-1][2])
    return replace(base, **fields)


def save(hw: Hardware, path: Path, facts: dict[str, str]) -> None:
    """Write atomically: several runs may calibrate the same machine at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(hardware_toml(hw, {"plait calibration of": ", ".join(f"{k} {v}" for k, v in facts.items())}))
    os.replace(scratch, path)


def machine_hardware(mesh: Mesh, config: GPTConfig, *, micro_batch: int, seq_len: int, tp: int,
                     precision: str, optimizer_kernel: str = "fused") -> tuple[Hardware, str]:
    """This machine's profile for the closing prediction, and where it came from."""
    facts = machine_facts(mesh, optimizer_kernel)
    path = cache_path(facts)
    cached = _load_or_none(path)
    _, gemms = cal.model_shapes(config, micro_batch, seq_len, [tp], precision)
    missing = {k: g for k, g in gemms.items() if cached is None or not cached.gemm_tflops(k)}
    need = torch.tensor([float(cached is None), float(bool(missing))], device=mesh.device)
    comm.all_reduce(need, mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    if need[0].item():
        hw = calibrate(mesh, config, micro_batch=micro_batch, seq_len=seq_len, tp_sizes=[tp],
                       precision=precision, quick=True, optimizer_kernel=optimizer_kernel)
        source = f"quick calibration, cached in {path}"
    elif need[1].item():
        attention = cal.measure_attention(mesh, config, micro_batch, seq_len, [tp], precision, 3)
        rates = {**dict(cached.gemm), **cal.measure_gemms(mesh, gemms, precision, 3), **attention}
        hw, source = replace(cached, gemm=tuple(sorted(rates.items()))), f"cached calibration {path} (+ this model's GEMMs)"
    else:
        return cached, f"cached calibration {path}"
    if mesh.is_main:
        save(hw, path, facts)
    return hw, source


def _load_or_none(path: Path) -> Hardware | None:
    try:
        return load_hardware(path) if path.exists() else None
    except Exception:  # noqa: BLE001 - a damaged cache is recalibrated, never fatal
        return None
