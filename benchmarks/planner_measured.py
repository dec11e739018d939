"""Does `plait plan` rank layouts as this machine measures them?

For each world size: `plait calibrate` on this machine (the model's shapes at every tp and
micro-batch the plan may pick), `plait plan --hardware-file` for the model, GPUs, global batch and sequence,
then every one of its top layouts trained, in one of two ways:
- `--turns` (the default): every layout built in one world of N ranks, each on its own mesh,
  the layouts taking turns step by step (`--steps` x `--repeats` steps each), so that a slow
  stretch of the host lands on all of them alike, in an order shuffled each round, so that no
  layout always follows the same one (plait.bench.turns, as the slow test's world takes them);
  a layout's measured step is the median of its steps, its first WARM_STEPS left out;
- `--no-turns`: each layout trained with `plait train --hardware-file` in a world of its own,
  the layouts taking turns `--repeats` times; the median over its repeats of each run's median
  step (first step excluded).
Then the machine is calibrated again (`--recalibrate`, the default) and each layout priced at
the mean of its two predictions: on this shared host one minute can run 10-15% slower than
the next, and the model is not the host's clock. Then, per
world: the first pick (the plan's, from the first calibration) against the fastest measured,
each prediction against its measurement, and Spearman's rank correlation of predicted and
measured steps (from the first calibration alone too, and, taking turns, against the paired
measurement: each step over its round's, `paired`), and how well the measurement orders the
layouts against itself (`self_agreement`: its odd rounds against its even ones).

Goals (the cost model's): the first pick within 5% of the fastest measured, every prediction
within 10%, a rank correlation of at least 0.8.

    python benchmarks/planner_measured.py --repeats 3          # writes RESULTS.md
    python benchmarks/planner_measured.py --worlds 2 --repeats 15 --no-write

Where layouts lie within 1-2% of each other (`small` on 2 ranks), 30 rounds do not order them:
150 (`--repeats 15`, 18 minutes on 2 ranks) give each gap a 90% interval of about ±0.5%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, new_parser, run_world, write_section  # noqa: E402

from plait.bench.turns import WARM_STEPS, take_turns  # noqa: E402
from plait.estimate.planner import divisors, row_layout  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAYOUT_FLAGS = ("dp", "tp", "pp", "cp", "zero", "micro_batch", "grad_accum")
INTERVAL_DRAWS = 400  # the rounds drawn again this many times for each layout's 90% interval
INTERVAL_SEED = 0  # ... drawn from this seed, so that a run's table reads the same when written again


def plait(*args: str, capture: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "plait", *args], check=True, cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE if capture else subprocess.DEVNULL)
    return proc.stdout if capture else ""


def every_divisor(n: int) -> str:
    """A comma list of n's divisors, as `plait calibrate` takes its degrees and micro-batches."""
    return ",".join(map(str, divisors(n)))


def calibrate(model: str, world: int, batch: int, seq: int, out: Path, name: str = "") -> Path:
    """This machine's hardware file for `world` ranks: GEMMs at every tp, ring attention at
    every cp, dividing the world, and at every micro-batch dividing the global `batch` (each
    a micro-batch some layout's dp leaves a rank), which the plan weighs against each other."""
    path = out / f"hw-{world}{name}.toml"
    plait("calibrate", "--nproc", str(world), "--model", model, "--micro-batch", every_divisor(batch), "--seq-len",
          str(seq), "--tp", every_divisor(world), "--cp", every_divisor(world), "--out", str(path), "--no-cache")
    return path


def plan(model: str, world: int, batch: int, seq: int, hw: Path, top: int) -> list[dict]:
    text = plait("plan", "--model", model, "--gpus", str(world), "--global-batch", str(batch), "--seq-len", str(seq),
                 "--hardware-file", str(hw), "--gpus-per-node", str(world), "--top", str(top), "--precision", "fp32",
                 "--json", capture=True)
    found = json.loads(text)
    return found["layouts"] if isinstance(found, dict) else found


def priced_again(rows: list[dict], again: list[dict]) -> list[dict]:
    """The plan's rows, each priced at the mean of its step from the calibration before the
    training and from one after it (`again`, a plan of every layout): the host's pace over
    the minutes between is not the model's to know. `step_before` and `step_after` keep both."""
    after = {row_layout(row): row["step_s"] for row in again}
    out = []
    for row in rows:
        later = after.get(row_layout(row), row["step_s"])
        out.append({**row, "step_before": row["step_s"], "step_after": later, "step_s": (row["step_s"] + later) / 2})
    return out


