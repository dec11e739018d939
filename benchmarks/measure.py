"""What measuring costs: plait train's step time under --measure full, light and off.

    python benchmarks/measure.py                      # dp 2 and pp 2 on the demo model; updates RESULTS.md
    python benchmarks/measure.py --steps 6 --no-write # a quick look

One world per layout builds the demo's Trainer once and runs its steps with the three modes
taking turns step by step, so machine noise hits them alike. A step's time is rank 0's
wall clock around the whole `train_step`, telemetry collectives included (the
`step_time_s` of metrics.jsonl stops before them). The overhead is full / off − 1; on a busy
machine that difference drowns in noise, so the seconds spent inside the measuring code
itself (the gathers, the storage walk, the pipeline's barrier and timeline; not the
saved-tensor hooks) are timed too, per full step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, run_world  # noqa: E402

MODES = ("full", "light", "off")
READING = """
Reading it: on a machine this loaded (the step times of the `small` model swing by a factor
of two from one step to the next), full / off − 1 is noise, not the cost of measuring. The
last two columns are the steadier figure: the seconds a full step spent inside the code that
only measures (the two telemetry all-reduces, the storage walk, and under pp the barrier and
the timeline's all-gather; waiting there for a slower rank counts too, the saved-tensor hooks
do not). The aim is full ≤ 3% of a step; rerun the command on a quiet machine to check the
step-time columns as well."""
LAYOUTS = {"dp2": ["--pp", "1"], "pp2": ["--pp", "2"]}


def worker(args: argparse.Namespace) -> None:
    """One rank: the demo trainer, its steps timed per measure mode; rank 0 writes the medians."""
    from plait.families import family_of
    from plait.runtime.mesh import init_mesh
    from plait.train.config.settings import build_config
    from plait.runtime.env import prepare_host
    from plait.train.loop.trainer import Trainer

    flags = {"model": args.model, "pp": args.pp, "grad_accum": args.grad_accum, "micro_batch": args.micro_batch,
             "seq_len": args.seq_len, "steps": 10_000, "out": args.out}
    config = build_config({}, flags, family_of)
    mesh = init_mesh(config.layout, backend=config.backend)
    prepare_host(mesh.size("world"))
    trainer = Trainer(config, mesh, family_of(config).task(config))
    trainer.measure.first_step = -1  # no step is measured in full because it is first or last
    spent = _time_the_telemetry(trainer)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    inside: list[float] = []
    for step in range((args.warmup + args.steps) * len(MODES)):
        mode = MODES[step % len(MODES)]
        trainer.measure.mode = mode
        spent[0] = 0.0
        start = time.perf_counter()
        trainer.train_step(step)
        if step >= args.warmup * len(MODES):
            times[mode].append(time.perf_counter() - start)
            if mode == "full":
                inside.append(spent[0])
    if mesh.is_main:
        Path(args.result).write_text(json.dumps({
            "layout": f"dp={mesh.size('dp')} pp={mesh.size('pp')}", "params": trainer.task.num_params,
            "telemetry": statistics.median(inside), **{mode: statistics.median(t) for mode, t in times.items()}}))
    mesh.close()


def _time_the_telemetry(trainer) -> list[float]:
    """Wrap the code that only measures (the gathers, the storage walk, the pipeline's
    barrier and timeline) to add its seconds to a counter: a figure less noisy than a
    difference of two step times on a busy machine. The saved-tensor hooks are not in it."""
    import plait.train.loop.trainer as trainer_module

    spent = [0.0]

    def timed(owner, name):
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(trainer.metrics, "_gathered")
    timed(trainer_module, "model_state_bytes")
    if trainer.executor.runner is not None:
        timed(trainer.executor.runner, "_gather_timeline")
        timed(trainer.executor.runner, "_barrier")
    return spent


def drive(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name in args.layouts:
        pp = LAYOUTS[name][1]
        accum = str(args.grad_accum if pp == "2" else 1)
        rows.append(run_world(__file__, 2, [*forwarded(args), "--pp", pp, "--grad-accum", accum]))
    return rows


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--out", args.out]


def load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def table(rows: list[dict], args: argparse.Namespace) -> str:
    command = (f"python benchmarks/measure.py --model {args.model} --steps {args.steps} --warmup {args.warmup} "
               f"--micro-batch {args.micro_batch} --seq-len {args.seq_len} --grad-accum {args.grad_accum} "
               f"--layouts {' '.join(args.layouts)}")
    lines = [
        "## The cost of measuring: plait train --measure full | light | off",
        "",
        f"- command: `{command}`",
        f"- machine: {machine()}, Gloo, 2 processes sharing the cores",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: `{args.model}` GPT ({rows[0]['params'] / 1e6:.2f} M params), micro-batch {args.micro_batch} × "
        f"{args.seq_len} tokens per rank; pp 2 runs 1F1B over {args.grad_accum} micro-batches; median of "
        f"{args.steps} steps per mode after {args.warmup} warm-up rounds, the modes taking turns step by step",
        f"- load average (1 min) when the run ended: {load_average()} on {os.cpu_count()} cores. Other jobs "
        "shared this machine: rerun the command on a quiet machine before trusting a difference of a few percent",
        "",
        "| layout | full s/step | light s/step | off s/step | full / off − 1 | light / off − 1 | "
        "telemetry s (full step) | telemetry / full step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['layout']} | {row['full']:.3f} | {row['light']:.3f} | {row['off']:.3f} | "
                     f"{row['full'] / row['off'] - 1:+.1%} | {row['light'] / row['off'] - 1:+.1%} | "
                     f"{row['telemetry']:.4f} | {row['telemetry'] / row['full']:.2%} |")
    return "\n".join(lines) + "\n" + READING


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step under pp 2")
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="/tmp/plait-measure-bench", help="the trainer's --out (nothing is saved)")
    finish("measure", parser.parse_args(), worker, drive, table)


if __name__ == "__main__":
    main()
