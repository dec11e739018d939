"""fp32, bf16 and fp16 in plait against torch's own AMP under torch DDP; and the reduce dtype.

    python benchmarks/precision.py                        # 2 processes; updates benchmarks/RESULTS.md
    python benchmarks/precision.py --nproc 2 4 --steps 10 --no-write

Rows (fp32, bf16, fp16), per world of n processes, all built from the same seed:
- plait: the model held in that dtype, fp32 masters in `MasterOptimizer`, DDP buckets, the
  trainer's `StepGuard` (loss scale for fp16, the all-ranks finite check).
- torch: fp32 weights under `DistributedDataParallel`, `torch.autocast` to that dtype, and
  `torch.amp.GradScaler` for fp16: torch's recipe (its masters are the fp32 weights).
Step time is the median of the slowest rank, both alternating step by step. Memory per rank
is what each holds after a step (weights, gradients, optimizer state: distinct storages)
and the bytes its forward saves for backward. Zeroing the gradients is left out of the times.

Then the reduce dtype: on the first step's gradients of each rank, the relative error of the
all-reduced mean (bf16 or fp16 on the wire, or fp32 for the same 16-bit gradients) against
the float64 mean, the wire bytes per step from the ledger, and the loss after the run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, run_world  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16")


def _plait(precision: str, mesh: Any, args: argparse.Namespace, reduce_dtype: str = "") -> tuple[Any, Any, Any]:
    import torch

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt
    from plait.parallel.precision import StepGuard, param_dtype, reduce_dtype_of

    model = build_gpt(get_preset(args.model), 0).to(param_dtype(precision))
    plait.parallelize(model, mesh, plait.ParallelConfig(reduce_dtype=reduce_dtype_of(precision, reduce_dtype)))
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    return model, optimizer, StepGuard(precision, mesh.axis("world"), mesh.device, loss_scale=1024.0)


def _torch(precision: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch

    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

    model = torch.nn.parallel.DistributedDataParallel(build_gpt(get_preset(args.model), 0))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if precision == "fp16" else None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), scaler


def _plait_step(run: tuple, batch: Any, step: int, meter: Any) -> float:
    import math

    import torch.nn.functional as F

    model, optimizer, guard = run
    with meter.track(model):
        logits = model(batch[:, :-1])
    loss = guard.loss_fn(lambda lg, t: F.cross_entropy(lg.float().flatten(0, 1), t.flatten()))(logits, batch[:, 1:])
    loss.backward()
    guard.step(step, model, optimizer, loss.item(), math.inf)
    return loss.item()


def _torch_step(run: tuple, batch: Any, precision: str, meter: Any) -> float:
    import torch
    import torch.nn.functional as F

    model, optimizer, scaler = run
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with meter.track(model), torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item()


def _states(model: Any, optimizer: Any) -> int:
    from plait.bench.meter import model_state_bytes

    return sum(model_state_bytes(model, optimizer).values())


def time_rows(mesh: Any, args: argparse.Namespace, batch: Any) -> list[dict[str, Any]]:
    import torch

    from plait.bench.meter import ActivationMeter

    rows = []
    for precision in PRECISIONS:
        ours, theirs = _plait(precision, mesh, args), _torch(precision, args)
        meters = {"plait": ActivationMeter(), "torch": ActivationMeter()}
        times: dict[str, list[float]] = {"plait": [], "torch": []}
        states = {}
        for step in range(args.warmup + args.steps):
            for name in ("plait", "torch"):
                (ours if name == "plait" else theirs)[1].zero_grad()  # kept until now: measured below
                start = time.perf_counter()
                if name == "plait":
                    _plait_step(ours, batch, step, meters[name])
                else:
                    _torch_step(theirs, batch, precision, meters[name])
                slowest = torch.tensor([time.perf_counter() - start])
                torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
                if step >= args.warmup:
                    times[name].append(slowest.item())
        states["plait"], states["torch"] = _states(ours[0], ours[1]), _states(theirs[0], theirs[1])
        rows.append({"precision": precision, **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                     **{f"{k}_states": v for k, v in states.items()},
                     **{f"{k}_saved": m.peak for k, m in meters.items()}})
    return rows


def reduce_rows(mesh: Any, args: argparse.Namespace, batch: Any) -> list[dict[str, Any]]:
    """Error of the dp mean per reduce dtype, on the same local 16-bit gradients."""
    import torch

    from plait.parallel.data.sync import grad_sync, no_sync
    from plait.parallel.precision import DTYPES
    from plait.bench.meter import ActivationMeter

    rows = []
    for precision, reduce_dtype in (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp16", "fp32")):
        run = _plait(precision, mesh, args, reduce_dtype)
        model, sync = run[0], grad_sync(run[0])
        with no_sync(model):
            logits = model(batch[:, :-1])
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        exact = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        torch.distributed.all_reduce(exact)
        exact /= mesh.size("dp")
        before = mesh.ledger.snapshot()
        sync.sync_now()
        wire = mesh.ledger.since(before)["dp"]["all_reduce"]
        got = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        error = ((got - exact).norm() / exact.norm()).item()
        losses = []
        for step in range(args.steps):
            run[1].zero_grad()
            losses.append(_plait_step(run, batch, step, ActivationMeter()))
        rows.append({"precision": precision, "reduce": reduce_dtype, "error": error, "wire": wire,
                     "loss": losses[-1], "dtype": str(DTYPES[reduce_dtype])})
    return rows


def worker(args: argparse.Namespace) -> None:
    import torch

    import plait
    from plait.models.gpt.config import get_preset
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh()
    prepare_host(mesh.size("world"))
    config = get_preset(args.model)
    generator = torch.Generator().manual_seed(mesh.rank("dp"))
    batch = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator)
    result = {"n": mesh.size("dp"), "params": config.num_params(), "time": time_rows(mesh, args, batch),
              "reduce": reduce_rows(mesh, args, batch)}
    if mesh.is_main:
        Path(args.result).write_text(json.dumps(result))
    mesh.close()


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len)]


def drive(args: argparse.Namespace) -> list[dict]:
    return [run_world(__file__, n, forwarded(args)) for n in args.nproc]


def table(results: list[dict], args: argparse.Namespace) -> str:
    kib = 1024
    lines = [
        "## Precision: plait (16-bit weights, fp32 masters) vs torch AMP (autocast + GradScaler) under torch DDP",
        "",
        f"- command: `python benchmarks/precision.py {' '.join(forwarded(args))} --nproc "
        f"{' '.join(map(str, args.nproc))}`",
        f"- machine: {machine()}, Gloo; date: {datetime.date.today().isoformat()}",
        "- LOADED: taken while other jobs shared the 2 cores; rerun the command above on a quiet",
        "  machine before quoting the times (the memory and error columns do not depend on load)",
        f"- model: `{args.model}` GPT ({results[0]['params'] / 1e6:.2f} M params), micro-batch {args.micro_batch} × "
        f"{args.seq_len} tokens per rank; median of {args.steps} steps after {args.warmup} warm-up",
        "- plait's step also runs what its trainer runs after backward: the all-ranks finite check (one",
        "  tiny all-reduce) and the gradient norm; torch's step runs neither (GradScaler checks for",
        "  infs on its own rank only)",
        "",
        "| procs | precision | plait s/step | torch s/step | plait / torch | plait states KiB/rank | "
        "torch states KiB/rank | plait saved KiB | torch saved KiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for row in result["time"]:
            lines.append(f"| {result['n']} | {row['precision']} | {row['plait_s']:.3f} | {row['torch_s']:.3f} | "
                         f"{row['plait_s'] / row['torch_s']:.2f} | {row['plait_states'] / kib:,.0f} | "
                         f"{row['torch_states'] / kib:,.0f} | {row['plait_saved'] / kib:,.0f} | "
                         f"{row['torch_saved'] / kib:,.0f} |")
    lines += ["", "Reduce dtype: relative error of the dp mean of the same 16-bit gradients against the float64 "
              f"mean, wire bytes per step per rank (ledger), loss after {args.steps} steps", "",
              "| procs | precision | --reduce-dtype | relative error | wire bytes/step | loss |", "|---|---|---|---|---|---|"]
    for result in results:
        for row in result["reduce"]:
            lines.append(f"| {result['n']} | {row['precision']} | {row['reduce']} | {row['error']:.2e} | "
                         f"{row['wire']:,.0f} | {row['loss']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    finish("precision", parser.parse_args(), worker, drive, table)


if __name__ == "__main__":
    main()
