"""Process groups over the first n ranks, for measuring a collective at every group size.

Training builds its groups once, from the mesh; a benchmark or a calibration also wants a
2-rank, a 4-rank ... group out of the same world, to see how time grows with n. Every rank
must take part in creating each group (torch's rule), even ranks that will not be in it.
"""

from __future__ import annotations

import torch.distributed as dist

from plait.runtime.comm import Axis, Ledger


def group_sizes(world: int, asked: list[int] | None = None) -> list[int]:
    """The group sizes to measure: those asked for, else powers of two up to the world, and
    the world itself."""
    if asked:
        return sorted(set(asked))
    sizes, n = [], 2
    while n < world:
        sizes.append(n)
        n *= 2
    return sizes + [world] if world > 1 else []


def first_ranks_axes(sizes: list[int], ledger: Ledger, rank: int, world: int) -> dict[int, Axis | None]:
    """{n: this rank's Axis of the group of ranks 0..n-1, or None if the rank is outside it}."""
    out: dict[int, Axis | None] = {}
    for n in sizes:
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))
        out[n] = Axis(f"bench{n}", n, rank, group, ledger, rank) if rank < n else None
    return out


def tiled_axes(sizes: list[int], ledger: Ledger, rank: int, world: int) -> dict[int, Axis | None]:
    """{n: this rank's Axis of its group of n consecutive ranks}: the world cut into world/n
    groups, every rank in one, for timing a collective as training runs it, every group at
    once; None where n does not divide the world (that size is timed on no rank)."""
    out: dict[int, Axis | None] = {}
    for n in sizes:
        if n == world:
            out[n] = Axis(f"bench{n}", n, rank, dist.group.WORLD, ledger, rank)
            continue
        out[n] = None
        if world % n:
            continue
        for first in range(0, world, n):
            group = dist.new_group(list(range(first, first + n)))
            if first <= rank < first + n:
                out[n] = Axis(f"bench{n}", n, rank - first, group, ledger, rank)
    return out
