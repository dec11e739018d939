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
from typing import Any

from plait.estimate.hardware import Hardware, load_hardware
from plait.models.gpt.config import get_preset


def run_hardware(trainer: Any) -> tuple[Hardware, str]:
    """The profile this run's prediction uses, and where it came from (collective)."""
    config = trainer.config
    if config.hardware_file:
        return load_hardware(config.hardware_file), f"hardware file {config.hardware_file}"
    from plait.bench.machine import base_preset, device_name, machine_hardware

    if os.environ.get("PLAIT_CALIBRATION") == "off":  # e.g. a test suite that never reads the time
        preset = base_preset(device_name(trainer.mesh))
        return preset, f"{preset.name} preset (PLAIT_CALIBRATION=off)"
    # Calibration times a transformer's GEMMs, at the task's shape; another model (a CNN) reads
    # the machine's bandwidths, fixed costs and links from it, measured on the smallest preset.
    shape, seq_len = trainer.task.calibration_shape() or (get_preset("tiny"), 32)
    return machine_hardware(trainer.mesh, shape, micro_batch=config.micro_batch, seq_len=seq_len,
                            tp=trainer.mesh.size("tp"), precision=config.precision,
                            optimizer_kernel=config.optimizer_kernel)


def step_time_parts(predicted: dict[str, Any], measured_step: float, optimizer_s: float) -> dict[str, Any]:
    """{"predicted": parts, "measured": parts, "ratio": predicted/measured step}; {} when the
    prediction has no time. `optimizer_s` is the slowest rank's median update phase: the clip
    and optimizer.step, which holds offload's round trip and ZeRO-1's and -2's gather of the
    updated weights, so the predicted update holds them too (not the exposed communication)."""
    t = predicted.get("time")
    if not t or "compute_s" not in t:
        return {}
    gather = t.get("gather_s", 0.0)  # of dp_s
    parts = {"compute": t["compute_s"], "exposed_comm": t["tp_s"] + t["pp_s"] + (t["dp_s"] - gather)
             + t.get("cp_s", 0.0) + t.get("ep_s", 0.0),
             "bubble": t["bubble_s"], "optimizer": t["optimizer_s"] + t["offload_s"] + gather,
             "overhead": t["overhead_s"], "step": t["step_s"]}
    measured = {"optimizer": optimizer_s, "step": measured_step,
                "forward_backward_comm_overhead": measured_step - optimizer_s}
    return {"predicted": parts, "measured": measured, "ratio": t["step_s"] / measured_step,
            "hardware": predicted["layout"]["hardware"], "hardware_source": predicted.get("hardware_source", "")}
