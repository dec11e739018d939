"""Context parallelism: memory per rank and step time at cp 1, 2 and 4, ring and Ulysses.

    python benchmarks/context.py                       # updates benchmarks/RESULTS.md
    python benchmarks/context.py --seq-lens 512 1024 --no-write

For each sequence length (doubling), plait's GPT (`small` with 8 heads / 4 KV heads, --layers
blocks) trains
--steps AdamW steps on one micro-batch of one sequence: in one process on every core, and
under cp = 2 and 4 (ring and Ulysses) with the cores split between the ranks (cp 4
oversubscribes a 2-core machine: its times are not comparable, its memory is). Per run:
- activations: the bytes autograd saves in one forward (ActivationMeter), the largest rank's,
  beside plait estimate's figure for the same layout;
- step time: the median step (forward, backward, the gradient all-reduce over dp × cp,
  AdamW), the slowest rank's, beside the estimate's on this machine's calibrated profile
  (the one `plait train` predicts with, measured per rank's thread count);
- the ring's balance: each rank's seconds inside the attention kernels (forward and
  backward, not waiting for a transfer), slowest over fastest; and the seconds spent waiting
  for transfers (the exposed ring).
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, run_world, time_calls  # noqa: E402

KINDS = ("ring", "ulysses")
READING = """Reading it: activations per rank are 1/cp of one process's and what cp adds, and the estimate
predicts every row to the 0.1 MiB shown. The ring keeps 1.004 of a 1/cp share: the rope rows
each forward gathers for its positions (its K/V stay grouped as SDPA keeps them; its output stays
in fp32 for the merge in backward, written sequence-major so that o_proj reads it as a view).
Ulysses keeps 1.068: o_proj keeps the output traded back to sequence shards (h values a token a
layer) beside SDPA's own on the head shards, and each block the two int64 reorderings of the
sequence. In the table this replaces (2026-11-25, when the blocks kept more) the ring was
0.957 and Ulysses 1.001 against a one-process figure that held the rope tables, the model's
buffers, which no meter counts now; and the ring's o_proj kept a copy of its output. The
head-tail split keeps the ranks' attention kernels within 1.3% of each other at cp 2 (cp 4's
ranks share 2 cores, so its balance and times measure the oversubscription too). Time: at
8,192 tokens cp 2 on two 1-thread ranks is 0.94-0.95 of one process on both cores; the ring's
exposed transfer (wait) stays a few percent of the step, and what cp 2 adds at short sequences
is mostly fixed cost: the gradient all-reduce over dp × cp, and AdamW over the whole model on
each rank's one thread (ZeRO over dp × cp would shard it). Step times on this shared machine
vary by ±10% from run to run; compare within a row."""


def model_config(args: argparse.Namespace, seq: int) -> Any:
    from dataclasses import replace

    from plait.models.gpt.config import get_preset

    return replace(get_preset("small"), n_heads=8, n_kv_heads=4, n_layers=args.layers, max_seq_len=seq)


class KernelClock:
    """Seconds this rank spends in the ring's attention kernels and in its transfer waits
    (the ring module's functions wrapped for the benchmark; nothing is changed for training)."""

    def __init__(self) -> None:
        from plait.parallel.context import ring

        self.kernels = self.waits = 0.0
        self._wrap(ring, "attend", "kernels")
        self._wrap(ring, "attend_backward", "kernels")
        self._wrap(ring._Pass, "wait", "waits")

    def _wrap(self, owner: Any, name: str, field: str) -> None:
        time_calls(owner, name, lambda seconds: setattr(self, field, getattr(self, field) + seconds))

    def reset(self) -> None:
        self.kernels = self.waits = 0.0


def one_run(args: argparse.Namespace, seq: int, cp: int, kind: str, clock: KernelClock) -> dict[str, float]:
    """Train `--steps` steps of one layout on this world; the slowest rank's numbers."""
    import torch
    import torch.nn.functional as F

    from plait.bench.machine import machine_hardware
    from plait.bench.meter import ActivationMeter
    from plait.layout import Layout
    from plait.models.gpt.model import build_gpt
    from plait.api import parallelize
    from plait.parallel.compose import build_optimizer
    from plait.parallel.context.plan import context_engaged, shard_batch
    from plait.runtime import comm
    from plait.runtime.mesh import init_mesh

    mesh = init_mesh(Layout(cp=cp, cp_kind=kind)) if cp > 1 else init_mesh(Layout())
    config = model_config(args, seq)
    model = parallelize(build_gpt(config, 0), mesh)
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = shard_batch(model, ids[:, :-1], ids[:, 1:])
    meter, times, kernels, waits, updates = ActivationMeter(), [], [], [], []
    for step in range(args.warmup + args.steps):
        clock.reset()
        start = time.perf_counter()
        with context_engaged(model):
            with meter.track(model):
                logits = model(inputs)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        update = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            updates.append(time.perf_counter() - update)
            kernels.append(clock.kernels)
            waits.append(clock.waits)
    mine = torch.tensor([statistics.median(times), float(meter.peak), statistics.median(kernels),
                         -statistics.median(kernels), statistics.median(waits), statistics.median(updates)],
                        dtype=torch.float64)
    if cp > 1:
        comm.all_reduce(mine, mesh.axis("world"), op="max")
    hardware, _ = machine_hardware(mesh, config, micro_batch=1, seq_len=seq, tp=1, precision="fp32",
                                optimizer_kernel="fused")
    return {"step_s": mine[0].item(), "activations": mine[1].item(), "kernel_max_s": mine[2].item(),
            "kernel_min_s": -mine[3].item(), "wait_s": mine[4].item(), "update_s": mine[5].item(),
            "predicted": predicted(config, seq, cp, kind if cp > 1 else "ring", hardware)}


def predicted(config: Any, seq: int, cp: int, kind: str, hardware: Any) -> dict[str, float]:
    """plait estimate's figures for the run, on this machine's calibrated profile (plait train's)."""
    from plait.estimate import estimate_layout

    result = estimate_layout(config, hardware=hardware, cp=cp, cp_kind=kind, micro_batch=1, seq_len=seq,
                             precision="fp32")
    return {"activations": result["memory"]["activations"], "step_s": result["time"]["step_s"],
            "cp_s": result["time"]["cp_s"]}


def worker(args: argparse.Namespace) -> None:
    from plait.runtime.env import prepare_host

    world = int(os.environ.get("WORLD_SIZE", "1"))
    prepare_host(world)
    clock = KernelClock()
    rows = []
    for seq in args.seq_lens:
        for kind in (KINDS if world > 1 else ("none",)):
            measured = one_run(args, seq, world, kind, clock)
            rows.append({"seq": seq, "cp": world, "kind": kind, **measured})
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(rows))


