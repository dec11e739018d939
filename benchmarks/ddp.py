"""plait DDP vs torch DDP: median step time on the same model, in the same run.

    python benchmarks/ddp.py                 # 2 and 4 processes; updates benchmarks/RESULTS.md
    python benchmarks/ddp.py --nproc 2 --steps 20 --model small --no-write

Each world builds both replicas from the same seed and alternates blocks of steps between
them, so machine noise hits both alike. A step is forward + backward + AdamW; its time is the
slowest rank's. The ratio is plait / torch (below 1: plait is faster).
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
from common import torch_version, run_world, finish, new_parser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    """One rank: time plait and torch DDP in alternating blocks; rank 0 writes the numbers."""
    import torch
    import torch.nn.functional as F

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh()
    prepare_host(mesh.size("world"))
    config = get_preset(args.model)
    ours = plait.parallelize(build_gpt(config, 0), mesh, plait.ParallelConfig(bucket_mb=args.bucket_mb))
    theirs = torch.nn.parallel.DistributedDataParallel(build_gpt(config, 0), bucket_cap_mb=args.bucket_mb)
    runs = {
        "plait": (ours, plait.build_optimizer(ours, torch.optim.AdamW, lr=1e-4)),
        "torch": (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4)),
    }
    generator = torch.Generator().manual_seed(mesh.rank("dp"))
    batch = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator)
    times: dict[str, list[float]] = {"plait": [], "torch": []}
    before = mesh.ledger.snapshot()
    for block in range(args.warmup + args.steps):
        for name, (model, opt) in runs.items():
            start = time.perf_counter()
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            slowest = torch.tensor([time.perf_counter() - start])
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            if block >= args.warmup:
                times[name].append(slowest.item())
    wire = mesh.ledger.since(before)["dp"]["all_reduce"] / (args.warmup + args.steps)
    if mesh.is_main:
        Path(args.result).write_text(json.dumps({
            "n": mesh.size("dp"), "params": config.num_params(), "wire_per_step": wire,
            "plait": statistics.median(times["plait"]), "torch": statistics.median(times["torch"]),
        }))
    mesh.close()


def drive(args: argparse.Namespace) -> list[dict]:
    """Spawn one world per process count and collect rank 0's numbers."""
    return [run_world(__file__, n, forwarded(args)) for n in args.nproc]


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--bucket-mb", str(args.bucket_mb)]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "## DDP: plait vs torch DistributedDataParallel",
        "",
        f"- command: `python benchmarks/ddp.py {' '.join(forwarded(args))} --nproc {' '.join(map(str, args.nproc))}`",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Gloo, torch {torch_version()}, "
        f"one thread per rank share of the cores",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: `{args.model}` GPT ({rows[0]['params'] / 1e6:.2f} M params), micro-batch {args.micro_batch} × "
        f"{args.seq_len} tokens per rank, bucket {args.bucket_mb} MiB; median of {args.steps} steps after "
        f"{args.warmup} warm-up, plait and torch alternating step by step",
        "",
        "| processes | plait s/step | torch s/step | plait / torch | wire bytes/step/rank (ledger) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['n']} | {row['plait']:.3f} | {row['torch']:.3f} | {row['plait'] / row['torch']:.3f} | "
                     f"{row['wire_per_step']:,.0f} |")
    return "\n".join(lines)






def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    finish("ddp", parser.parse_args(), worker, drive, table)

if __name__ == "__main__":
    main()
