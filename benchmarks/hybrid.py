"""Hybrid sharding: plait's ZeRO-3 --dp-shard against torch FSDP2's HSDP (fully_shard on a
2-D mesh, replicate × shard), with plain ZeRO-3 and FSDP2 beside them: step time, model
states, and plait's wire bytes per axis against the formula.

    python benchmarks/hybrid.py                 # 4 processes, --dp-shard 2; updates benchmarks/RESULTS.md
    python benchmarks/hybrid.py --no-write

Each variant trains alone in its own world from the same seed, as benchmarks/zero.py runs
its variants (its `step`, `state_bytes` and world runner): the slowest rank's step, the
median after warm-up, the median of `--rounds` rounds in alternating order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero  # noqa: E402
from common import finish, new_parser, run_world, torch_version  # noqa: E402

# variant: (plait's layout fields, or None for torch's own; FSDP2's mesh: None = 1-D over dp)
VARIANTS = {"plait z3": {"zero": 3}, "plait z3 --dp-shard": {"zero": 3, "dp_shard": 0},
            "torch FSDP2": None, "torch FSDP2 HSDP": None}


def build(name: str, mesh: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

    model = build_gpt(get_preset(args.model), 0)
    if name.startswith("plait"):
        plait.parallelize(model, mesh, plait.ParallelConfig())
        return model, plait.build_optimizer(model, torch.optim.AdamW, lr=1e-4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n = mesh.size("dp")
    target = (init_device_mesh("cpu", (n // args.dp_shard, args.dp_shard), mesh_dim_names=("replicate", "shard"))
              if name.endswith("HSDP") else mesh.device_mesh["dp"])
    for block in model.blocks:
        fully_shard(block, mesh=target)
    fully_shard(model, mesh=target)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def time_world(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import plait
    from plait.runtime.env import prepare_host

    fields = dict(VARIANTS[args.variant] or {})
    if "dp_shard" in fields:
        fields["dp_shard"] = args.dp_shard
    mesh = plait.init_mesh(**fields)
    prepare_host(mesh.size("world"))
    model, optimizer = build(args.variant, mesh, args)
    batch = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=torch.Generator().manual_seed(mesh.rank("dp")))
    times, wire = [], {}
    for k in range(args.warmup + args.steps):
        before = mesh.ledger.snapshot()
        seconds = zero.step(model, optimizer, batch)
        if k >= args.warmup:
            times.append(seconds)
        wire = mesh.ledger.since(before)
    zero.step_without_zero_grad(model, optimizer, batch)  # what a step holds, gradients included
    mine = torch.tensor(list(zero.state_bytes(model, optimizer).values()), dtype=torch.float64)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    result = {"n": mesh.size("dp"), "params": sum(p.numel() for p in zero.build_gpt_params(args)),
              "time": statistics.median(times), "states": dict(zip(("params", "grads", "optim"), mine.tolist())),
              "wire": {axis: ops for axis, ops in wire.items() if axis.startswith("dp")}}
    mesh.close()
    return result


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batch",
            str(args.micro_batch), "--seq-len", str(args.seq_len), "--dp-shard", str(args.dp_shard)]


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for k in range(args.rounds):
        for name in list(VARIANTS) if k % 2 == 0 else list(VARIANTS)[::-1]:
            rounds[name].append(run_world(__file__, args.nproc, [*forwarded(args), "--variant", name]))
    return rounds


def formula(params: int, n: int, shard: int) -> dict[str, dict[str, float]]:
    """plait's ledger for ZeRO-3 --dp-shard, per axis and op (fp32, one micro-batch)."""
    psi = params * 4
    replicas = n // shard
    return {"dp_shard": {"reduce_scatter": (shard - 1) / shard * psi, "all_gather": 2 * (shard - 1) / shard * psi},
            "dp_replicate": {"all_reduce": 2 * (replicas - 1) / replicas * psi / shard}}


def table(rounds: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    mib = 2**20
    first = rounds["plait z3"][0]
    n, params = first["n"], first["params"]
    times = {name: statistics.median(r["time"] for r in results) for name, results in rounds.items()}
    lines = [
        "## Hybrid sharding: plait ZeRO-3 --dp-shard vs torch FSDP2 HSDP", "",
        f"- command: `python benchmarks/hybrid.py {' '.join(forwarded(args))} --rounds {args.rounds} --nproc {args.nproc}`",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Gloo, torch {torch_version()}; "
        f"{args.nproc} processes share the cores",
        f"- date: {datetime.date.today().isoformat()}; load average (1 min) at the end: {os.getloadavg()[0]:.1f}",
        f"- model: `{args.model}` GPT ({params / 1e6:.2f} M params, fp32), micro-batch {args.micro_batch} × "
        f"{args.seq_len} tokens per rank, AdamW; shard groups of {args.dp_shard} (HSDP: mesh replicate "
        f"{n // args.dp_shard} × shard {args.dp_shard}); each variant alone in its own world, median of "
        f"{args.steps} steps after {args.warmup} warm-up, median of {args.rounds} rounds", "",
        "| variant | s/step | rounds | vs its torch twin | params MiB | grads MiB | optim MiB |",
        "|---|---|---|---|---|---|---|"]
    twin = {"plait z3": "torch FSDP2", "plait z3 --dp-shard": "torch FSDP2 HSDP"}
    for name, results in rounds.items():
        states = results[0]["states"]
        ratio = f"{times[name] / times[twin[name]]:.2f}" if name in twin else ""
        each = ", ".join(f"{r['time']:.3f}" for r in results)
        lines.append(f"| {name} | {times[name]:.3f} | {each} | {ratio} | "
                     f"{states['params'] / mib:.2f} | {states['grads'] / mib:.2f} | {states['optim'] / mib:.2f} |")
    measured = rounds["plait z3 --dp-shard"][0]["wire"]
    lines += ["", "plait's ledger for `--dp-shard` (one step) against the formula:", "",
              "| axis | op | measured MiB | formula MiB |", "|---|---|---|---|"]
    for axis, ops in formula(params, n, args.dp_shard).items():
        for op, predicted in ops.items():
            lines.append(f"| {axis} | {op} | {measured.get(axis, {}).get(op, 0) / mib:.3f} | {predicted / mib:.3f} |")
    return "\n".join(lines) + "\n" + READING


READING = """
Reading it: with groups of N = 2 of 4 ranks each rank holds twice plain ZeRO-3's states
(1/2 instead of 1/4), exactly as FSDP2's HSDP does, and adds the replicas' all-reduce of its
shard. On one machine every link is the same loopback, so hybrid sharding can only cost a
little more here; what it buys is that its reduce-scatters and gathers stay inside a
node, and only the shard's all-reduce crosses the network (`plait estimate` prices each
axis on its own link). Each plait variant is compared with torch's twin in the same run.
"""


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    finish("hybrid", parser.parse_args(), worker, measure, table)


def worker(args: argparse.Namespace) -> None:
    """Inside a world: time the variant; rank 0 writes the result for the driver."""
    result = time_world(args)
    if args.result and os.environ.get("RANK", "0") == "0":
        Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
