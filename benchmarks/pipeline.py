"""Pipeline schedules: plait's runner vs torch.distributed.pipelining, step time and bubble.

    python benchmarks/pipeline.py                  # pp = 2 and 4; updates benchmarks/RESULTS.md
    python benchmarks/pipeline.py --pp 2 --steps 4 --no-write

Each world builds the same stages from one seed (embeddings untied: torch's pipelining has
no tied-weight support, so both sides do the same work) and alternates step by step between
plait's PipelineRunner and torch's schedule, so machine noise hits both alike.

Bubble is measured the same way on both sides: after a barrier, every forward and backward
is timed on every rank (plait: its timeline; torch: `forward_one_chunk` / `backward_one_chunk`
wrapped with timers) and bubble = 1 - busy / (ranks x makespan). Beside it: the textbook
formula and `simulate` fed with the measured mean cost of each action kind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_world, finish, new_parser  # noqa: E402
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
DEFAULT_M = 8  # micro-batches a step: the section `pipeline`; another count gets its own


def formula(schedule: str, p: int, m: int, v: int) -> float:
    """Textbook bubble: (p-1)/(m+p-1), (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1 (F=I=W)."""
    per_rank = {"interleaved": v * m, "zb-h1": 3 * m}.get(schedule, m)
    return (p - 1) / (per_rank + p - 1)


def worker(args: argparse.Namespace) -> None:
    """One rank: time plait and torch on every schedule; rank 0 writes the numbers."""
    import torch

    import plait
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh(pp=int(os.environ["WORLD_SIZE"]))
    prepare_host(mesh.size("world"))
    rows = [bench_schedule(mesh, args, name, v) for name, v in SCHEDULES if name in args.schedules]
    if mesh.is_main:
        Path(args.result).write_text(json.dumps({"pp": mesh.size("pp"), "rows": rows,
                                                 "threads": torch.get_num_threads()}))
    mesh.close()


def bench_schedule(mesh: Any, args: argparse.Namespace, name: str, v: int) -> dict[str, Any]:
    import torch

    from plait.schedule.build import build_schedule, simulate

    pp, m = mesh.size("pp"), args.microbatches
    sides = {"plait": PlaitSide(mesh, args, name, v)}
    if name != "zb-h1":  # torch has no one-chunk-per-rank ZB-H1
        sides["torch"] = TorchSide(mesh, args, name, v)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (m, args.micro_batch, args.seq_len + 1), generator=generator)
    times: dict[str, list[float]] = {k: [] for k in sides}
    bubbles: dict[str, list[float]] = {k: [] for k in sides}
    for step in range(args.warmup + args.steps):
        for key, side in sides.items():
            seconds, bubble = side.step(rows)
            if step >= args.warmup:
                times[key].append(seconds)
                bubbles[key].append(bubble)
    plait_side = sides["plait"]
    costs = plait_side.mean_costs()
    simulated = simulate(build_schedule(name, pp, m, v), pp, v, **costs).bubble
    return {
        "schedule": name, "v": v, "m": m, "formula": formula(name, pp, m, v), "simulated": simulated,
        **{f"{k}_s": statistics.median(t) for k, t in times.items()},
        **{f"{k}_bubble": statistics.median(b) for k, b in bubbles.items()},
        "costs_ms": {k[-1].upper(): 1e3 * c / v for k, c in costs.items()},
        "peak_inflight_rank0": plait_side.runner.last_stats.peak_inflight,
        "peak_sent_rank0": plait_side.runner.last_stats.peak_sent_bytes,
        "p2p_bytes_rank0": plait_side.p2p_bytes, "act_bytes": plait_side.act_bytes,
    }


class PlaitSide:
    def __init__(self, mesh: Any, args: argparse.Namespace, name: str, v: int):
        import torch

        import plait
        from plait.models.gpt.model import build_gpt
        from plait.parallel.pipeline.runner import PipelineRunner, apply_pipeline

        self.mesh, self.config = mesh, model_config(args)
        self.stages = apply_pipeline(build_gpt(self.config, 0), mesh, virtual_stages=v)
        self.opt = plait.build_optimizer(self.stages, torch.optim.AdamW, lr=1e-4)
        self.runner = PipelineRunner(self.stages, mesh, name)
        self.act_bytes = args.micro_batch * args.seq_len * self.config.d_model * 4
        self.p2p_bytes = 0.0

    def step(self, rows: Any) -> tuple[float, float]:
        before = self.mesh.ledger.snapshot()
        start = time.perf_counter()
        self.runner.step([r[:, :-1] for r in rows], [r[:, 1:] for r in rows], loss_fn)
        self.opt.step()
        self.opt.zero_grad()
        self.p2p_bytes = self.mesh.ledger.since(before).get("pp", {}).get("send", 0.0)
        return slowest(self.mesh, time.perf_counter() - start), self.runner.last_timeline.bubble

    def mean_costs(self) -> dict[str, float]:
        """Mean duration of each action kind over all ranks, scaled to a whole rank (x v)."""
        timeline = self.runner.last_timeline
        costs = {}
        for kind in "FBIW":
            spans = [s.end - s.start for row in timeline.rows for s in row if s.action.kind == kind]
            if spans:
                costs[f"cost_{kind.lower()}"] = statistics.mean(spans) * timeline.v
        return costs


class TorchSide:
    def __init__(self, mesh: Any, args: argparse.Namespace, name: str, v: int):
        import torch
        from torch.distributed.pipelining import (
            PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
        )

        from plait.models.gpt.model import build_gpt
        from plait.parallel.pipeline.split import rank_stages, split_stages

        pp, rank = mesh.size("pp"), mesh.rank("pp")
        self.mesh = mesh
        self.stages = rank_stages(split_stages(build_gpt(model_config(args), 0), pp, virtual_stages=v), rank, pp)
        self.pipe = [PipelineStage(s, s.index, pp * v, mesh.device, group=mesh.group("pp")) for s in self.stages]
        self.busy: list[tuple[float, float]] = []
        for stage in self.pipe:
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, method, self._timed(getattr(stage, method)))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[name]
        self.schedule = kind(self.pipe if name == "interleaved" else self.pipe[0],
                             n_microbatches=args.microbatches, loss_fn=loss_fn)
        self.opt = torch.optim.AdamW(self.stages.parameters(), lr=1e-4)
        self.rank, self.pp = rank, pp

    def _timed(self, method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy.append((start, time.perf_counter()))
        return run

    def step(self, rows: Any) -> tuple[float, float]:
        import torch

        full = rows.flatten(0, 1)
        torch.distributed.barrier(group=self.mesh.group("pp"))
        self.busy.clear()
        start = time.perf_counter()
        kwargs = {"target": full[:, 1:]} if any(s.is_last for s in self.stages) else {}
        if self.rank == 0:
            self.schedule.step(full[:, :-1], **kwargs)
        else:
            self.schedule.step(**kwargs)
        self.opt.step()
        self.opt.zero_grad()
        elapsed = time.perf_counter() - start
        span = torch.tensor([max(end for _, end in self.busy) - start, sum(e - s for s, e in self.busy)])
        torch.distributed.all_reduce(span[:1], op=torch.distributed.ReduceOp.MAX, group=self.mesh.group("pp"))
        torch.distributed.all_reduce(span[1:], group=self.mesh.group("pp"))
        makespan, busy = span.tolist()
        return slowest(self.mesh, elapsed), 1 - busy / (self.pp * makespan)


def slowest(mesh: Any, seconds: float) -> float:
    import torch

    value = torch.tensor([seconds])
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mesh.group("pp"))
    return value.item()


def loss_fn(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model_config(args: argparse.Namespace) -> Any:
    import dataclasses

    from plait.models.gpt.config import get_preset

    return dataclasses.replace(get_preset(args.model), n_layers=args.layers, tie_embeddings=False)


def drive(args: argparse.Namespace) -> list[dict]:
    """Spawn one world per pipeline depth and collect rank 0's numbers."""
    return [run_world(__file__, pp, forwarded(args)) for pp in args.pp]


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--layers", str(args.layers), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--microbatches", str(args.microbatches),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
            "--schedules", *args.schedules]


