"""What making SwiGLU's product again for the down projection's backward costs and saves.

    python benchmarks/lean_block.py                # small and a wider MLP, fp32, 24 steps each way
    python benchmarks/lean_block.py --steps 40 --no-write

plait's block keeps gate and up for the down projection's weight gradient and makes their
product again when that backward asks for it (plait/models/gpt/lean.py: gated_down); a block
of plain ops keeps the product too, as autograd does. Each row builds the same model twice,
one keeping the product, and takes one forward and backward step with each in turn, so both
see the host's pace alike: the step's median, and the bytes autograd holds for backward
(plait's ActivationMeter) beside the estimate's activations for the block as it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
import unittest.mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser  # noqa: E402

SHAPES = {"small (the demo's)": "small", "a 4h-wide MLP": "small,ffn_hidden=1536"}
BATCH, SEQ = 8, 128


def one_shape(spec: str, steps: int) -> dict:
    """Both forms of `spec`'s model, stepped in turn: their medians and what each keeps."""
    import torch
    import torch.nn.functional as F

    from plait.bench.meter import ActivationMeter
    from plait.estimate.activations import layer_bytes
    from plait.estimate.layout import Workload
    from plait.models.gpt import model as gpt_model
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.lean import product_kept

    config = get_preset(spec)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    forms = {name: (gpt_model.build_gpt(config, seed=0), ActivationMeter(), []) for name in ("made again", "kept")}

    def step(name: str) -> None:
        model, meter, times = forms[name]
        with unittest.mock.patch.object(gpt_model, "gated_down", product_kept) if name == "kept" else contextlib.nullcontext():
            start = time.perf_counter()
            with meter.track(model):
                logits = model(ids)
            F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)

    for _ in range(steps + 2):
        for name in forms:
            step(name)
    per_block = layer_bytes(config, Workload(micro_batch=BATCH, seq_len=SEQ))
    return {"spec": spec, "params": sum(p.numel() for p in forms["kept"][0].parameters()),
            "estimate": per_block * config.n_layers,
            **{name: {"s": statistics.median(times[2:]), "kept": meter.peak} for name, (_, meter, times) in forms.items()}}


def drive(args: argparse.Namespace) -> list[dict]:
    import torch

    torch.set_num_threads(2)
    return [{"name": name, **one_shape(spec, args.steps)} for name, spec in SHAPES.items()]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "## plait's block: SwiGLU's product made again for down's backward vs kept",
        "",
        f"- command: `python benchmarks/lean_block.py --steps {args.steps}`",
        f"- machine: {machine()}, one process, 2 threads",
        f"- date: {datetime.date.today().isoformat()}",
        f"- fp32, {BATCH} x {SEQ} tokens a step, forward + backward; the two forms of the same model stepped in "
        f"turn, {args.steps} steps each after 2, medians; bytes held for backward by plait's ActivationMeter "
        "(the blocks' and the head's logits), the estimate's for the blocks alone",
        "",
        "| model | params (M) | kept: step s | made again: step s | made again / kept | kept: MiB held | "
        "made again: MiB held | held, made again / kept | estimate's blocks, MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k, m = r["kept"], r["made again"]
        lines.append(f"| {r['name']} (`{r['spec']}`) | {r['params'] / 1e6:.1f} | {k['s']:.4f} | {m['s']:.4f} | "
                     f"{m['s'] / k['s']:.3f} | {k['kept'] / 2**20:.1f} | {m['kept'] / 2**20:.1f} | "
                     f"{m['kept'] / k['kept']:.3f} | {r['estimate'] / 2**20:.1f} |")
    lines += ["", "Made again, the product costs silu(gate), which the gate's own backward then reads rather "
              "than make its own, and one multiplication; kept, it is f values a token a block."]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    finish("lean-block", args, lambda a: None, drive, table)


if __name__ == "__main__":
    main()