def train_flags(row: dict) -> list[str]:
    """`plait train`'s flags for a plan row."""
    flags = [f"--{name.replace('_', '-')}={row[name]}" for name in LAYOUT_FLAGS]
    flags += [f"--recompute={row['recompute']}"]
    if row["sp"]:
        flags.append("--sp")
    if row["cp"] > 1:
        flags.append(f"--cp-kind={row['cp_kind']}")
    if row["pp"] > 1:
        flags += [f"--schedule={row['schedule']}"]
        if row["virtual_stages"] > 1:
            flags.append(f"--virtual-stages={row['virtual_stages']}")
    if row["dp_shard"]:
        flags.append(f"--dp-shard={row['dp_shard']}")
    return flags


def train(model: str, row: dict, seq: int, steps: int, hw: Path, out: Path) -> dict:
    world = row["dp"] * row["tp"] * row["pp"] * row["cp"]
    plait("train", "--model", model, "--seq-len", str(seq), "--steps", str(steps), "--eval-every", "0", "--precision", "fp32",
          "--eval-samples", "16", "--sample-tokens", "0", "--no-report", "--hardware-file", str(hw),
          "--nproc", str(world), "--out", str(out), *train_flags(row))
    return json.loads((out / "summary.json").read_text())["step_time"]


def turns(model: str, rows: list[dict], seq: int, steps: int, hw: Path, out: Path) -> list[list[float]]:
    """Each layout's step times, every layout trained in one world of the plan's ranks, taking
    turns step by step (`worker`)."""
    world = rows[0]["dp"] * rows[0]["tp"] * rows[0]["pp"] * rows[0]["cp"]
    plan_file = out / f"plan-{world}.json"
    plan_file.write_text(json.dumps(rows))
    found = run_world(__file__, world, ["--model", model, "--seq-len", str(seq), "--steps", str(steps),
                                        "--hardware-file", str(hw), "--plan-file", str(plan_file),
                                        "--out", str(out / f"turns-{world}")])
    (out / f"turns-{world}.json").write_text(json.dumps(found))  # every step, for a closer look
    return found["steps"]


def quartiles(steps: list[float]) -> list[float]:
    """A layout's steps' quartiles, its median between them (one step: itself three times)."""
    return statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3


def worker(args: argparse.Namespace) -> None:
    """Inside the world: a mesh and a trainer for each layout of the plan (each `plait train`
    would build), then `--steps` steps each, the layouts taking turns step by step. Rank 0
    writes every layout's step times."""
    from plait.families import family_of
    from plait.runtime.env import prepare_host
    from plait.runtime.mesh import init_mesh
    from plait.train.config.settings import TrainConfig
    from plait.train.loop.trainer import Trainer

    rows = json.loads(Path(args.plan_file).read_text())
    trainers, meshes = [], []
    for i, row in enumerate(rows):
        config = TrainConfig(model=args.model, steps=args.steps, seq_len=args.seq_len, eval_every=0, eval_samples=16,
                             sample_tokens=0, precision="fp32", hardware_file=args.hardware_file,
                             out=str(Path(args.out) / f"layout{i}"), no_report=True,
                             nproc=row["dp"] * row["tp"] * row["pp"] * row["cp"],
                             **{name: row[name] for name in (*LAYOUT_FLAGS, "recompute", "sp", "cp_kind", "schedule",
                                                             "virtual_stages", "dp_shard", "offload")})
        meshes.append(init_mesh(config.layout))
        if i == 0:
            prepare_host(meshes[0].env.world_size)
        trainers.append(Trainer(config, meshes[-1], family_of(config).task(config)))
    steps = take_turns(trainers, args.steps)
    if meshes[0].is_main:
        Path(args.result).write_text(json.dumps({"steps": steps}))
    for mesh in reversed(meshes):
        mesh.close()


def label(row: dict) -> str:
    parts = [f"dp{row['dp']}", f"tp{row['tp']}"] + [f"{k}{row[k]}" for k in ("pp", "cp") if row[k] > 1]
    if row["cp"] > 1:
        parts[-1] += f" {row['cp_kind']}"
    if row["pp"] > 1:
        parts.append(row["schedule"] + (f" v{row['virtual_stages']}" if row["virtual_stages"] > 1 else ""))
    parts += [f"zero{row['zero']}", f"mb{row['micro_batch']}x{row['grad_accum']}"]
    parts += ["sp"] * bool(row["sp"]) + ([f"rc {row['recompute']}"] if row["recompute"] != "none" else [])
    return " ".join(parts)


def ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share the mean of their places), 1-based."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def paired(steps: list[list[float]]) -> list[float]:
    """Each layout's step measured against the others' in the same rounds: the median over
    rounds of its step over the round's geometric mean, in seconds (times the rounds' median
    mean). A round's layouts ran one after another within seconds, so a slow stretch of the
    host that moves a raw median moves a round's every step alike and cancels here. On one
    run's 30 rounds, two halves of them (odd and even) ranked 6 layouts with a correlation of
    0.94 this way, and 0.43 by their raw medians."""
    rounds = min(map(len, steps))
    means = [statistics.geometric_mean([taken[r] for taken in steps]) for r in range(rounds)]
    scale = statistics.median(means)
    return [scale * statistics.median(taken[r] / means[r] for r in range(rounds)) for taken in steps]


def self_agreement(steps: list[list[float]]) -> float:
    """How well the measurement ranks the layouts against itself: the rank correlation of the
    paired steps of the odd rounds with those of the even ones. A model's rank correlation is
    read against this: where the layouts lie closer than a round's noise, two halves of one
    measurement disagree on their order as well."""
    rounds = min(map(len, steps))
    halves = [[taken[start:rounds:2] for taken in steps] for start in (0, 1)]
    return spearman(paired(halves[0]), paired(halves[1])) if rounds > 3 else float("nan")


def paired_intervals(steps: list[list[float]], draws: int = INTERVAL_DRAWS) -> list[tuple[float, float]]:
    """Each layout's paired step over the first layout's, as a 90% interval: the rounds drawn
    again with replacement `draws` times (seeded), `paired` each time. Where two layouts'
    intervals overlap, the measurement does not order them, and neither can a ranking be held
    to that order; the width says how many rounds a world needs."""
    rounds = min(map(len, steps))
    draw = random.Random(INTERVAL_SEED)
    ratios: list[list[float]] = [[] for _ in steps]
    for _ in range(draws):
        picked = [draw.randrange(rounds) for _ in range(rounds)]
        again = paired([[taken[r] for r in picked] for taken in steps])
        for ratio, step in zip(ratios, again):
            ratio.append(step / again[0])
    low, high = round(0.05 * (draws - 1)), round(0.95 * (draws - 1))
    return [(ordered[low], ordered[high]) for ordered in map(sorted, ratios)]


def world_result(rows: list[dict], measured: dict[int, list[float]], rounds: list[list[float]] | None = None) -> dict:
    """The goals' numbers for one world; with the turns' `rounds` (each layout's steps), the
    rank correlation of the paired measurement (`paired`) too."""
    steps = [statistics.median(measured[i]) for i in range(len(rows))]
    predicted = [row["step_s"] for row in rows]
    fastest = min(steps)
    before = [row.get("step_before", row["step_s"]) for row in rows]
    result = {"rows": rows, "measured": steps, "each": [measured[i] for i in range(len(rows))],
              "first_over_fastest": steps[0] / fastest - 1, "rank_correlation": spearman(predicted, steps),
              "rank_correlation_before": spearman(before, steps),
              "worst_ratio": max(abs(p / m - 1) for p, m in zip(predicted, steps))}
    if rounds:
        result["paired"] = paired(rounds)
        result["rank_correlation_paired"] = spearman(predicted, result["paired"])
        result["self_agreement"] = self_agreement(rounds)
        result["intervals"] = paired_intervals(rounds)
        gaps = result["intervals"][1:]  # none where the plan held one layout: nothing to order
        result["resolution"] = statistics.median((high - low) / 2 for low, high in gaps) if gaps else float("nan")
    return result


def table(world: int, result: dict, turns: bool) -> list[str]:
    spread = "its steps' quartiles" if turns else "each run"
    pairs = "paired" in result
    lines = [f"**{world} ranks**: first pick {result['first_over_fastest']:+.1%} against the fastest measured; "
             f"rank correlation {result['rank_correlation']:.2f} (from the first calibration alone "
             f"{result['rank_correlation_before']:.2f}"
             + (f"; against the paired measurement {result['rank_correlation_paired']:.2f}; the measurement's "
                f"odd rounds against its even ones {result['self_agreement']:.2f}; a paired gap's 90% interval "
                f"±{result['resolution']:.1%}, the median" if pairs else "")
             + f"); worst prediction {result['worst_ratio']:.0%} off.",
             "", f"| plan's rank | layout | predicted s (before, after) | measured s (median) | predicted / measured "
             f"| {spread} |" + (" paired s | paired over the first (90%) |" if pairs else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if pairs else "")]
    for i, (row, step, each) in enumerate(zip(result["rows"], result["measured"], result["each"])):
        runs = ", ".join(f"{s:.3f}" for s in each)
        both = f" ({row['step_before']:.3f}, {row['step_after']:.3f})" if "step_before" in row else ""
        lines.append(f"| {i + 1} | {label(row)} | {row['step_s']:.3f}{both} | {step:.3f} | {row['step_s'] / step:.2f} "
                     f"| {runs} |" + (f" {result['paired'][i]:.3f} | {over_first(result, i)} |" if pairs else ""))
    return lines