def table(results: list[dict], args: argparse.Namespace) -> str:
    import torch

    lines = [
        "## Pipeline schedules: plait's runner vs torch.distributed.pipelining"
        + ("" if args.microbatches == DEFAULT_M else f", m = {args.microbatches}"),
        "",
        f"- command: `python benchmarks/pipeline.py {' '.join(forwarded(args))} --pp {' '.join(map(str, args.pp))}`",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Gloo, torch {torch.__version__}, "
        f"the cores shared by the ranks ({results[0]['threads']} thread(s) per rank at pp={results[0]['pp']})",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: `{args.model}` GPT with {args.layers} layers, untied embeddings; {args.microbatches} micro-batches "
        f"of {args.micro_batch} × {args.seq_len} tokens per step; median of {args.steps} steps after {args.warmup} "
        "warm-up, plait and torch alternating step by step",
        "- bubble: formula = textbook; simulated = `simulate` with the measured mean F/B/I/W times; "
        "measured = 1 − busy / (ranks × makespan) from per-action timestamps",
        f"- load average (1 min) when the run ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; other jobs "
        "share this machine, and pp = 4 puts 4 ranks on 2 cores",
        "",
        "| pp | schedule | m | bubble formula | simulated | plait measured | torch measured | plait s/step | "
        "torch s/step | plait / torch | mean action ms (plait) | peak in-flight rank 0 | "
        "p2p send bytes/step rank 0 (ledger) | sent bytes held at once, rank 0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(result["pp"], row) for result in results for row in result["rows"]]
    lines += ["", READING if args.microbatches == DEFAULT_M else ROUNDS_READING]
    return "\n".join(lines)


def _row(pp: int, row: dict) -> str:
    name = row["schedule"] + (f" v={row['v']}" if row["v"] > 1 else "")
    if "torch_s" in row:
        torch_cols = (f"{row['torch_bubble']:.1%} | {row['plait_s']:.3f} | {row['torch_s']:.3f} | "
                      f"{row['plait_s'] / row['torch_s']:.2f}")
    else:
        torch_cols = f"— | {row['plait_s']:.3f} | — | —"
    costs = " ".join(f"{k}={ms:.0f}" for k, ms in row["costs_ms"].items())
    return (f"| {pp} | {name} | {row['m']} | {row['formula']:.1%} | {row['simulated']:.1%} | "
            f"{row['plait_bubble']:.1%} | {torch_cols} | {costs} | {row['peak_inflight_rank0']} | "
            f"{row['p2p_bytes_rank0']:,.0f} | {row['peak_sent_rank0']:,.0f} |")


READING = """Reading it: the ledger column is exact (b·s·h·4 bytes per micro-batch per boundary each way:
one boundary for rank 0, three for rank 0 of an interleaved v=2 pipeline), and so is the
in-flight count (m for GPipe, p for 1F1B's rank 0, (v−1)p + 2(p−1) + 1 interleaved). Times
are not: the ranks share 2 busy cores, so an action runs slower while the other ranks compute
too, and a busy interval includes any time its process was descheduled. That is why the
measured bubble lands up to ~10 points either side of the formula, differently from run to run,
and why a smaller bubble (ZB-H1) does not give a shorter step here: its actions, F included, run slower
than 1F1B's because both ranks are busy at once more often. In one process, on this model, ZB-H1's
I + W costs 1.1-1.3 × B on this CPU ("ZB-H1's split backward" below: an autograd call per norm and a GEMM per linear in W, and what W makes again).
The last column is the most bytes of sent messages rank 0 held at once: a message goes once a
later one from its receiver shows it arrived (Gloo's sends say nothing until waited). Until
2026-12-02 every send was held to the step's end, the ledger's column whole."""

ROUNDS_READING = """Reading it: where pp does not divide m, plait's interleaved schedule spreads m over
⌊m/pp⌋ rounds of at least pp (plait.interleave; docs/pipeline.md): at m = 6 on 4 ranks one
round of 6, as torch's flexible Interleaved1F1B takes it (⌊m/pp⌋ rounds of one size, so it
refuses m = 9 on 4 ranks, which plait runs as 5 + 4). The in-flight count is the warm-up
for the largest round N and one more, (v−1)N + 2(p−1) + 1 on rank 0, but never more than
the step's m·v chunk-forwards: 12 here, every forward before the first backward. The
ledger's column is exact as in the m = 8 table; the times share 2 busy cores as there."""




def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="small")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=DEFAULT_M,
                        help="micro-batches a step; another count than the default writes its own section")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--schedules", nargs="+", default=[name for name, _ in SCHEDULES],
                        choices=[name for name, _ in SCHEDULES])
    args = parser.parse_args()
    finish("pipeline" if args.microbatches == DEFAULT_M else f"pipeline-m{args.microbatches}", args, worker, drive,
           table)

if __name__ == "__main__":
    main()
