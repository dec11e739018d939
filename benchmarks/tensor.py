"""plait tensor parallelism vs torch.distributed.tensor.parallel: step time and activations.

    python benchmarks/tensor.py                  # tp 2 and 4; updates benchmarks/RESULTS.md
    python benchmarks/tensor.py --tp 2 --steps 5 --no-write

Each world (tp = number of processes) builds four copies of the same GPT from the same seed:
plait TP, plait TP + SP, torch TP (ColwiseParallel/RowwiseParallel, loss_parallel) and torch
TP + SP (SequenceParallel), and runs their steps in turn, so machine noise hits all alike. A
step is forward + vocab-parallel loss + backward + AdamW; its time is the slowest rank's.
Activations are the bytes autograd saves during one forward (deduplicated by storage,
parameters excluded), per rank, next to the one-process model and our formula for the blocks.
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
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_world, finish, new_parser  # noqa: E402
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("plait", "plait_sp", "torch", "torch_sp")
READING = """Reading it: the activations follow the accounting of docs/tensor.md (the whole forward adds
the embedding ids, the final norm and the head's input to the blocks' formula). Without SP
plait saves less by SwiGLU's product, which its block makes again for the down projection's
backward (plait/models/gpt/lean.py: gated_down) and torch's DTensor layers keep, f/t values a
token a block; with SP plait saves less again because, like Megatron-LM, it keeps each
region's input as its sequence chunk and re-gathers it in backward, where torch's
SequenceParallel keeps the all-gathered input (2·s·b·h·(1 − 1/t) more per layer; plait's
`regather=False` does the same). On time, plait's region ops are plain collectives on plain
tensors, while DTensor adds dispatch and sharding propagation to every op: a likely reason
for the gap on a model this small on a CPU (not profiled)."""


def bench_config(args: argparse.Namespace) -> Any:
    """`small` with 8 heads and 4 KV heads, so that tp = 4 splits whole heads."""
    from plait.models.gpt.config import get_preset

    return replace(get_preset("small"), n_heads=8, n_kv_heads=4, n_layers=args.layers)


def saved_bytes(model: Any, inputs: Any) -> int:
    """ActivationMeter's count (the model's weights and buffers apart), also for DTensor models
    (counting the plain tensors inside)."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain(t: Any) -> list[Any]:  # a DTensor holds its local shard; an async result, its buffer
        if not is_traceable_wrapper_subclass(t):
            return [t] if isinstance(t, torch.Tensor) else []
        return [inner for name in t.__tensor_flatten__()[0] for inner in plain(getattr(t, name))]

    params = {x.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers()) for x in plain(p)}
    seen: dict[int, int] = {}

    def pack(tensor: Any) -> Any:
        for x in plain(tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in params and storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs)
    return sum(seen.values())


def build(variant: str, config: Any, mesh: Any) -> tuple[Any, Any]:
    """(model, loss context) for one variant."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    from plait.models.gpt.model import build_gpt
    from plait.parallel.tensor.plan import apply_tensor_parallel
    from tests.worlds.tensor_common import build_native

    sp = variant.endswith("_sp")
    if variant.startswith("plait"):
        return apply_tensor_parallel(build_gpt(config, 0), mesh.axis("tp"), sp=sp), contextlib.nullcontext
    return build_native(config, mesh.device_mesh["tp"], sp), loss_parallel


def timed_steps(runs: dict[str, Any], inputs: Any, targets: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step (the slowest rank's) of each variant, the variants taking turns."""
    import torch
    import torch.nn.functional as F

    from plait.parallel.tensor.plan import tp_loss_fn

    optims = {v: torch.optim.AdamW(runs[v][0].parameters(), lr=1e-4) for v in VARIANTS}
    losses = {v: (tp_loss_fn(runs[v][0]) if v.startswith("plait") else
                  lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(args.warmup + args.steps):
        for v in VARIANTS:
            model, context = runs[v]
            start = time.perf_counter()
            with context():
                losses[v](model(inputs), targets).backward()
            optims[v].step()
            optims[v].zero_grad()
            slowest = torch.tensor([time.perf_counter() - start])
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            if step >= args.warmup:
                times[v].append(slowest.item())
    return times


def worker(args: argparse.Namespace) -> None:
    import torch

    import plait
    from plait.models.gpt.model import build_gpt
    from plait.estimate.activations import llama_layer_bytes
    from plait.estimate.layout import Workload
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh(tp=int(os.environ["WORLD_SIZE"]))
    prepare_host(mesh.size("world"))
    config, tp = bench_config(args), mesh.size("tp")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    runs = {v: build(v, config, mesh) for v in VARIANTS}
    times = timed_steps(runs, inputs, targets, args)
    result = {"tp": tp, "params": config.num_params(), "dense_act": saved_bytes(build_gpt(config, 0), inputs)}
    for v in VARIANTS:
        result[v] = statistics.median(times[v])
        result[v + "_act"] = saved_bytes(runs[v][0], inputs)
    for sp in (False, True):
        work = Workload(tp=tp, sp=sp and tp > 1, micro_batch=args.micro_batch, seq_len=args.seq_len, precision="fp32")
        block = llama_layer_bytes(config, work)
        result["formula_sp" if sp else "formula"] = config.n_layers * block
    if mesh.is_main:
        Path(args.result).write_text(json.dumps(result))
    mesh.close()


def drive(args: argparse.Namespace) -> list[dict]:
    return [run_world(__file__, tp, forwarded(args)) for tp in args.tp]


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len)]


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(rows: list[dict], args: argparse.Namespace) -> str:
    import torch

    lines = [
        "## Tensor parallelism: plait vs torch.distributed.tensor.parallel",
        "",
        f"- command: `python benchmarks/tensor.py {' '.join(forwarded(args))} --tp {' '.join(map(str, args.tp))}`",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Gloo, torch {torch.__version__}, "
        "the cores shared between the ranks (tp 4 oversubscribes 2 cores)",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: `small` with 8 heads / 4 KV heads, {args.layers} layers ({rows[0]['params'] / 1e6:.2f} M params), "
        f"micro-batch {args.micro_batch} × {args.seq_len} tokens, fp32, AdamW; median of {args.steps} steps after "
        f"{args.warmup} warm-up, the four variants taking turns step by step",
        "- activations: bytes saved for backward in one forward, per rank, MiB (one process: "
        f"{mib(rows[0]['dense_act'])}); formula = our per-block accounting × layers (blocks only)",
        f"- load average (1 min) when the run ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; other jobs "
        "share this machine, so absolute times are noisy: compare the ratios, taken step by step under the same load",
        "",
        "| tp | SP | plait s/step | torch s/step | plait / torch | plait act. | torch act. | formula (blocks) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for sp in ("", "_sp"):
            ours, theirs = row["plait" + sp], row["torch" + sp]
            lines.append(f"| {row['tp']} | {'yes' if sp else 'no'} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} | "
                         f"{mib(row['plait' + sp + '_act'])} | {mib(row['torch' + sp + '_act'])} | "
                         f"{mib(row['formula' + sp])} |")
    return "\n".join(lines + ["", READING])




def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    finish("tensor", parser.parse_args(), worker, drive, table)

if __name__ == "__main__":
    main()
