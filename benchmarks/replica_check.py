"""What --check-replicas costs: one check against the steps it watches over.

    python benchmarks/replica_check.py            # small GPT, dp 2, and tp 2 (2 ranks)
    python benchmarks/replica_check.py --steps 5 --no-write

Two ranks train plait's GPT `small` (micro-batch 8 × 128, fp32) through the real Trainer;
each layout times its median step and, in the same run, its median replica check (every
piece of weights and Adam state hashed, one all-gather of the pairs, the comparison). The
goal: at --check-replicas 100, the checks cost under 1% of the steps' time.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, run_world  # noqa: E402

LAYOUTS = {"dp 2": {"dp": 2}, "tp 2": {"tp": 2}, "dp 2, ZeRO-3": {"dp": 2, "zero": 3}}


def worker(args) -> None:
    import os

    import torch

    from plait.families import family_of
    from plait.runtime.mesh import init_mesh
    from plait.train.config.settings import TrainConfig
    from plait.train.loop.trainer import Trainer

    torch.set_num_threads(1)
    found = {}
    for name, layout in LAYOUTS.items():
        config = TrainConfig(model="small", micro_batch=8, seq_len=128, steps=args.steps + 2, nproc=2,
                             eval_every=0, sample_tokens=0, out="/tmp/plait-replica-bench", **layout)
        trainer = Trainer(config, init_mesh(config.layout), family_of(config).task(config))
        steps, checks = [], []
        for step in range(args.steps + 2):
            begin = time.perf_counter()
            trainer.train_step(step)
            middle = time.perf_counter()
            trainer.executor.check_replicas(trainer.optimizer, step + 1)
            if step >= 2:
                steps.append(middle - begin)
                checks.append(time.perf_counter() - middle)
        found[name] = {"step_s": statistics.median(steps), "check_s": statistics.median(checks)}
    if int(os.environ["RANK"]) == 0:
        Path(args.result).write_text(json.dumps(found))


def drive(args) -> dict:
    return run_world(__file__, 2, ["--steps", str(args.steps)])


def table(found: dict, args) -> str:
    rows = ["### Replica checks (--check-replicas)", "",
            f"- command: `python benchmarks/replica_check.py --steps {args.steps}`",
            f"- machine: {machine()}; date: {datetime.date.today().isoformat()}", "",
            "The small GPT, 2 ranks, micro-batch 8 × 128, fp32; medians over "
            f"{args.steps} steps of the same run:", "",
            "| layout | step (s) | one check (s) | check / step | at --check-replicas 100 |", "|---|---|---|---|---|"]
    for name, cost in found.items():
        ratio = cost["check_s"] / cost["step_s"]
        rows.append(f"| {name} | {cost['step_s']:.3f} | {cost['check_s']:.4f} | {ratio:.1%} | {ratio / 100:.3%} |")
    return "\n".join(rows)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8)
    finish("replica_check", parser.parse_args(), worker, drive, table)


if __name__ == "__main__":
    main()
