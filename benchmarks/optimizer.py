"""The optimizer's share of a training step: AdamW's per-tensor loop vs its fused kernel.

    python benchmarks/optimizer.py                 # the demo's shapes, dp 2 and ZeRO-3 x 2
    python benchmarks/optimizer.py --steps 20 --no-write

Each row is one `plait train` run, as a user runs it, on the demo's defaults (the small GPT,
2 processes) with `--optimizer-kernel loop` or `fused`; the step and the update (finite
check, clipping and AdamW, the slowest rank's median) come from the run's summary.json, and
the time model's predicted update (calibrated with the same kernel) beside them. Under ZeRO
the optimizer steps flat shards, a few tensors: the kernel matters less there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, train_summary  # noqa: E402

LAYOUTS = {"dp 2": ["--nproc", "2"], "ZeRO-3 x 2": ["--nproc", "2", "--zero", "3"]}
KERNELS = ("loop", "fused")


def one_run(layout: list[str], kernel: str, steps: int) -> dict:
    summary = train_summary([*layout, "--optimizer-kernel", kernel, "--steps", str(steps), "--eval-every", "0",
                             "--sample-tokens", "0", "--no-report"])
    parts = summary["step_time"]
    return {"step": summary["step_time_s_median"], "optimizer": parts["measured"]["optimizer"],
            "predicted": parts["predicted"]["optimizer"], "params": summary["num_params"]}


def drive(args: argparse.Namespace) -> list[dict]:
    return [{"layout": name, "kernel": kernel, **one_run(flags, kernel, args.steps)}
            for name, flags in LAYOUTS.items() for kernel in KERNELS]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "## The optimizer's share of the step: AdamW's loop vs its fused kernel",
        "",
        f"- command: `python benchmarks/optimizer.py --steps {args.steps}`",
        f"- machine: {machine()}, Gloo, 2 ranks sharing the cores",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: the demo's (`small` GPT, {rows[0]['params'] / 1e6:.2f} M params, its default batch), one "
        f"`plait train` run per row, {args.steps} steps; medians after the first step; load average (1 min) "
        f"when the runs ended: {os.getloadavg()[0]:.1f}",
        "",
        "| layout | kernel | step s | update s (measured) | share of the step | update s (predicted) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['kernel']} | {r['step']:.3f} | {r['optimizer']:.4f} | "
                     f"{r['optimizer'] / r['step']:.1%} | {r['predicted']:.4f} |")
    lines += ["", "The update is the step guard's finite check and clipping plus AdamW's step; the prediction is "
              "the time model's, from a calibration that timed the same kernel."]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    finish("optimizer", args, lambda a: None, drive, table)


if __name__ == "__main__":
    main()
