"""A ResNet's predicted cost against what `plait train` measures: activations and step time.

Each layout runs `plait train --model resnet18,width=16 --data digits` as a user would, on
this machine's cached calibration (the quick one `plait train` makes when there is none);
the prediction is the one its closing report prints (plait/estimate/vision.py: estimate_cnn,
from plait/estimate/cnn.py's convolutions), the measurement its median step (first step
excluded) and its activation meter. `--repeats k` runs every layout k times, taking turns,
and reports the repeat with the median ratio.

    python benchmarks/cnn_estimate.py --repeats 3
"""

from __future__ import annotations

import datetime
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, new_parser, train_summary, write_section  # noqa: E402

COMMON = ["--model", "resnet18,width=16", "--data", "digits", "--micro-batch", "32", "--steps", "20",
          "--eval-every", "0", "--warmup-steps", "2", "--lr", "0.01", "--no-report", "--augment", "none"]
READING = """What it shows. The activations are exact: the formula counts what autograd saves for a
ResNet (plait/estimate/cnn.py), and SyncBatchNorm saves 2 values a channel fewer per layer
than the running statistics it stands in for. The step time is 0.7-0.8 of the measurement
for one process, dp 2 and recomputation: each convolution costed as its GEMM plus oneDNN's
fixed costs per call; what is left is BatchNorm on this CPU, far below its memory bandwidth,
and autograd's per-node costs. SyncBatchNorm and ZeRO-3 predict 0.4: their all-reduces and
gathers are counted, but not their per-layer and per-unit Python work (SyncBatchNorm's
statistics and autograd function, ZeRO-3's gather/free hooks around each of the 9 small
units), which dominates at these sizes. Not calibrated per machine: oneDNN's call costs are
expressed in the calibrated `op_overhead_us`."""
LAYOUTS = {
    "1 process": ["--nproc", "1"],
    "dp 2": ["--nproc", "2"],
    "dp 2, SyncBN": ["--nproc", "2", "--sync-bn"],
    "ZeRO-3 x 2": ["--nproc", "2", "--zero", "3"],
    "dp 2, recompute full": ["--nproc", "2", "--recompute", "full"],
}


def run(flags: list[str]) -> dict:
    """One `plait train` run: its summary's prediction and measurement."""
    summary = train_summary([*COMMON, *flags])
    predicted, step = summary["predicted"], summary["step_time"]
    return {"act_pred": predicted["memory"]["activations"], "act_meas": summary["mem"]["activations_peak"],
            "step_pred": step["predicted"]["step"], "step_meas": step["measured"]["step"], "ratio": step["ratio"],
            "opt_pred": step["predicted"]["optimizer"], "opt_meas": step["measured"]["optimizer"],
            "source": step["hardware_source"]}


def table(rows: dict[str, list[dict]], command: str) -> str:
    mib = 2**20
    lines = ["## CNN estimate: a ResNet's predicted vs measured activations and step time", "",
             f"- command: `{command}`", f"- machine: {machine()}, Gloo; ranks share the cores",
             f"- date: {datetime.date.today().isoformat()}",
             f"- model: `resnet18,width=16` on digits (8x8x1), micro-batch 32, fp32; hardware: {rows['1 process'][0]['source'].split(' /')[0]}",
             "", "| layout | activations predicted | measured | step predicted | measured | pred/meas (each repeat) |"
             " optimizer predicted | measured |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in rows.items():
        mid = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
        each = ", ".join(f"{r['ratio']:.2f}" for r in runs)
        lines.append(f"| {name} | {mid['act_pred'] / mib:.2f} MiB | {mid['act_meas'] / mib:.2f} MiB | "
                     f"{mid['step_pred'] * 1e3:.1f} ms | {mid['step_meas'] * 1e3:.1f} ms | {mid['ratio']:.2f} ({each}) | "
                     f"{mid['opt_pred'] * 1e3:.1f} ms | {mid['opt_meas'] * 1e3:.1f} ms |")
    ratios = [statistics.median(r["ratio"] for r in runs) for runs in rows.values()]
    lines += ["", f"Median predicted/measured over the layouts: {statistics.median(ratios):.2f}.", "", READING]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for _ in range(args.repeats):
        for name, flags in LAYOUTS.items():
            rows[name].append(run(flags))
    text = table(rows, " ".join(["python benchmarks/cnn_estimate.py", *sys.argv[1:]]))
    print(text)
    if not args.no_write:
        write_section("cnn-estimate", text)


if __name__ == "__main__":
    main()
