"""`plait bench collectives`: every primitive, checked, counted and timed on this machine.

Like `plait train`, the command re-runs itself as N ranks; rank 0 is in every group
(groups are ranks 0..n-1), so it holds every result and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from plait.errors import CommandParser, PlaitError, check_writable_file
from plait.runtime.env import check_backend_name
from plait.estimate.collectives import PRIMITIVES, size_range


def collectives_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="plait bench collectives",
        description="Broadcast, scatter, reduce, gather, all-gather, reduce-scatter, all-reduce and "
                    "send/recv on groups of 2, 4, ... N ranks: each result checked exactly, the ledger's "
                    "bytes against the formula, time, algbw and busbw (nccl-tests' definitions) per size.")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (the largest group)")
    parser.add_argument("--sizes", default="1K:16M", help="MIN:MAX bytes per buffer, e.g. 1K:256M")
    parser.add_argument("--factor", type=int, default=4, help="each size is this times the last")
    parser.add_argument("--groups", help="group sizes, e.g. 2,4 (default: powers of two up to N, and N)")
    parser.add_argument("--ops", default=",".join(PRIMITIVES), help="subset of: " + ", ".join(PRIMITIVES))
    parser.add_argument("--iters", type=int, default=0, help="timed calls per op and size (0: 3 to 20 by size)")
    parser.add_argument("--backend", default="auto", help="auto (nccl with CUDA, else gloo), nccl, gloo")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", help="also write the JSON results to this file")
    parser.add_argument("--plot", metavar="PNG", help="draw busbw against size (needs matplotlib)")
    parser.add_argument("--corrupt", default="", help="self-test: spoil these ops' results on the "
                        "last rank, to see the check fail (comma list, or 'all')")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _options(argv: list[str]) -> argparse.Namespace:
    args = collectives_parser().parse_args(argv)
    try:
        args.size_list = size_range(args.sizes, args.factor)
        args.group_list = [int(g) for g in args.groups.split(",")] if args.groups else None
    except ValueError:
        raise PlaitError(f"bad --sizes {args.sizes!r} / --factor {args.factor} / --groups {args.groups!r}",
                         hint="sizes like 1K:256M, a factor of 2 or more, groups like 2,4") from None
    args.op_list = tuple(o for o in args.ops.split(",") if o)
    args.corrupt_list = PRIMITIVES if args.corrupt == "all" else tuple(filter(None, args.corrupt.split(",")))
    for op in (*args.op_list, *args.corrupt_list):
        if op not in PRIMITIVES:
            raise PlaitError(f"unknown op {op!r}", hint=f"choose from: {', '.join(PRIMITIVES)}")
    if args.iters < 0:
        raise PlaitError(f"--iters {args.iters}: give 0 (3 to 20 by size) or more", hint="e.g. --iters 10")
    check_backend_name(args.backend)
    if args.out:
        check_writable_file(args.out, "--out")
    if args.nproc < 2 or any(g < 2 or g > args.nproc for g in args.group_list or []):
        raise PlaitError(f"--nproc {args.nproc} / --groups {args.groups}: a group needs 2 to N ranks",
                         hint="give --nproc 2 or more, and group sizes between 2 and it")
    return args


def bench_main(argv: list[str]) -> int:
    """`plait bench SUBCOMMAND ...`."""
    if not argv or argv[0] != "collectives":
        raise PlaitError(f"unknown bench {argv[0] if argv else ''!r}", hint="try: plait bench collectives --nproc 2")
    args = _options(argv[1:])
    if "RANK" not in os.environ:
        from plait.runtime.launch import spawn

        return spawn([sys.executable, "-m", "plait", "bench", *argv], args.nproc)
    return _rank_main(args)


def _rank_main(args: argparse.Namespace) -> int:
    from plait.bench.collectives import bench_group
    from plait.runtime import comm
    from plait.runtime.mesh import init_mesh
    from plait.runtime.subgroups import first_ranks_axes, group_sizes
    from plait.runtime.env import prepare_host

    mesh = init_mesh(backend=args.backend)
    try:
        prepare_host(mesh.env.world_size)
        world = mesh.env.world_size
        axes = first_ranks_axes(group_sizes(world, args.group_list), mesh.ledger, mesh.global_rank, world)
        rows: list[dict[str, Any]] = []
        for axis in axes.values():
            if axis is not None:
                rows += bench_group(axis, args.size_list, args.op_list, args.corrupt_list, args.iters,
                                   mesh.device)
            comm.barrier(mesh.axis("world"))  # ranks outside this group wait here
        if mesh.is_main:
            _emit(rows, args, mesh.backend or "none")
        return 0
    finally:
        mesh.close()


def _emit(rows: list[dict[str, Any]], args: argparse.Namespace, backend: str) -> None:
    """Print (table or JSON), write, plot; then fail loudly if any result was wrong."""
    result = {"backend": backend, "nproc": args.nproc, "results": rows}
    text = json.dumps(result, indent=1)
    print(text if args.json else format_table(rows), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.plot:
        plot(rows, args.plot)
    wrong = [f"{r['op']} n={r['n']} {r['bytes']} B" for r in rows if not r["ok"]]
    if wrong:
        raise PlaitError(f"wrong results: {'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}",
                         hint="the collective returned something else than the exact answer: "
                              "check the backend and the network")


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'op':<15}{'n':>3}{'bytes':>11}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}"
             f"{'factor':>10}{'ledger=formula':>16}{'check':>7}"]
    for r in rows:
        same = abs(r["ledger_wire_bytes"] - r["formula_wire_bytes"]) < 0.5
        lines.append(f"{r['op']:<15}{r['n']:>3}{r['bytes']:>11}{r['time_s'] * 1e6:>11.1f}"
                     f"{r['algbw_gb_s']:>12.3f}{r['busbw_gb_s']:>12.3f}{r['busbw_factor_formula']:>10}"
                     f"{'yes' if same else 'NO':>16}{'ok' if r['ok'] else 'WRONG':>7}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """busbw against message size, one line per op and group size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlaitError("--plot needs matplotlib", hint="pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for key in sorted({(r["op"], r["n"]) for r in rows}):
        mine = [r for r in rows if (r["op"], r["n"]) == key]
        ax.plot([r["bytes"] for r in mine], [r["busbw_gb_s"] for r in mine], marker="o", label=f"{key[0]} n={key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
