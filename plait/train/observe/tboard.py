"""`--tensorboard`: each step's metrics line as TensorBoard scalars, written by rank 0.

The scalars are the ones in metrics.jsonl, under stable tags: `loss`, `val_loss`, `lr`,
`grad_norm`, `tokens_per_s`, `step_time_s`, `mem/<kind>` (bytes per rank, max over ranks)
and `comm/<axis>` (wire bytes of one step on that axis, all collectives summed). The
`tensorboard` package is optional: it is imported only when the flag is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.errors import PlaitError

SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")


def check_available() -> None:
    """Fail before training, not at the first step, when the package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise PlaitError("--tensorboard needs the tensorboard package",
                         hint="pip install tensorboard (or pip install 'plait[tensorboard]')") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Tag -> value for one metrics line (the keys a line lacks are left out)."""
    out = {tag: float(record[tag]) for tag in SCALARS if record.get(tag) is not None}
    for kind, value in record.get("mem", {}).items():
        out[f"mem/{kind}"] = float(value)
    for axis, ops in record.get("comm", {}).items():
        out[f"comm/{axis}"] = float(sum(ops.values()))
    return out


class TensorBoardLog:
    """A SummaryWriter under `out/tensorboard`; `write` takes one metrics line."""

    def __init__(self, out: str | Path):
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(out) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.directory))

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