def over_first(result: dict, i: int) -> str:
    """Layout i's paired step over the first's, with its 90% interval."""
    low, high = result["intervals"][i]
    return f"{result['paired'][i] / result['paired'][0] - 1:+.1%} ({low - 1:+.1%} to {high - 1:+.1%})" if i else "-"


def how_measured(args: argparse.Namespace) -> str:
    """RESULTS.md's words for how the layouts were priced and trained."""
    again = "calibrated again after the training, each prediction the mean of the two; " if args.recalibrate else ""
    if args.turns:
        return (f"{again}every layout trained in one world, taking turns step by step in an order shuffled each "
                f"round, {args.steps * args.repeats} "
                f"steps each after {WARM_STEPS} left out, measured = the median step")
    return (f"{again}each layout trained {args.repeats} times taking turns, measured = the median of the runs' "
            "median steps")


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-planner-measured"))
    parser.add_argument("--turns", action=argparse.BooleanOptionalAction, default=True,
                        help="train the layouts in one world, taking turns step by step (the default)")
    parser.add_argument("--recalibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="calibrate again after the training and price each layout at the mean of the two "
                             "(the default)")
    parser.add_argument("--hardware-file", help=argparse.SUPPRESS)  # the worker's
    parser.add_argument("--plan-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    summary = {}
    for world in args.worlds:
        hw = calibrate(args.model, world, args.global_batch, args.seq_len, out)
        rows = plan(args.model, world, args.global_batch, args.seq_len, hw, args.top)
        measured: dict[int, list[float]] = {i: [] for i in range(len(rows))}
        steps = None
        if args.turns:
            steps = turns(args.model, rows, args.seq_len, args.steps * args.repeats + WARM_STEPS, hw, out)
            measured = {i: quartiles(taken) for i, taken in enumerate(steps)}
        else:
            for repeat in range(args.repeats):
                for i, row in enumerate(rows):
                    step = train(args.model, row, args.seq_len, args.steps, hw, out / f"w{world}-{i}-{repeat}")
                    measured[i].append(step["measured"]["step"])
        if args.recalibrate:  # the machine timed again after the training: each prediction the mean of the two
            again = calibrate(args.model, world, args.global_batch, args.seq_len, out, "-after")
            rows = priced_again(rows, plan(args.model, world, args.global_batch, args.seq_len, again, 10_000))
        result = world_result(rows, measured, steps)
        summary[world] = {k: result[k] for k in ("first_over_fastest", "rank_correlation", "worst_ratio",
                                                 "rank_correlation_paired", "self_agreement", "resolution")
                         if k in result}
        shown = table(world, result, args.turns)
        lines += shown + [""]
        print("\n".join(shown), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not args.no_write:
        load = os.getloadavg()[0]
        write_section("planner-measured", "\n".join([
            "## The planner's ranking against this machine's measurements",
            "",
            f"- command: `python benchmarks/planner_measured.py --worlds {' '.join(map(str, args.worlds))} "
            f"--repeats {args.repeats} --steps {args.steps}{'' if args.turns else ' --no-turns'}`",
            f"- machine: {machine()}, Gloo; date: {time.strftime('%Y-%m-%d')}; load average (1 min) at the end: "
            f"{load:.1f}",
            f"- model {args.model}, global batch {args.global_batch} x {args.seq_len} tokens, fp32; per world: "
            "`plait calibrate --nproc N` (every tp and cp dividing N, every micro-batch dividing the global batch), "
            "`plait plan --hardware-file --top "
            f"{args.top}`, {how_measured(args)}",
            "- goals: first pick within 5% of the fastest measured, every prediction within 10%, rank "
            "correlation at least 0.8",
            "", *lines]))


if __name__ == "__main__":
    main()
