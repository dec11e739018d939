"""How much each training step measures about itself: `--measure full|light|off`.

A fully measured step pays for its own telemetry: two small all-reduces (the dp-mean loss;
the max over ranks of time, memory and traffic), a walk over every storage for the
model-state bytes, a hook on every tensor autograd saves, and under pipeline parallelism a
barrier plus an all-gather of the timeline. `light` keeps what costs no collective: this
rank's loss, time and wire bytes (the ledger counts them anyway). `off` does not even read
the loss back from the device. Whatever the mode, the first and the last step of a run are
measured in full, so the closing report, `summary.json` and `plait report` keep their loss,
memory, traffic and timeline figures.
"""

from __future__ import annotations

from typing import Any

MODES = ("full", "light", "off")


class MeasurePolicy:
    """Which steps are measured in full, and what the others record."""

    def __init__(self, mode: str, steps: int):
        self.mode, self.steps = mode, steps
        self.first_step = 0  # a resumed run starts later; its first step is measured too

    def full(self, step: int) -> bool:
        """True when `step` (0-based) pays for the whole measurement."""
        return self.mode == "full" or step in (self.first_step, self.steps - 1)

    def reads_loss(self, full: bool) -> bool:
        """`off` leaves the loss on the device on the steps it does not measure."""
        return full or self.mode != "off"

    def local_record(self, step: int, lr: float, local: dict[str, Any], count: int,
                     unit: str = "tokens") -> dict[str, Any]:
        """A step's metrics line from this rank's own numbers, with no collective.

        The loss is this rank's (its dp shard of the batch), the time and traffic rank 0's:
        `measure` in the line says so, so nobody mistakes them for the all-rank figures.
        """
        record: dict[str, Any] = {"step": step + 1, "lr": lr, unit: count, "step_time_s": local["step_time_s"],
                                  f"{unit}_per_s": count / local["step_time_s"], "measure": self.mode}
        if self.mode == "light":
            comm = {axis: {op: round(b) for op, b in ops.items() if b} for axis, ops in local["comm"].items()}
            record.update(loss=local["loss"], grad_norm=local["grad_norm"],
                          comm={axis: ops for axis, ops in comm.items() if ops})
        return record
