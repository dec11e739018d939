"""What a run records of itself: each step's line, metrics.jsonl, and the closing summary.

A fully measured step gathers two small all-reduces (the dp-mean loss; the max over ranks of
time, memory and traffic); a lighter one keeps this rank's own numbers (plait.train.loop.measure).
Lines go to OUT/metrics.jsonl as they come; a resumed run keeps the lines of the steps it
did not redo, and reads them back, so its summary covers the whole run. The summary is
built on the main rank from those lines, the task's description and the prediction; the
few numbers it needs from every rank are gathered first (`gather_extras`, collective).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from plait.runtime import comm
from plait.runtime.mesh import AXES, SYNC, Mesh
from plait.train.loop.measure import MeasurePolicy

COMM_KEYS = [(axis, op) for axis in AXES for op in comm.OPS]
MEM_KEYS = ("params", "grads", "optim", "activations_peak")


class Metrics:
    """The run's step records, their file, and the summary made of them."""

    def __init__(self, out: str, mesh: Mesh, measure: MeasurePolicy, unit: str, units_per_step: int,
                 metric_names: tuple[str, ...]):
        self.path, self.mesh, self.measure = Path(out) / "metrics.jsonl", mesh, measure
        self.unit, self.units_per_step, self.metric_names = unit, units_per_step, metric_names
        self.history: list[dict[str, Any]] = []
        self.kept = 0
        self._file: Any = None

    # -- the file ----------------------------------------------------------------------------
    def open(self, start: int) -> None:
        """Start metrics.jsonl, keeping (and reading back) the lines of steps up to `start`.
        Every rank reads them; the main rank rewrites the file by an atomic rename, so a rank
        reading at the same moment sees the old file or the new one, never a truncated one."""
        kept = []
        if start and self.path.exists():
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line]
            kept = [record for record in kept if record["step"] <= start]
        self.history = kept
        self.kept = len(kept)  # lines of an earlier world's steps: this world's start after them
        if self.mesh.is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            scratch.write_text("".join(json.dumps(record) + "\n" for record in kept))
            os.replace(scratch, self.path)
            self._file = open(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None

    # -- one step ----------------------------------------------------------------------------
    def step_record(self, step: int, lr: float, local: dict[str, Any], full: bool) -> dict[str, Any]:
        """The step's line: gathered over ranks when measured in full, else this rank's own."""
        if full:
            return self._gathered(step, lr, local)
        return self.measure.local_record(step, lr, local, self.units_per_step, self.unit)

    def _gathered(self, step: int, lr: float, local: dict[str, Any]) -> dict[str, Any]:
        """Mean loss over dp ranks; max over all ranks for time, memory and traffic."""
        device = self.mesh.device  # NCCL reduces device tensors only
        loss = torch.tensor([local["loss"]], dtype=torch.float64, device=device)
        comm.all_reduce(loss, self.mesh.axis(SYNC), purpose=comm.TELEMETRY)  # dp × cp: equal token counts
        maxed = torch.tensor([local["step_time_s"], *(local[k] for k in MEM_KEYS),
                              *(local["comm"].get(a, {}).get(o, 0.0) for a, o in COMM_KEYS)], dtype=torch.float64,
                             device=device)
        comm.all_reduce(maxed, self.mesh.axis("world"), op="max", purpose=comm.TELEMETRY)
        values = maxed.tolist()
        step_time, mem, traffic = values[0], values[1:1 + len(MEM_KEYS)], values[1 + len(MEM_KEYS):]
        comm_out: dict[str, dict[str, int]] = {}
        for (axis, op), wire in zip(COMM_KEYS, traffic):
            if wire:
                comm_out.setdefault(axis, {})[op] = round(wire)
        units = self.units_per_step
        return {"step": step + 1, "loss": loss.item() / self.mesh.size(SYNC), "lr": lr,
                "grad_norm": local["grad_norm"], self.unit: units, "step_time_s": step_time,
                f"{self.unit}_per_s": units / step_time, "mem": dict(zip(MEM_KEYS, map(int, mem))), "comm": comm_out}

    # -- the summary -------------------------------------------------------------------------
    def evaluations(self) -> dict[int, dict[str, float]]:
        """{step: the metrics evaluated after it}, from the lines (a resumed run's included)."""
        return {r["step"]: {name: r[name] for name in self.metric_names if name in r}
                for r in self.history if self.metric_names[0] in r}

    def median_step_time(self) -> float:
        times = [r["step_time_s"] for r in self.history[1:]] or [self.history[0]["step_time_s"]]
        return statistics.median(times)

    def gather_extras(self, update_times: list[float], start_bytes: int = 0) -> dict[str, Any]:
        """The few numbers the summary needs from every rank (collective): each rank's process
        peak, its peak before the model was built (`start_bytes`) and, on a GPU, what its
        caching allocator reserved at most; and the optimizer's median time (the max over ranks)."""
        from plait.bench.meter import peak_process_bytes, reserved_process_bytes

        times = update_times[1:] or update_times or [0.0]
        world, device = self.mesh.axis("world"), self.mesh.device
        values = torch.zeros(3, world.size + 1, dtype=torch.float64, device=device)  # one slot a rank, and one more
        values[:, world.rank] = torch.tensor([peak_process_bytes(device), start_bytes, reserved_process_bytes(device)],
                                             dtype=torch.float64)
        values[0, -1] = statistics.median(times)
        comm.all_reduce(values, world, op="max", purpose=comm.TELEMETRY)  # each slot: one rank's, zeros elsewhere
        peaks, starts, reserved = ([int(v) for v in row[:world.size].tolist()] for row in values)
        return {"peak_process_bytes": max(peaks), "peak_process_bytes_by_rank": peaks,
                "start_process_bytes_by_rank": starts, "peak_reserved_bytes": max(reserved),
                "optimizer_s": values[0, -1].item()}

    def summary(self, described: dict[str, Any], extras: dict[str, float],
                hooked: dict[str, Any] | None = None) -> dict[str, Any]:
        """What summary.json and the closing report show. `described` is the run's own
        description (model, layout, task, prediction...); `hooked`, what the step hooks sum
        up (a mixture of experts' routing: plait.parallel.executor); the rest comes from the lines."""
        history, evaluations = self.history, self.evaluations()
        final = evaluations[max(evaluations)]
        layout = described["layout"]
        param_bytes = described["num_params"] * described["reduce_bytes"]
        dp, median = layout["dp"], self.median_step_time()
        pure_dp = dp > 1 and layout["world_size"] == dp and not layout["zero"] and layout.get("ep", 1) == 1
        return {
            **{k: v for k, v in described.items() if k != "reduce_bytes"},
            "steps": len(history), "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
            **final, "metrics": final,
            "val_losses": {step: e["val_loss"] for step, e in evaluations.items()},
            "evaluations": evaluations,
            "step_time_s_median": median, f"{self.unit}_per_s": self.units_per_step / median,
            "comm_per_step": history[-1]["comm"],
            "comm_formula": {"dp": {"all_reduce": comm.ring_wire_bytes("all_reduce", param_bytes, dp)}}
            if pure_dp else {},
            "comm_naive_total": comm.naive_exchange_bytes(param_bytes, dp),
            "comm_ring_total": comm.ring_wire_bytes("all_reduce", param_bytes, dp) * dp,
            "mem": {k: max(r["mem"][k] for r in history if "mem" in r) for k in MEM_KEYS},
            "measure": self.measure.mode,
            "peak_process_bytes": int(extras["peak_process_bytes"]),
            "peak_process_bytes_by_rank": extras.get("peak_process_bytes_by_rank", []),
            "start_process_bytes_by_rank": extras.get("start_process_bytes_by_rank", []),
            "peak_reserved_bytes": int(extras.get("peak_reserved_bytes", 0)),
            "telemetry_bytes": sum(sum(ops.values()) for ops in self.mesh.ledger.wire(comm.TELEMETRY).values()),
            "worlds": world_segments(history),
            **(hooked or {}),
        }


def world_segments(history: list[dict[str, Any]]) -> list[dict[str, int]]:
    """The runs of steps trained on one world size: more than one after an elastic restart
    (each line records its world; older lines, without it, join the segment they touch)."""
    segments: list[dict[str, int]] = []
    for record in history:
        size, accum = record.get("world_size"), record.get("grad_accum")
        last = segments[-1] if segments else None
        if last and (size is None or (size, accum) == (last["world_size"], last["grad_accum"])):
            last["last_step"] = record["step"]
        elif size is not None or not last:
            segments.append({"first_step": record["step"], "last_step": record["step"], "world_size": size,
                             "grad_accum": accum})
    return segments
