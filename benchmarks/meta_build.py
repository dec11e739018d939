"""Setup on 8 ranks: the model built whole on every rank, then split, vs built on the meta device.

    python benchmarks/meta_build.py                     # a 270 M-parameter GPT (16 layers, width 1024)
    python benchmarks/meta_build.py --model small --no-write

Each world builds plait's GPT from the seed and parallelizes it over one layout of 8 ranks,
once the old way (`build_gpt` whole on every rank, then `plait.parallelize`) and once the new
way (`build_deferred` on the meta device, then `parallelize(..., source=draw_named)`, which
fills only what the rank holds). Each rank reports its process peak (ru_maxrss) minus its
peak before building (torch and plait loaded: the "empty" process), the bytes of the
parameters it holds after the split (its share of the model states that setup makes), and
the setup's seconds. Both ways give the same weights (tests/test_deferred.py; the parity
matrix trains through the meta build).
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, new_parser, run_world  # noqa: E402

LAYOUTS = {
    "tp 2 × pp 2 × dp 2": {"dp": 2, "tp": 2, "pp": 2},
    "ZeRO-3 over dp 8": {"dp": 8, "zero": 3},
    "ZeRO-3 with --dp-shard 4": {"dp": 8, "zero": 3, "dp_shard": 4},
}
NPROC = 8
MODEL = "tiny,d_model=1024,n_layers=16,n_heads=16,n_kv_heads=16,ffn_hidden=2816,vocab_size=32000,max_seq_len=256"


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(args: argparse.Namespace) -> None:
    import torch

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt
    from plait.parallel.deferred import build_deferred
    from plait.runtime import comm
    from plait.runtime.env import prepare_host

    prepare_host(NPROC)
    mesh = plait.init_mesh(plait.Layout(**LAYOUTS[args.layout]))
    config = get_preset(args.model)
    comm.barrier(mesh.axis("world"))
    empty, start = _peak_mib(), time.perf_counter()
    if args.way == "whole":
        model = plait.parallelize(build_gpt(config, 0), mesh)
    else:
        meta, deferred = build_deferred(lambda: build_gpt(config, 0))
        model = plait.parallelize(meta, mesh, source=deferred.draw_named)
    seconds = time.perf_counter() - start
    held = {id(p): p for p in model.parameters()}
    mine = sum(p.numel() * p.element_size() for p in held.values()) / 2**20
    rows = torch.zeros(mesh.env.world_size, 3, dtype=torch.float64)  # each rank fills its row; summed
    rows[mesh.env.rank] = torch.tensor([_peak_mib() - empty, mine, seconds], dtype=torch.float64)
    comm.all_reduce(rows, mesh.axis("world"), purpose=comm.TELEMETRY)
    if mesh.is_main:
        Path(args.result).write_text(json.dumps({"rows": rows.tolist()}))
    mesh.close()


def drive(args: argparse.Namespace) -> dict:
    return {layout: {way: run_world(__file__, NPROC, ["--model", args.model, "--layout", layout, "--way", way])
                     for way in ("whole", "meta")} for layout in LAYOUTS}


def table(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "## Setup on the meta device: each rank allocates only its share (8 ranks)",
        "",
        f"- command: `python benchmarks/meta_build.py --model {args.model}`",
        f"- machine: {machine()}, Gloo, 8 processes on its cores",
        f"- date: {datetime.date.today().isoformat()}",
        "- per rank: process peak minus its peak before the build (MiB), the parameters it holds "
        "after the split (MiB), setup seconds; whole = `build_gpt` on every rank then `parallelize`, "
        "meta = `build_deferred` then `parallelize(source=...)`",
        "",
        "| layout | way | peak − empty, max over ranks | rank 0 | held, max over ranks | "
        "peak ÷ held (max) | setup s (max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, ways in results.items():
        for way, result in ways.items():
            rows = result["rows"]
            peak = max(r[0] for r in rows)
            held = max(r[1] for r in rows)
            ratio = max(r[0] / r[1] for r in rows if r[1] > 0)
            lines.append(f"| {layout} | {way} | {peak:,.0f} | {rows[0][0]:,.0f} | {held:,.0f} | {ratio:.2f} | "
                         f"{max(r[2] for r in rows):.1f} |")
    lines += ["", "Under ZeRO-3 the held parameters are the shards, filled a parameter at a time: no rank holds "
              "its share whole. What the meta peak holds beyond them: one tensor drawn whole (the 125 MiB "
              "embedding) and its part, and under tp the split check's copy (the embedding, the head and two "
              "blocks, 364 MiB), both freed before the first step."]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=("whole", "meta"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    finish("meta_build", args, worker, drive, table)


if __name__ == "__main__":
    main()
