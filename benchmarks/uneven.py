"""Uneven pipeline stages: `plait train --pp 2 --stage-layers A,B` for cuts from even to
lopsided, the measured step beside the estimate's per stage. The schedule runs at the pace
of its slowest stage, so the step should grow with the larger count and the prediction
(calibrated on this machine) should follow it.

    python benchmarks/uneven.py                 # updates benchmarks/RESULTS.md
    python benchmarks/uneven.py --no-write

Each cut is one `plait train` run as users type it (median step from summary.json, the
closing report's prediction from the machine's calibration), `--rounds` rounds in
alternating order.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import new_parser, torch_version, train_summary, write_section  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CUTS = ["3,3", "2,4", "1,5", "0,6"]


def flags(args, cut: str) -> list[str]:
    return ["--model", f"{args.model},n_layers=6", "--nproc", "2", "--pp", "2", "--grad-accum", str(args.grad_accum),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
            "--eval-every", "0", "--sample-tokens", "0", "--no-report", "--stage-layers", cut]


def predicted_stages(args, cut: str, hardware) -> list[float]:
    """The estimate's micro-batch seconds per pipeline rank, on the run's calibrated profile."""
    from plait.estimate import estimate_layout
    from plait.models.gpt.config import get_preset

    result = estimate_layout(get_preset(f"{args.model},n_layers=6"), hardware=hardware, pp=2,
                             stage_layers=tuple(int(c) for c in cut.split(",")), grad_accum=args.grad_accum,
                             micro_batch=args.micro_batch, seq_len=args.seq_len, precision="fp32")
    return [row["micro_batch_s"] for row in result["stages"]]


READING = """
Reading it: the step grows with the larger stage (1.54× the even cut's at 0,6, where one rank
runs all six blocks), and the prediction follows it within 6%. The estimate runs the 1F1B schedule
with each rank's micro-batch (plait/estimate/pipeline.py): the slowest rank sets the pace and
the others' fill and drain is the bubble. Priced at the slowest stage's micro-batch, as before
2026-11-27, the same runs were predicted at 0.92, 1.01, 1.14 and 1.22 of measured (0,6: a
first stage holding only the embedding was charged a whole block-heavy slot).
"""


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from plait.estimate.hardware import load_hardware

    runs: dict[str, list[dict]] = {cut: [] for cut in CUTS}
    for k in range(args.rounds):
        for cut in CUTS if k % 2 == 0 else CUTS[::-1]:
            runs[cut].append(train_summary(flags(args, cut)))
    lines = [
        "## Uneven pipeline stages: measured step and the estimate per stage", "",
        f"- command: `python benchmarks/uneven.py --model {args.model} --steps {args.steps} --micro-batch "
        f"{args.micro_batch} --grad-accum {args.grad_accum} --seq-len {args.seq_len} --rounds {args.rounds}`",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Gloo, torch {torch_version()}; 2 ranks",
        f"- date: {datetime.date.today().isoformat()}; load average (1 min) at the end: {os.getloadavg()[0]:.1f}",
        f"- model: `{args.model}` with 6 blocks, fp32, pp 2 (1F1B), {args.grad_accum} micro-batches of "
        f"{args.micro_batch} × {args.seq_len} tokens; each cut one `plait train` run per round ({args.rounds} "
        "rounds, alternating); predicted: the closing report's step on the machine's calibration, and the "
        "estimate's micro-batch seconds per stage on the same profile", "",
        "| --stage-layers | measured s/step (rounds) | predicted s/step | predicted / measured | stage 0 / stage 1 "
        "micro-batch s (predicted) | vs 3,3 measured |",
        "|---|---|---|---|---|---|"]
    even = statistics.median(r["step_time_s_median"] for r in runs["3,3"])
    for cut, results in runs.items():
        measured = statistics.median(r["step_time_s_median"] for r in results)
        timing = results[0]["step_time"]
        predicted = timing["predicted"]["step"]
        cached = [w for w in str(timing.get("hardware_source")).split() if w.endswith(".toml") and Path(w).exists()]
        profile = load_hardware(cached[0]) if cached else "cpu"
        stages = predicted_stages(args, cut, profile)
        each = ", ".join(f"{r['step_time_s_median']:.3f}" for r in results)
        lines.append(f"| {cut} | {measured:.3f} ({each}) | {predicted:.3f} | {predicted / measured:.2f} | "
                     f"{stages[0]:.4f} / {stages[1]:.4f} | {measured / even:.2f} |")
    text = "\n".join(lines) + "\n" + READING
    print(text)
    if not args.no_write:
        write_section("uneven", text)


if __name__ == "__main__":
    main()
