"""Pipeline stages that run a transformers model's own forward: what they cost against the usual stage.

    python benchmarks/own_forward.py            # updates benchmarks/RESULTS.md
    python benchmarks/own_forward.py --steps 4 --no-write

A stage that runs the model's own forward (plait/models/hf/own_forward.py) makes, on every
stage, what the forward makes before its layers (the embedding's stand-in zeros, masks,
rotary angles), where the usual stage (models/hf/stages.py) makes only the masks and angles.
Both cut the same transformers Llama at pp 2 (1F1B), trained step by step in turns on the
same micro-batches from one seed: the ratio of their step times is the own forward's cost.
Their losses must agree (both train the one-process model).
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
from common import finish, machine, new_parser, run_world  # noqa: E402

VARIANTS = ("usual stage", "own forward")


def llama(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.heads // 2, max_position_embeddings=args.seq_len)
    return transformers.LlamaForCausalLM(config)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import plait
    from plait.models.hf.plans import DeclaredPlanAdapter
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh(pp=2, schedule="1f1b")
    prepare_host(1)
    runs = {}
    for name in VARIANTS:
        adapter = DeclaredPlanAdapter(own_forward=name == "own forward")
        stages = plait.parallelize(llama(args), mesh, plait.ParallelConfig(), adapter=adapter)
        runs[name] = (stages, plait.build_optimizer(stages, torch.optim.AdamW, lr=1e-3),
                      plait.PipelineRunner(stages, mesh, "1f1b"))
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, args.vocab, (args.microbatches * args.micro_batch, args.seq_len + 1), generator=generator)
    micro = rows.chunk(args.microbatches)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for k in range(args.warmup + args.steps):
        for name, (stages, optimizer, runner) in runs.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            loss = runner.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro], loss_fn)
            optimizer.step()
            optimizer.zero_grad()
            slowest = torch.tensor([time.perf_counter() - start])
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            losses[name].append(float(loss))
            if k >= args.warmup:
                times[name].append(slowest.item())
    if mesh.rank("pp") == 0:
        Path(args.result).write_text(json.dumps({"time": {n: statistics.median(t) for n, t in times.items()},
                                                 "losses": losses}))
    mesh.close()


def forwarded(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("layers", "hidden", "ffn", "heads", "vocab", "seq_len", "micro_batch", "microbatches", "steps", "warmup")]


def drive(args: argparse.Namespace) -> dict[str, Any]:
    return run_world(__file__, 2, forwarded(args))


def table(result: dict[str, Any], args: argparse.Namespace) -> str:
    usual, own = (result["time"][name] for name in VARIANTS)
    same = result["losses"][VARIANTS[0]] == result["losses"][VARIANTS[1]]
    lines = [
        "## Pipeline stages that run a transformers model's own forward vs the usual stage", "",
        f"- command: `python benchmarks/own_forward.py {' '.join(forwarded(args))}`",
        f"- machine: {machine()}, Gloo, 2 ranks sharing the cores (1 thread each)",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: transformers `LlamaForCausalLM`, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
        f"{args.heads} heads / {args.heads // 2} KV heads, vocabulary {args.vocab}, fp32; pp 2 (1F1B), "
        f"{args.microbatches} micro-batches of {args.micro_batch} × {args.seq_len} tokens a step, AdamW; median of "
        f"{args.steps} steps after {args.warmup} warm-up, the two variants taking turns step by step",
        f"- load average (1 min) when the run ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", "",
        "| stage | s/step | / usual stage |",
        "|---|---|---|",
        f"| usual stage (`models/hf/stages.py`: masks and angles by rule) | {usual:.3f} | 1.00 |",
        f"| own forward (`models/hf/own_forward.py`: the model's forward on a shell) | {own:.3f} | {own / usual:.2f} |",
        "",
        f"Losses of every step {'bitwise equal' if same else 'NOT equal'} between the two "
        f"({', '.join(f'{x:.5f}' for x in result['losses'][VARIANTS[0]][:3])}, ...). Reading it: the own forward "
        "redoes, on each later stage, what the forward does before its layers (zeros of the embedding's shape, the "
        "rotary angles, the mask), as the usual stage makes the angles and the mask; a stage's shell is built once. "
        "plait uses it only where the usual stage cannot give the model's logits (ALiBi, learned positions, OPT's "
        "layout...); `DeclaredPlanAdapter(own_forward=True)` asks for it everywhere.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    for name, default in (("layers", 4), ("hidden", 256), ("ffn", 688), ("heads", 8), ("vocab", 4096),
                          ("seq-len", 128), ("micro-batch", 2), ("microbatches", 8), ("steps", 8), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    finish("own-forward", args, worker, drive, table)


if __name__ == "__main__":
    main()
