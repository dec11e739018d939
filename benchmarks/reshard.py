"""plait checkpoints across layouts: save on one layout of 8 ranks, load on another.

    python benchmarks/reshard.py                  # small GPT with 8 heads (tp 4 needs 4 KV heads)
    python benchmarks/reshard.py --repeats 1 --no-write

Three layouts of 8 ranks hold the same model and AdamW state (built from the seed, then one
zero-learning-rate step so that every state tensor exists): (dp 8), (dp 2, tp 2, pp 2) with
ZeRO-3 and SP, and (tp 4, pp 2). Each saves its state `--repeats` times; then each loads
every layout's checkpoint. The bytes written show the format is layout-free (every logical
tensor once, whoever holds it). torch.distributed.checkpoint has no counterpart here: it
reshards DTensor state dicts, and plait's strategies hold plain tensors; the DP comparison
with DCP is benchmarks/checkpoint.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import disk_usage, finish, machine, new_parser, run_world, timed_on_all_ranks  # noqa: E402

LAYOUTS = {
    "dp8": {"dp": 8},
    "dp2·tp2·pp2 ZeRO-3 SP": {"dp": 2, "tp": 2, "pp": 2, "zero": 3, "sp": True},
    "tp4·pp2": {"tp": 4, "pp": 2},
}
NPROC = 8


def worker(args: argparse.Namespace) -> None:
    import torch

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt
    from plait.train.checkpoint import read as checkpoint_read, write as checkpoint
    from plait.runtime.env import prepare_host

    prepare_host(NPROC)  # as plait train does: 8 processes share the cores, one thread each here
    layout = LAYOUTS[args.layout]
    mesh = plait.init_mesh(plait.Layout(**layout))
    model = plait.parallelize(build_gpt(get_preset(args.model), 0), mesh)
    opt = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-4)
    checkpoint.init_optimizer_state(model, opt)
    world = mesh.axis("world")

    def timed(action) -> float:
        return timed_on_all_ranks(world, action)

    base = Path(args.dir)
    out: dict = {"layout": args.layout}
    if args.phase == "save":
        saves = [timed(lambda i=i: checkpoint.save(base / _slug(args.layout) / f"r{i}", 1, model, opt, mesh, {}))
                 for i in range(args.repeats)]
        out |= {"save_s": statistics.median(saves), "bytes": disk_usage(base / _slug(args.layout) / "r0")}
    else:
        out["load_s"] = {source: statistics.median(
            timed(lambda s=source, i=i: checkpoint_read.load(base / _slug(s) / f"r{i}", model, opt, mesh))
            for i in range(args.repeats)) for source in LAYOUTS}
    if mesh.is_main:
        Path(args.result).write_text(json.dumps(out))
    mesh.close()


def _slug(layout: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in layout)



def drive(args: argparse.Namespace) -> dict:
    base = Path(tempfile.mkdtemp(prefix="plait-reshard-bench-"))
    try:
        common = ["--model", args.model, "--repeats", str(args.repeats), "--dir", str(base)]
        saved = {name: run_world(__file__, NPROC, [*common, "--layout", name, "--phase", "save"]) for name in LAYOUTS}
        loaded = {name: run_world(__file__, NPROC, [*common, "--layout", name, "--phase", "load"]) for name in LAYOUTS}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"saved": saved, "loaded": loaded}


def table(results: dict, args: argparse.Namespace) -> str:
    names = list(LAYOUTS)
    lines = [
        "## Checkpoints across layouts (8 ranks)",
        "",
        f"- command: `python benchmarks/reshard.py --model {args.model} --repeats {args.repeats}`",
        f"- machine: {machine()}, Gloo, local disk, 8 processes on its cores",
        f"- date: {datetime.date.today().isoformat()}",
        f"- state: `{args.model}` with AdamW state; median of {args.repeats} saves, and of "
        f"{args.repeats} loads of each checkpoint",
        "",
        "| saved by | save s | bytes written | " + " | ".join(f"load into {n} s" for n in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for source in names:
        row = results["saved"][source]
        loads = " | ".join(f"{results['loaded'][target]['load_s'][source]:.3f}" for target in names)
        lines.append(f"| {source} | {row['save_s']:.3f} | {row['bytes']:,} | {loads} |")
    lines += ["", "Every layout writes the same logical tensors once (the bytes differ by index entries and "
              "RNG states). A load verifies each file's sha256 once between the ranks and assembles each "
              "block a rank needs from the pieces that overlap it: its cost follows what the loading layout "
              "holds per rank (dp 8 replicates everything, so every rank reads it all), not which layout wrote it."]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--model", default="small,n_heads=8,n_kv_heads=4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("save", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    finish("reshard", args, worker, drive, table)


if __name__ == "__main__":
    main()
