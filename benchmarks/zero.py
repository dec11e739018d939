"""ZeRO stages 0-3 (stage 3 with its gather options, and + offload) against torch DDP and
FSDP2: step time and memory.

    python benchmarks/zero.py                        # 2 and 4 processes; updates benchmarks/RESULTS.md
    python benchmarks/zero.py --nproc 2 --no-write   # print only
    python benchmarks/zero.py --train                # also plait train --zero 3 vs --zero 0, as users run it

Each variant trains alone in its own world, as a user's run does, from the same seed: a
step is forward + backward + AdamW, its time the slowest rank's, the figure the median of
the steps after warm-up. The variants take turns world by world, in alternating order over
`--rounds` rounds, and each row is the median of its rounds (the spread is printed), so
drift in the machine's load hits all alike. Each world also measures the rank's model
states (parameters, gradients, optimizer state: distinct storages, max over ranks)
against the ZeRO paper's formula. Peak memory comes from separate worlds, one per variant:
on a GPU the allocator's peak, on a CPU the resident set, sampled every millisecond while
training, above what it was just before the model was built (there with
MALLOC_MMAP_THRESHOLD_ fixed so freed tensors go back to the OS at once; the timing worlds
run with the C library's defaults, which that setting would slow by a third or more).
Building the model whole before sharding it is not counted.
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
from common import new_parser, torch_version, train_summary, write_section  # noqa: E402
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# variant: plait's layout fields (None: torch's own)
PLAIT = {"plait z0": {"zero": 0}, "plait z1": {"zero": 1}, "plait z2": {"zero": 2}, "plait z3": {"zero": 3},
         "plait z3 prefetch 0": {"zero": 3, "prefetch": 0}, "plait z3 prefetch 2": {"zero": 3, "prefetch": 2},
         "plait z3 keep": {"zero": 3, "reshard_after_forward": False},
         "plait z3+offload": {"zero": 3, "offload": True}}
VARIANTS = [*PLAIT, "torch DDP", "torch FSDP2"]


def build(name: str, mesh: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and optimizer of one variant, from the same seed."""
    import torch

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

    model = build_gpt(get_preset(args.model), 0)
    if name in PLAIT:
        plait.parallelize(model, mesh.with_layout(**PLAIT[name]), plait.ParallelConfig(bucket_mb=args.bucket_mb))
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
    """One variant alone: the median step time, the model states after a step, the traffic."""
    import torch

    import plait
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh()
    prepare_host(mesh.size("world"))
    model, optimizer = build(args.variant, mesh, args)
    generator = torch.Generator().manual_seed(mesh.rank("dp"))
    batch = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=generator)
    times, wire = [], {}
    for k in range(args.warmup + args.steps):
        before = mesh.ledger.snapshot()
        seconds = step(model, optimizer, batch)
        if k >= args.warmup:
            times.append(seconds)
        wire = mesh.ledger.since(before).get("dp", {})
    step_without_zero_grad(model, optimizer, batch)  # after a step, before zero_grad: what a step holds
    mine = torch.tensor(list(state_bytes(model, optimizer).values()), dtype=torch.float64)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    result = {"n": mesh.size("dp"), "params": sum(p.numel() for p in build_gpt_params(args)),
              "time": statistics.median(times), "states": dict(zip(("params", "grads", "optim"), map(int, mine.tolist()))),
              "wire": wire}
    mesh.close()
    return result


def step_without_zero_grad(model: Any, optimizer: Any, batch: Any) -> None:
    import torch.nn.functional as F

    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()


def build_gpt_params(args: argparse.Namespace) -> list[Any]:
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

    return list(build_gpt(get_preset(args.model), 0).parameters())


def peak_world(args: argparse.Namespace) -> dict[str, Any]:
    """One variant alone: its peak memory while training, above the memory before building it."""
    import torch

    import plait
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh()
    prepare_host(mesh.size("world"))
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

    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

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
PEAK_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors go back to the OS at once: an honest peak


