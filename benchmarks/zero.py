"""ZeRO stages 0-3 (and stage 3 + offload) against torch DDP and FSDP2: step time and memory.

    python benchmarks/zero.py                        # 2 and 4 processes; updates benchmarks/RESULTS.md
    python benchmarks/zero.py --nproc 2 --no-write   # print only
    plait launch --nproc 4 benchmarks/zero.py        # one world: time and model states, printed

Per process count, one world builds every variant from the same seed and runs them step by
step in turn, so machine noise hits all alike (a step is forward + backward + AdamW; its time
is the slowest rank's), and measures each rank's model states (parameters, gradients,
optimizer state: distinct storages, max over ranks) against the ZeRO paper's formula. Then
each variant runs alone in its own world for its peak memory: on a GPU the allocator's peak,
on a CPU the resident set, sampled every millisecond while training, above what it was just
before the model was built (with MALLOC_MMAP_THRESHOLD_ fixed so freed tensors go back to
the OS at once). Building the model whole before sharding it is not counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_world as common_run_world  # noqa: E402
from common import new_parser, torch_version, write_section  # noqa: E402
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["plait z0", "plait z1", "plait z2", "plait z3", "plait z3+offload", "torch DDP", "torch FSDP2"]


def build(name: str, mesh: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and optimizer of one variant, from the same seed."""
    import torch

    import plait
    from plait.models.config import get_preset
    from plait.models.gpt import build_gpt

    model = build_gpt(get_preset(args.model), 0)
    if name.startswith("plait"):
        stage, offload = int(name[7]), name.endswith("offload")
        plait.parallelize(model, mesh.with_layout(zero=stage, offload=offload), plait.ParallelConfig(bucket_mb=args.bucket_mb))
        return model, plait.build_optimizer(model, torch.optim.AdamW, lr=1e-4)
    if name == "torch DDP":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh.device_mesh["dp"])
        fully_shard(model, mesh=mesh.device_mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: Any, optimizer: Any, batch: Any) -> float:
    """One training step; returns the slowest rank's seconds."""
    import torch
    import torch.nn.functional as F

    start = time.perf_counter()
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    slowest = torch.tensor([time.perf_counter() - start])
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return slowest.item()


def state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """Parameters, gradients, optimizer state held by this rank (distinct storages; local shards)."""
    import torch

    from plait.parallel.zero.optim import ZeroOptimizer, zero_state_bytes

    if isinstance(optimizer, ZeroOptimizer):
        return zero_state_bytes(model, optimizer)

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def total(tensors: list[Any]) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in map(local, tensors)}.values())

    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    return {"params": total(params), "grads": total([p.grad for p in params if p.grad is not None]),
            "optim": total(states)}


