"""plait DDP vs torch DDP on the same ResNet: plain BatchNorm (both), and plait's SyncBN.

    python benchmarks/vision.py                 # 2 and 4 processes; updates benchmarks/RESULTS.md
    python benchmarks/vision.py --nproc 2 --steps 10 --model resnet18,width=16 --no-write

Each world builds three replicas from the same seed: plait DDP and torch DDP
(broadcast_buffers=True, torch's default) with plain BatchNorm, and plait DDP with --sync-bn
(torch's nn.SyncBatchNorm needs CUDA, so on CPU it has no torch counterpart). They alternate
step by step, so machine noise hits all alike. A step is forward + backward + AdamW on a
micro-batch of random 3×32×32 images per rank; its time is the slowest rank's. Ratios are
plait / torch DDP (below 1: plait is faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, run_world  # noqa: E402

RUNS = ("plait", "torch", "plait_sync_bn")


def worker(args: argparse.Namespace) -> None:
    """One rank: time the three replicas in alternation; rank 0 writes the medians."""
    import torch
    import torch.nn.functional as F

    import plait
    from plait.models.resnet.model import build_resnet
    from plait.models.resnet.config import get_resnet
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh()
    prepare_host(mesh.size("world"))
    config = get_resnet(args.model, in_channels=3, num_classes=10)
    replicas = {
        "plait": plait.parallelize(build_resnet(config, 0), mesh, plait.ParallelConfig()),
        "torch": torch.nn.parallel.DistributedDataParallel(build_resnet(config, 0)),
        "plait_sync_bn": plait.parallelize(build_resnet(config, 0), mesh, plait.ParallelConfig(sync_bn=True)),
    }
    optimizers = {name: (plait.build_optimizer(m, torch.optim.AdamW, lr=1e-4) if name != "torch"
                         else torch.optim.AdamW(m.parameters(), lr=1e-4)) for name, m in replicas.items()}
    generator = torch.Generator().manual_seed(mesh.rank("dp"))
    images = torch.randn(args.micro_batch, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (args.micro_batch,), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    for step in range(args.warmup + args.steps):
        for name in RUNS:
            start = time.perf_counter()
            F.cross_entropy(replicas[name](images), labels).backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            slowest = torch.tensor([time.perf_counter() - start])
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            if step >= args.warmup:
                times[name].append(slowest.item())
    if mesh.is_main:
        Path(args.result).write_text(json.dumps({
            "n": mesh.size("dp"), "params": sum(p.numel() for p in replicas["torch"].parameters()),
            **{name: statistics.median(t) for name, t in times.items()}}))
    mesh.close()


def drive(args: argparse.Namespace) -> list[dict]:
    return [run_world(__file__, n, forwarded(args)) for n in args.nproc]


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch)]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "## Vision: plait DDP vs torch DDP on a ResNet, plain BatchNorm and SyncBN",
        "",
        f"- command: `python benchmarks/vision.py {' '.join(forwarded(args))} --nproc {' '.join(map(str, args.nproc))}`",
        f"- machine: {machine()}, Gloo; shared with other heavy jobs while it ran (load average well above "
        "the core count): rerun the command on a quiet machine for numbers to rely on",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: `{args.model}` ({rows[0]['params'] / 1e6:.2f} M params), micro-batch {args.micro_batch} images "
        f"of 3×32×32 per rank; median of {args.steps} steps after {args.warmup} warm-up, the three alternating "
        "step by step. torch's nn.SyncBatchNorm refuses CPU modules, so SyncBN is compared with torch DDP's "
        "plain BatchNorm: the ratio is what synchronising the statistics costs",
        "",
        "| processes | plait s/step | torch s/step | plait / torch | plait SyncBN s/step | SyncBN / torch |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['n']} | {row['plait']:.3f} | {row['torch']:.3f} | {row['plait'] / row['torch']:.3f} | "
                     f"{row['plait_sync_bn']:.3f} | {row['plait_sync_bn'] / row['torch']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="resnet18,width=16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=16)
    finish("vision", parser.parse_args(), worker, drive, table)


if __name__ == "__main__":
    main()
