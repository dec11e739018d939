"""Predicted vs measured step time on this machine, after calibrating it.

For each layout: `plait calibrate` (the layout's model, micro-batch and tp shard shapes) right
before `plait train --hardware-file` on the same number of ranks; the prediction is the one
the run's closing report prints, against the run's median step time (first step excluded).
With `--repeats k` every layout is calibrated and run k times, the layouts taking turns, so
that a slow minute of a shared machine lands on different layouts; the table gives the
repeat with the median ratio (its prediction, its measurement, its parts) and each repeat's
ratio beside it.
The aim is predicted/measured within 20% on a quiet machine; tests/test_time_model.py holds a
looser 50% on `tiny`.

    python benchmarks/time_model.py --repeats 3     # all layouts, writes RESULTS.md
    python benchmarks/time_model.py --only tiny-dp2 --no-write
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, new_parser, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# name -> (model, micro-batch, tp, train flags beyond the model's)
LAYOUTS = {
    "demo": ("small", 8, 1, []),
    "small-dp2": ("small", 4, 1, ["--dp", "2", "--grad-accum", "2"]),
    "small-zero3x2": ("small", 8, 1, ["--dp", "2", "--zero", "3"]),
    "small-tp2": ("small", 8, 2, ["--tp", "2"]),
    "small-pp2-1f1b": ("small", 2, 1, ["--pp", "2", "--schedule", "1f1b", "--grad-accum", "4"]),
    "tiny-dp2": ("tiny", 8, 1, ["--dp", "2"]),
}


def plait(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "plait", *args], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL)


def run(name: str, steps: int, out: Path) -> dict:
    model, micro, tp, flags = LAYOUTS[name]
    hw = out / f"{name}.toml"
    plait("calibrate", "--nproc", "2", "--model", model, "--micro-batch", str(micro), "--seq-len", "128",
          "--tp", str(tp), "--out", str(hw), "--no-cache")
    plait("train", "--model", model, "--micro-batch", str(micro), "--seq-len", "128", "--steps", str(steps),
          "--eval-every", "0", "--eval-samples", "16", "--sample-tokens", "0", "--hardware-file", str(hw),
          "--out", str(out / name), *flags)
    return json.loads((out / name / "summary.json").read_text())["step_time"]


def median_row(runs: list[dict]) -> dict:
    """The repeat whose predicted/measured ratio is the median (the lower middle for an even
    count): every number of its row comes from one calibration and one run; the ratios of
    all repeats go beside it."""
    ranked = sorted(runs, key=lambda r: r["ratio"])
    return {**ranked[(len(ranked) - 1) // 2], "each": [r["ratio"] for r in runs]}


def table(rows: dict[str, dict]) -> str:
    lines = ["| layout | predicted s | measured s | predicted / measured | each repeat | compute | exposed comm | "
             "bubble | optimizer (measured) | overhead |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, st in rows.items():
        p, m = st["predicted"], st["measured"]
        each = ", ".join(f"{r:.2f}" for r in st["each"])
        lines.append(f"| {name} | {p['step']:.3f} | {m['step']:.3f} | **{st['ratio']:.2f}** | {each} | "
                     f"{p['compute']:.3f} | {p['exposed_comm']:.3f} | {p['bubble']:.3f} | "
                     f"{p['optimizer']:.3f} ({m['optimizer']:.3f}) | {p['overhead']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="calibrate and run every layout this many times")
    parser.add_argument("--only", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-time-model"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in args.only}
    for _ in range(args.repeats):
        for name in args.only:
            runs[name].append(run(name, args.steps, out))
    text = table({name: median_row(r) for name, r in runs.items()})
    print(text)
    if not args.no_write:
        load = os.getloadavg()[0]
        write_section("time-model", "\n".join([
            "## Step time: predicted (after `plait calibrate`) vs measured",
            "",
            f"- command: `python benchmarks/time_model.py --steps {args.steps} --repeats {args.repeats}" + (
                f" --only {' '.join(args.only)}`" if args.only != list(LAYOUTS) else "`"),
            f"- machine: {machine()}, Gloo, 2 ranks; date: {time.strftime('%Y-%m-%d')}",
            "- each layout: `plait calibrate --nproc 2` with its model, micro-batch and tp, then `plait train "
            "--hardware-file` (seq 128, fp32); measured = median step time after the first; predicted = the "
            "run's closing report; with repeats, the layouts take turns and each row is the repeat with the "
            "median ratio (every repeat's ratio beside it); compute, comm, bubble, overhead are its predicted parts",
            f"- load average (1 min) when the run ended: {load:.1f} on {os.cpu_count()} cores",
            "", text]))


if __name__ == "__main__":
    main()