def drive(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for cp in args.cp:
        rows += run_world(__file__, cp, forwarded(args))
    return rows


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--seq-lens", *map(str, args.seq_lens)]


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def table(rows: list[dict], args: argparse.Namespace) -> str:
    one = {r["seq"]: r for r in rows if r["cp"] == 1}
    lines = [
        "## Context parallelism: memory per rank and step time at cp 1, 2, 4 (ring and Ulysses)",
        "",
        f"- command: `python benchmarks/context.py {' '.join(forwarded(args))} --cp {' '.join(map(str, args.cp))}`",
        f"- machine: {machine()}, Gloo; cp 1 runs one process on both cores, cp 2 one 1-thread rank per core, "
        "cp 4 four 1-thread ranks on 2 cores (oversubscribed: its times are not comparable, its memory is)",
        f"- date: {datetime.date.today().isoformat()}; load average (1 min) at the end: {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores",
        f"- model: `small` with 8 heads / 4 KV heads (so that Ulysses' cp 4 splits whole heads), {args.layers} "
        "layers, one sequence per step, fp32, "
        f"AdamW; median of {args.steps} steps after {args.warmup} warm-up",
        "- activations: bytes saved for backward in one forward, the largest rank's (MiB), and its share of one "
        "process's (goal: within 5% of 1/cp); predicted = plait estimate (activations; step time on this machine's calibrated profile, as plait train predicts)",
        "- kernel balance: slowest rank's seconds inside the attention kernels over the fastest's (goal ≤ 1.05); "
        "wait: seconds per step a rank waited for ring transfers (the exposed ring); AdamW: the update's seconds "
        "(every cp rank updates the whole model on its one thread, where cp 1 uses both cores)",
        "",
        "| seq | cp | kind | act. MiB | predicted | share × cp | s/step | predicted | vs cp 1 | kernel balance | "
        "wait s | AdamW s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["seq"], r["cp"], r["kind"])):
        base = one[r["seq"]]
        share = r["activations"] / base["activations"] * r["cp"]
        balance = r["kernel_max_s"] / r["kernel_min_s"] if r["kind"] == "ring" and r["kernel_min_s"] else None
        lines.append(f"| {r['seq']} | {r['cp']} | {r['kind']} | {mib(r['activations'])} | "
                     f"{mib(r['predicted']['activations'])} | {share:.3f} | {r['step_s']:.3f} | "
                     f"{r['predicted']['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
                     f"{'' if balance is None else f'{balance:.3f}'} | "
                     f"{r['wait_s']:.3f} | {r['update_s']:.3f} |" if r["kind"] == "ring" else
                     f"| {r['seq']} | {r['cp']} | {r['kind']} | {mib(r['activations'])} | "
                     f"{mib(r['predicted']['activations'])} | {share:.3f} | {r['step_s']:.3f} | "
                     f"{r['predicted']['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | | | "
                     f"{r['update_s']:.3f} |")
    return "\n".join(lines + ["", READING])


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    finish("context", parser.parse_args(), worker, drive, table)


if __name__ == "__main__":
    main()
