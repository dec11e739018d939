"""`plait train --compile` against eager, and against a plain torch loop compiled the same way.

    python benchmarks/compile.py                 # the demo's shapes; updates benchmarks/RESULTS.md
    python benchmarks/compile.py --no-write --steps 6

Every plait row is a `plait train` run as a user types it (the demo's model and shapes,
`--no-report`), eager and with `--compile`, under dp 2, ZeRO-3 × 2 and tp 2, and on one
process; its step time is summary.json's median, its compile time the first step's excess
over that median (summary.json: compile.seconds). Each compiled run starts from an empty
compile cache, and one more dp 2 run starts from the cache the first left, as a restarted
world does. The plain torch loop is the same model (plait's GPT built from the same seed)
trained in one process by a dozen lines: forward, cross-entropy, backward, clipping, fused
AdamW, each block's forward compiled with `torch.compile` as plait does; its tokens are
random, since reading data is not what is compared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, new_parser, publish, train_summary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"1 process": ["--nproc", "1"], "dp 2": ["--nproc", "2"], "ZeRO-3 × 2": ["--nproc", "2", "--zero", "3"],
           "tp 2": ["--nproc", "2", "--tp", "2"]}


def train(args: argparse.Namespace, flags: list[str], cache: str) -> dict[str, Any]:
    """One `plait train` run; its summary."""
    return train_summary(["--model", args.model, "--micro-batch", str(args.micro_batch), "--seq-len",
                          str(args.seq_len), "--steps", str(args.steps), "--no-report", *flags],
                         env={"TORCHINDUCTOR_CACHE_DIR": cache})


def plain_loop(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    """The plain torch loop, in this process's child (one process, the machine's threads)."""
    with tempfile.TemporaryDirectory() as cache:
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import compile as c; "
                f"import json; print(json.dumps(c.plain_worker({args.model!r}, {args.micro_batch}, {args.seq_len}, "
                f"{args.steps}, {compiled})))")
        proc = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": cache})
        return json.loads(proc.stdout.strip().splitlines()[-1])


def plain_worker(model_name: str, micro_batch: int, seq_len: int, steps: int, compiled: bool) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

    torch.manual_seed(0)
    model = build_gpt(get_preset(model_name), 0)
    if compiled:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    vocab = model.config.vocab_size
    times = []
    for _ in range(steps):
        batch = torch.randint(0, vocab, (micro_batch, seq_len + 1))
        start = time.perf_counter()
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    return {"step": median, "compile": max(0.0, times[0] - median) if compiled else 0.0}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, flags in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as cache:
            eager = train(args, flags, cache)
            compiled = train(args, [*flags, "--compile"], cache)
            again = train(args, [*flags, "--compile"], cache) if name == "dp 2" else None
        rows[name] = {"eager": eager["step_time_s_median"], "compiled": compiled["step_time_s_median"],
                      "compile": compiled["compile"], "again": again["compile"] if again else None}
    rows["plain torch"] = {"eager": plain_loop(args, False)["step"], **_plain_compiled(args)}
    return rows


def _plain_compiled(args: argparse.Namespace) -> dict[str, Any]:
    result = plain_loop(args, True)
    return {"compiled": result["step"], "compile": {"seconds": result["compile"], "graph_breaks": None}, "again": None}


def table(rows: dict[str, Any], args: argparse.Namespace) -> str:
    plain = rows["plain torch"]["compiled"]
    lines = [
        "## torch.compile: plait train --compile vs eager, and vs a plain torch loop", "",
        f"- command: `python benchmarks/compile.py --model {args.model} --micro-batch {args.micro_batch} "
        f"--seq-len {args.seq_len} --steps {args.steps}`",
        f"- machine: {machine()}, Gloo, Inductor's C++ backend ({os.environ.get('CXX', 'g++')})",
        f"- date: {datetime.date.today().isoformat()}; load average (1 min) when the run ended: {os.getloadavg()[0]:.1f}",
        f"- model: `{args.model}` GPT, the demo's shapes (micro-batch {args.micro_batch} × {args.seq_len} tokens per "
        f"rank), fp32, AdamW fused; step time: median of steps 2 to {args.steps} (the first compiles); "
        "compile: the first step's excess over the median, from an empty cache", "",
        "| layout | eager s/step | compiled s/step | compiled / eager | compile s | graph breaks | "
        "compile s, cache warm (a restart) | compiled vs plain torch compiled (1 process) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        breaks = row["compile"]["graph_breaks"]
        again = "" if row["again"] is None else f"{row['again']['seconds']:.1f}"
        versus = f"{row['compiled'] / plain:.2f}" if name in ("1 process", "plain torch") else ""
        lines.append(f"| {name} | {row['eager']:.3f} | {row['compiled']:.3f} | {row['compiled'] / row['eager']:.2f} | "
                     f"{row['compile']['seconds']:.1f} | {'n/a' if breaks is None else breaks} | {again} | {versus} |")
    return "\n".join(lines) + "\n" + READING


READING = """
Reading it: *compiled / eager* is what `--compile` buys on this machine's CPU cores, with
Inductor's C++ kernels (on a GPU, Triton's). *compile s* is paid once per world, in its
first step; a restarted world (or any run of the same shapes) finds the graphs in the
cache (`compile s, cache warm`). The last column holds plait's one-process compiled step
against the plain loop compiled the same way: what plait's trainer adds around the same
compiled blocks. Graph breaks are torch's own count (none inside a block here)."""


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    publish("compile", table(measure(args), args), args)


if __name__ == "__main__":
    main()