def run_world(n: int, args: argparse.Namespace, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    return common_run_world(__file__, n, [*forwarded(args), *extra], env=env)


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--bucket-mb", str(args.bucket_mb)]


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant alone in its own world, `args.rounds` times in alternating order; then its peak."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for k in range(args.rounds):
        for name in VARIANTS if k % 2 == 0 else VARIANTS[::-1]:
            rounds[name].append(run_world(n, args, "--variant", name))
    row = {"n": n, "params": rounds[VARIANTS[0]][0]["params"], "time": {}, "spread": {}, "states": {}, "wire": {}}
    for name, results in rounds.items():
        times = [r["time"] for r in results]
        row["time"][name], row["spread"][name] = statistics.median(times), (min(times), max(times))
        row["states"][name], row["wire"][name] = results[0]["states"], results[0]["wire"]
    row["peak"] = {v: run_world(n, args, "--variant", v, "--peak", env=PEAK_ENV)["peak"] for v in VARIANTS}
    return row


def trained(n: int, args: argparse.Namespace, *flags: str) -> float:
    """`plait train`'s median step time (summary.json) on the benchmark's shapes."""
    return train_summary(["--model", args.model, "--nproc", str(n), "--micro-batch", str(args.micro_batch),
                          "--seq-len", str(args.seq_len), "--steps", str(args.train_steps), "--bucket-mb",
                          str(args.bucket_mb), "--no-report", *flags])["step_time_s_median"]


TRAIN_RUNS = {"--zero 0": [], "--zero 3": ["--zero", "3"],
              "--zero 3 --reshard-after-forward false": ["--zero", "3", "--reshard-after-forward", "false"]}


def train_rows(n: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Each `plait train` run `args.rounds` times, alternating: {flags: [median step seconds]}."""
    out: dict[str, list[float]] = {name: [] for name in TRAIN_RUNS}
    for k in range(args.rounds):
        for name in TRAIN_RUNS if k % 2 == 0 else list(TRAIN_RUNS)[::-1]:
            out[name].append(trained(n, args, *TRAIN_RUNS[name]))
    return out


def table(rows: list[dict[str, Any]], args: argparse.Namespace, command: str,
          train: dict[int, dict[str, list[float]]]) -> str:
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
        f"× {args.seq_len} tokens per rank, AdamW (fused), bucket {args.bucket_mb} MiB; time: each variant alone in "
        f"its own world, median of {args.steps} steps after {args.warmup} warm-up, median of {args.rounds} rounds "
        "(worlds in alternating order; spread = the rounds' lowest and highest); peak: separate worlds",
        f"- load average (1 min) when the run ended: {os.getloadavg()[0]:.1f}", "",
        "| N | variant | s/step | spread | vs torch DDP | vs plait z0 | vs FSDP2 | params MiB | grads MiB | optim MiB "
        "| formula MiB (p/g/o) | peak MiB | wire MiB/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ddp, z0, fsdp = row["time"]["torch DDP"], row["time"]["plait z0"], row["time"]["torch FSDP2"]
        for name in VARIANTS:
            states, wire = row["states"][name], sum(row["wire"].get(name, {}).values())
            choices = PLAIT.get(name, {"zero": 0 if name == "torch DDP" else 3})
            formula = model_states(row["params"], 0, Workload(dp=row["n"], zero=choices["zero"]),
                                   StateBytes(4, 4, 12 if "offload" in name else 8)).as_dict()
            low, high = row["spread"][name]
            t = row["time"][name]
            lines.append(
                f"| {row['n']} | {name} | {t:.3f} | {low:.3f}–{high:.3f} | {t / ddp:.2f} | {t / z0:.2f} | {t / fsdp:.2f} | "
                f"{states['params'] / mib:.2f} | {states['grads'] / mib:.2f} | {states['optim'] / mib:.2f} | "
                f"{'/'.join(f'{formula[k] / mib:.2f}' for k in ('params', 'grads', 'optim'))} | "
                f"{row['peak'][name] / mib:.1f} | {f'{wire / mib:.2f}' if name in PLAIT else 'n/a'} |")
    if train:
        lines += ["", f"`plait train` as users run it (`--model {args.model} --micro-batch {args.micro_batch} --seq-len "
                      f"{args.seq_len} --steps {args.train_steps} --no-report`, default measurement; median step time "
                      f"from summary.json, {args.rounds} rounds in alternating order), beside the benchmark's figure:", "",
                  "| N | flags | s/step (rounds) | vs --zero 0 | benchmark's ratio |", "|---|---|---|---|---|"]
        for n, runs in train.items():
            row = next(r for r in rows if r["n"] == n)
            base = statistics.median(runs["--zero 0"])
            bench = {"--zero 0": "plait z0", "--zero 3": "plait z3", "--zero 3 --reshard-after-forward false": "plait z3 keep"}
            for flags, times in runs.items():
                lines.append(f"| {n} | `{flags}` | {statistics.median(times):.3f} ({', '.join(f'{t:.3f}' for t in times)}) "
                             f"| {statistics.median(times) / base:.2f} | {row['time'][bench[flags]] / row['time']['plait z0']:.2f} |")
    return "\n".join(lines) + "\n" + READING


READING = """
Reading it: *params/grads/optim* are each rank's model states after a step (distinct
storages, local shards for FSDP2), next to the ZeRO paper's formula: they agree to the
byte. *offload* holds 12Ψ/N of optimizer memory on the host (fp32 master + m + v). On this
CPU host and device are the same memory, so its peak includes both. *peak* is the
resident set above what it was before the model was built, so it includes activations
(about the same for every variant) and transient buffers: stage 3's gathered units (1 +
prefetch of them; all of them for *keep*), and stage 2's whole gradients, which live one
bucket at a time. *wire* is plait's ledger: 2(N−1)/N·Ψ·4 bytes for stages 0-2 and for
stage 3 *keep* (`--reshard-after-forward false`: one gather per unit), 3(N−1)/N·Ψ·4 for
stage 3 (torch's collectives bypass it).

Why each variant runs alone: until 2026-11-25 this benchmark built all variants in one
world and ran them step by step in turns, with MALLOC_MMAP_THRESHOLD_=65536 set for the
whole run (the peak measurement needs it). Both inflated every step, and ZeRO-3's most. The
fixed threshold makes every tensor above 64 KiB a fresh mmap, zero-filled page by page on
first touch; ZeRO-3 allocates a unit's buffer at every gather, and Gloo copies each gather
and reduce-scatter through fresh buffers of its own. Seven models in turn also evict each
other's weights from the caches. Measured the same day, `small`, N = 2, each alone: torch
DDP 0.25 s and plait z3 0.31 s a step with the defaults, 0.39 s and 0.56 s with the fixed
threshold; in turns with it (this table on 2026-11-22), 0.92 s and 1.24 s. A user's run has neither, so neither does
this table. What remains of stage 3's cost over DDP on this machine is CPU work with no
spare core to hide on: Gloo's copies (two per all-gather, two per reduce-scatter, through
fresh buffers), the gather buffers' first touch, and the gradient's concatenation per
unit, about 40 ms of a 0.3 s step, profiled with torch.profiler. On a GPU those copies run
on the copy engine and the caching allocator reuses the buffers."""


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="times each variant's world runs")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--train", action="store_true", help="also time plait train --zero 3 vs --zero 0")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or "RANK" in os.environ:  # inside a world
        result = peak_world(args) if args.peak else time_world(args)
        if args.result and os.environ.get("RANK", "0") == "0":
            Path(args.result).write_text(json.dumps(result))
        return
    rows = [measure(n, args) for n in args.nproc]
    train = {n: train_rows(n, args) for n in args.nproc} if args.train else {}
    command = (f"python benchmarks/zero.py {' '.join(forwarded(args))} --rounds {args.rounds} --nproc "
               f"{' '.join(map(str, args.nproc))}" + (f" --train --train-steps {args.train_steps}" if args.train else ""))
    text = table(rows, args, command, train)
    print(text)
    if not args.no_write:
        write_section("zero", text)


if __name__ == "__main__":
    main()
