"""plait's all-reduce, all-gather and reduce-scatter on Gloo against torch.distributed's own, in
the same world, size by size.

    python benchmarks/gloo_collectives.py                   # 2 and 4 ranks, 1 KiB to 16 MiB
    python benchmarks/gloo_collectives.py --nproc 2 --no-write

Gloo runs the three as a segmented ring, many messages one after another; up to the sizes in
plait.runtime.comm.GLOO_BY_ALL_TO_ALL plait runs each as one all-to-all and a combine in rank
order. Each size is timed in turns (plait's op, then torch's, round after round), the median
of the slowest rank's seconds, so a slow stretch of the host lands on both. The ratio is
plait's time over torch's: below 1, plait's is faster. Sizes are the all-reduce's tensor, the
reduce-scatter's input and the all-gather's output.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, machine, new_parser, run_world  # noqa: E402

SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def worker(args) -> None:
    import json

    import torch
    import torch.distributed as dist

    import plait
    from plait.runtime import comm

    torch.set_num_threads(1)
    mesh = plait.init_mesh()
    axis, n = mesh.axis("world"), mesh.env.world_size
    rows = []
    for size in SIZES:
        elements = size // 4 // n * n
        full, shard = torch.ones(elements), torch.ones(elements // n)
        calls = {
            "all_reduce": (lambda: comm.all_reduce(full, axis), lambda: dist.all_reduce(full)),
            "all_gather": (lambda: comm.all_gather(full, shard, axis), lambda: comm._ALL_GATHER_ONE(full, shard)),
            "reduce_scatter": (lambda: comm.reduce_scatter(shard, full, axis),
                               lambda: comm._REDUCE_SCATTER_ONE(shard, full)),
        }
        for op in OPS:
            ours, theirs = calls[op]
            times = {"plait": [], "torch": []}
            for _ in range(args.rounds if size < 4 << 20 else max(3, args.rounds // 4)):
                for name, call in (("plait", ours), ("torch", theirs)):
                    comm.barrier(axis)
                    start = time.perf_counter()
                    call()
                    slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    times[name].append(slowest.item())
            rows.append({"op": op, "bytes": elements * 4, "plait_s": statistics.median(times["plait"]),
                         "torch_s": statistics.median(times["torch"]),
                         "by_all_to_all": comm._by_all_to_all(op, full)})
    if mesh.env.rank == 0:
        Path(args.result).write_text(json.dumps({"n": n, "rows": rows}))
    mesh.close()


def drive(args) -> list[dict]:
    return [run_world(__file__, n, ["--rounds", str(args.rounds)]) for n in args.nproc]


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def table(worlds: list[dict], args) -> str:
    lines = ["## Gloo's collectives: plait's against torch.distributed's", "",
             f"- command: `python benchmarks/gloo_collectives.py --nproc {' '.join(map(str, args.nproc))} "
             f"--rounds {args.rounds}`",
             f"- machine: {machine()}, Gloo over loopback, 1 thread per rank; date: {time.strftime('%Y-%m-%d')}",
             "- time: median over rounds of the slowest rank, plait's op and torch's taken in turns; ratio = "
             "plait / torch (below 1: plait faster); path: one all-to-all (a2a) or torch's own (ring)", "",
             "| op | n | size | path | plait ms | torch ms | ratio |", "|---|---|---|---|---|---|---|"]
    lines += [_line(world["n"], row) for world in worlds for row in world["rows"]]
    return "\n".join(lines)


def _line(n: int, row: dict) -> str:
    cells = [row["op"], n, _size(row["bytes"]), "a2a" if row["by_all_to_all"] else "ring",
             f"{row['plait_s'] * 1e3:.2f}", f"{row['torch_s'] * 1e3:.2f}", f"{row['plait_s'] / row['torch_s']:.2f}"]
    return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    finish("gloo-collectives", args, worker, drive, table)


if __name__ == "__main__":
    main()