def time_world(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant in turn, step by step; rank 0 returns medians, model states and traffic."""
    import torch

    import plait
    from plait.runtime.env import set_cpu_threads

    mesh = plait.init_mesh()
    set_cpu_threads(mesh.size("world"))
    runs = {name: build(name, mesh, args) for name in VARIANTS}
    generator = torch.Generator().manual_seed(mesh.rank("dp"))
    batch = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    wire: dict[str, dict[str, float]] = {}
    for block in range(args.warmup + args.steps):
        for name, (model, optimizer) in runs.items():
            before = mesh.ledger.snapshot()
            seconds = step(model, optimizer, batch)
            if block >= args.warmup:
                times[name].append(seconds)
            wire[name] = mesh.ledger.since(before).get("dp", {})
    states = {}
    for name, (model, optimizer) in runs.items():  # after a step, before zero_grad: what a step holds
        step_without_zero_grad(model, optimizer, batch)
        mine = torch.tensor(list(state_bytes(model, optimizer).values()), dtype=torch.float64)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
        states[name] = dict(zip(("params", "grads", "optim"), map(int, mine.tolist())))
    result = {"n": mesh.size("dp"), "params": sum(p.numel() for p in build_gpt_params(args)),
              "time": {k: statistics.median(v) for k, v in times.items()}, "states": states, "wire": wire}
    mesh.close()
    return result


def step_without_zero_grad(model: Any, optimizer: Any, batch: Any) -> None:
    import torch.nn.functional as F

    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()


def build_gpt_params(args: argparse.Namespace) -> list[Any]:
    from plait.models.config import get_preset
    from plait.models.gpt import build_gpt

    return list(build_gpt(get_preset(args.model), 0).parameters())


def peak_world(args: argparse.Namespace) -> dict[str, Any]:
    """One variant alone: its peak memory while training, above the memory before building it."""
    import torch

    import plait
    from plait.runtime.env import set_cpu_threads

    mesh = plait.init_mesh()
    set_cpu_threads(mesh.size("world"))
    warm_up_runtime()
    sampler = RssSampler()
    model, optimizer = build(args.variant, mesh, args)
    batch = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1))
    with sampler:
        for _ in range(args.warmup):
            step(model, optimizer, batch)
    peak = torch.tensor([sampler.peak - sampler.base], dtype=torch.float64)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    mesh.close()
    return {"variant": args.variant, "peak": peak.item()}


def warm_up_runtime() -> None:
    """One step of a throwaway tiny model: kernels, thread pools and caches load now, not in the peak."""
    import gc

    import torch
    import torch.nn.functional as F

    from plait.models.config import get_preset
    from plait.models.gpt import build_gpt

    model = build_gpt(get_preset("tiny"), 0)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randint(0, 256, (2, 17))
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    del model, optimizer
    gc.collect()


class RssSampler:
    """Current resident set (or CUDA allocated) bytes, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.base = self.now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated()
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


# -- the driver ----------------------------------------------------------------------------------
def run_world(n: int, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    return common_run_world(__file__, n, [*forwarded(args), *extra], env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--bucket-mb", str(args.bucket_mb)]


def table(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    from plait.estimate.layout import Workload
    from plait.estimate.memory import StateBytes, model_states

    mib = 2**20
    lines = [
        "## ZeRO: plait stages 0-3 vs torch DDP and FSDP2", "",
        f"- command: `{command}`",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Gloo, torch {torch_version()}, the cores "
        "shared between the ranks (4 processes oversubscribe 2 cores)",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: `{args.model}` GPT ({rows[0]['params'] / 1e6:.2f} M params, fp32), micro-batch {args.micro_batch} "
        f"× {args.seq_len} tokens per rank, AdamW, bucket {args.bucket_mb} MiB; time: median of {args.steps} steps "
        f"after {args.warmup} warm-up, all variants taking turns step by step; peak: each variant alone",
        f"- load average (1 min) when the run ended: {os.getloadavg()[0]:.1f}", "",
        "| N | variant | s/step | vs torch DDP | params MiB | grads MiB | optim MiB | formula MiB (p/g/o) "
        "| peak MiB | wire MiB/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ddp = row["time"]["torch DDP"]
        for name in VARIANTS:
            states, wire = row["states"][name], sum(row["wire"].get(name, {}).values())
            stage = int(name[7]) if name.startswith("plait") else (0 if name == "torch DDP" else 3)
            formula = model_states(row["params"], 0, Workload(dp=row["n"], zero=stage),
                                   StateBytes(4, 4, 12 if "offload" in name else 8)).as_dict()
            peak = row.get("peak", {}).get(name)
            lines.append(
                f"| {row['n']} | {name} | {row['time'][name]:.3f} | {row['time'][name] / ddp:.2f} | "
                f"{states['params'] / mib:.2f} | {states['grads'] / mib:.2f} | {states['optim'] / mib:.2f} | "
                f"{'/'.join(f'{formula[k] / mib:.2f}' for k in ('params', 'grads', 'optim'))} | "
                f"{'' if peak is None else f'{peak / mib:.1f}'} | "
                f"{f'{wire / mib:.2f}' if name.startswith('plait') else 'n/a'} |")
    return "\n".join(lines) + "\n" + READING


READING = """
Reading it: *params/grads/optim* are each rank's model states after a step (distinct
storages, local shards for FSDP2), next to the ZeRO paper's formula: they agree to the
byte. *offload* holds 12Ψ/N of optimizer memory on the host (fp32 master + m + v). On this
CPU host and device are the same memory, so its peak includes both. *peak* is the
resident set above what it was before the model was built, so it includes activations
(about the same for every variant) and transient buffers: stage 3's gathered units, and
stage 2's whole gradients, which live one bucket at a time, and a 25 MiB bucket is most of
this model's 36 MiB of gradients. *wire* is plait's ledger: 2(N−1)/N·Ψ·4 bytes for stages
0-2, 3(N−1)/N·Ψ·4 for stage 3 (torch's collectives bypass it). Times come from a shared
2-core machine: compare the ratios, taken step by step under the same load. ZeRO's steps are
slower than DDP's here; a likely reason (not profiled) is that their extra work (copies
into and out of shards, per-unit gathers) cannot hide on two cores that also run the
collectives."""






def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or "RANK" in os.environ:  # inside a world
        result = peak_world(args) if args.variant else time_world(args)
        if args.result and os.environ.get("RANK", "0") == "0":
            Path(args.result).write_text(json.dumps(result))
        elif not args.result and os.environ.get("RANK", "0") == "0":
            print(table([result], args, f"plait launch --nproc {result['n']} benchmarks/zero.py"))
        return
    rows = []
    for n in args.nproc:
        row = run_world(n, args)
        row["peak"] = {v: run_world(n, args, "--variant", v)["peak"] for v in VARIANTS}
        rows.append(row)
    text = table(rows, args, f"python benchmarks/zero.py {' '.join(forwarded(args))} --nproc "
                             f"{' '.join(map(str, args.nproc))}")
    print(text)
    if not args.no_write:
        write_section("zero", text)


if __name__ == "__main__":
    main()
