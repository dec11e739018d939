"""Predicted vs measured step time, part by part, for the closing report and summary.json.

The prediction is plait's time model (plait/estimate/time.py) on this run's own hardware
profile: the `--hardware-file` given, else this machine's calibration (cached, or measured
quickly at the end of the run; see plait/bench/machine.py; PLAIT_CALIBRATION=off takes the
device's preset instead). The run measures the whole step
and, separately, its optimizer part (clipping and the update); the rest is forward,
backward, their communication and the pipeline bubble, plus the loop's own overhead.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch

from plait.estimate.hardware import Hardware, load_hardware
from plait.runtime import comm


def run_hardware(trainer: Any) -> tuple[Hardware, str]:
    """The profile this run's prediction uses, and where it came from (collective)."""
    config = trainer.config
    if config.hardware_file:
        return load_hardware(config.hardware_file), f"hardware file {config.hardware_file}"
    from plait.bench.machine import base_preset, device_name, machine_hardware

    if os.environ.get("PLAIT_CALIBRATION") == "off":  # e.g. a test suite that never reads the time
        preset = base_preset(device_name(trainer.mesh))
        return preset, f"{preset.name} preset (PLAIT_CALIBRATION=off)"

    return machine_hardware(trainer.mesh, trainer.model_config, micro_batch=config.micro_batch,
                            seq_len=config.seq_len, tp=trainer.mesh.size("tp"), precision=config.precision)


def step_time_parts(trainer: Any, predicted: dict[str, Any], measured_step: float) -> dict[str, Any]:
    """{"predicted": parts, "measured": parts, "ratio": predicted/measured step} (collective:
    the optimizer's time is the slowest rank's median)."""
    times = trainer.update_times[1:] or trainer.update_times or [0.0]
    update = torch.tensor([statistics.median(times)], dtype=torch.float64, device=trainer.mesh.device)
    comm.all_reduce(update, trainer.mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
    t = predicted["time"]
    parts = {"compute": t["compute_s"], "exposed_comm": t["tp_s"] + t["pp_s"] + t["dp_s"] + t["offload_s"],
             "bubble": t["bubble_s"], "optimizer": t["optimizer_s"], "overhead": t["overhead_s"],
             "step": t["step_s"]}
    measured = {"optimizer": update.item(), "step": measured_step,
                "forward_backward_comm_overhead": measured_step - update.item()}
    return {"predicted": parts, "measured": measured, "ratio": t["step_s"] / measured_step,
            "hardware": predicted["layout"]["hardware"], "hardware_source": predicted.get("hardware_source", "")}


def step_time_lines(summary: dict[str, Any]) -> list[str]:
    """The report's step-time table."""
    st = summary.get("step_time")
    if not st:
        return []
    p, m = st["predicted"], st["measured"]
    rest = p["compute"] + p["exposed_comm"] + p["bubble"] + p["overhead"]
    return [
        f"  step time   {'':<28}{'predicted':>10}{'measured':>10}   ({st['hardware_source']})",
        f"              {'compute':<28}{p['compute']:>9.3f}s",
        f"              {'exposed comm':<28}{p['exposed_comm']:>9.3f}s",
        f"              {'pipeline bubble':<28}{p['bubble']:>9.3f}s",
        f"              {'loop overhead':<28}{p['overhead']:>9.3f}s",
        f"              {'  = all but the optimizer':<28}{rest:>9.3f}s{m['forward_backward_comm_overhead']:>9.3f}s",
        f"              {'optimizer (clip + update)':<28}{p['optimizer']:>9.3f}s{m['optimizer']:>9.3f}s",
        f"              {'step (median)':<28}{p['step']:>9.3f}s{m['step']:>9.3f}s   predicted/measured {st['ratio']:.2f}",
    ]
