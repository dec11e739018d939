"""A transformers Llama under plait and under torch's own equivalents: step time.

    python benchmarks/hf.py                  # 2 processes; updates benchmarks/RESULTS.md
    python benchmarks/hf.py --no-write       # print only

One world of 2 ranks builds every variant of one `LlamaForCausalLM` (random weights, the
same seed) and runs them step by step in turn, so machine noise hits all alike (a step is
`model(input_ids=, labels=).loss`, backward, AdamW; its time is the slowest rank's):

| pair | plait                                              | torch                                   |
|------|----------------------------------------------------|-----------------------------------------|
| dp 2 | `parallelize(model, dp=2)`                         | `DistributedDataParallel`               |
| ZeRO-3 × 2 | `init_mesh(dp=2, zero=3)`                    | FSDP2 (`fully_shard` per layer, then the model) |
| tp 2 | `ParallelConfig(tp_plan=...)`, attention and MLP regions | `parallelize_module` with `ColwiseParallel` / `RowwiseParallel` |

The data-parallel pairs take half of the global batch per rank, the tensor-parallel pair
all of it. Each pair's first-step losses are compared too (the same model on the same data).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, run_world  # noqa: E402

READING = ("\n\nReading it: each pair trains the same model on the same data, so its first losses agree "
           "(a check that the comparison is fair, not a parity test: tests/test_hf_worlds.py is). The "
           "embedding and head stay whole in both tensor-parallel variants. plait's variants make the MLP's "
           "gated product again in backward (plait.parallelize gives a transformers model that forward), "
           "torch's keep it. Not profiled: the ratios say which is faster here, not why.")
PAIRS = [("plait dp 2", "torch DDP"), ("plait ZeRO-3 × 2", "torch FSDP2"), ("plait tp 2", "torch TP")]
LAYER = "model.layers.*"
PLAN = {f"{LAYER}.self_attn": "region", f"{LAYER}.mlp": "region",
        f"{LAYER}.self_attn.q_proj": "column", f"{LAYER}.self_attn.k_proj": "column",
        f"{LAYER}.self_attn.v_proj": "column", f"{LAYER}.self_attn.o_proj": "row",
        f"{LAYER}.mlp.gate_proj": "column", f"{LAYER}.mlp.up_proj": "column", f"{LAYER}.mlp.down_proj": "row"}


def llama(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                         max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def build(name: str, meshes: dict[str, Any], args: argparse.Namespace) -> tuple[Any, Any]:
    """One variant's model and optimizer."""
    import torch

    import plait

    model = llama(args)
    if name.startswith("plait"):
        config = plait.ParallelConfig(tp_plan=PLAN) if "tp" in name else plait.ParallelConfig()
        mesh = meshes["tp"] if "tp" in name else meshes["dp"].with_layout(zero=3 if "ZeRO" in name else 0)
        model = plait.parallelize(model, mesh, config)
        return model, plait.build_optimizer(model, torch.optim.AdamW, lr=1e-4)
    if name == "torch DDP":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif name == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=meshes["dp"].device_mesh["dp"])
        fully_shard(model, mesh=meshes["dp"].device_mesh["dp"])
    else:
        torch_tensor_parallel(model, meshes["tp"].device_mesh["tp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def torch_tensor_parallel(model: Any, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})


def step(model: Any, optimizer: Any, ids: Any) -> tuple[float, float]:
    """One training step: (the slowest rank's seconds, this rank's loss)."""
    import torch

    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    slowest = torch.tensor([time.perf_counter() - start])
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return slowest.item(), loss.item()


def worker(args: argparse.Namespace) -> None:
    import json

    import torch

    import plait
    from plait.runtime.env import prepare_host

    meshes = {"dp": plait.init_mesh(dp=2), "tp": plait.init_mesh(tp=2)}
    prepare_host(2)
    names = [name for pair in PAIRS for name in pair]
    runs = {name: build(name, meshes, args) for name in names}
    batch = torch.randint(0, args.vocab, (2 * args.micro_batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    half = batch[meshes["dp"].rank("dp") * args.micro_batch:][: args.micro_batch]
    times: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, float] = {}
    for k in range(args.warmup + args.steps):
        for name, (model, optimizer) in runs.items():
            seconds, loss = step(model, optimizer, batch if "tp" in name or "TP" in name else half)
            first.setdefault(name, loss)
            if k >= args.warmup:
                times[name].append(seconds)
    if meshes["dp"].is_main:
        params = sum(p.numel() for p in llama(args).parameters())
        Path(args.result).write_text(json.dumps({"time": {n: statistics.median(t) for n, t in times.items()},
                                                 "first_loss": first, "params": params}))
    meshes["tp"].close()
    meshes["dp"].close()


def forwarded(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("layers", "hidden", "ffn", "heads", "vocab", "seq_len", "micro_batch", "steps", "warmup")]


def drive(args: argparse.Namespace) -> dict[str, Any]:
    return run_world(__file__, 2, forwarded(args))


def table(result: dict[str, Any], args: argparse.Namespace) -> str:
    command = "python benchmarks/hf.py " + " ".join(forwarded(args))
    lines = [
        "## Hugging Face Llama: plait vs torch DDP, FSDP2 and tensor parallel", "",
        f"- command: `{command}`",
        f"- machine: {machine()}, Gloo, 2 ranks sharing the cores",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: transformers `LlamaForCausalLM`, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
        f"{args.heads} heads / {args.heads // 2} KV heads, vocabulary {args.vocab} ({result['params'] / 1e6:.2f} M "
        f"params, fp32), global batch {2 * args.micro_batch} × {args.seq_len} tokens, AdamW; median of {args.steps} "
        f"steps after {args.warmup} warm-up, all six variants taking turns step by step",
        f"- load average (1 min) when the run ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (the two "
        "ranks themselves make about 2); the ratios are taken step by step under the same load", "",
        "| layout | plait s/step | torch s/step | plait / torch | first loss plait | first loss torch |",
        "|---|---|---|---|---|---|",
    ]
    for ours, theirs in PAIRS:
        a, b = result["time"][ours], result["time"][theirs]
        lines.append(f"| {ours[6:]} vs {theirs} | {a:.3f} | {b:.3f} | {a / b:.2f} | "
                     f"{result['first_loss'][ours]:.5f} | {result['first_loss'][theirs]:.5f} |")
    return "\n".join(lines) + READING


def main() -> None:
    parser = new_parser(__doc__)
    for name, default in (("layers", 4), ("hidden", 256), ("ffn", 688), ("heads", 8), ("vocab", 4096),
                          ("seq-len", 128), ("micro-batch", 4), ("steps", 8), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    finish("hf", args, worker, drive, table)


if __name__ == "__main__":
    main()
