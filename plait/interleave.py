"""The order in which a rank of an interleaved pipeline runs its chunks (Megatron's).

Torch-free and at the bottom, so that the schedule the runner executes
(plait/schedule/build.py) and the estimator that prices its peak of held
activations (plait/estimate/activations.py) read one definition of it.
"""

from __future__ import annotations


def unit(k: int, pp: int, v: int, backward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th forward (or backward, chunks reversed):
    micro-batches go in groups of pp, each group through chunk 0, then 1, ..."""
    group, within = divmod(k, pp * v)
    chunk = within // pp
    return group * pp + within % pp, (v - 1 - chunk) if backward else chunk


def rank_order(pp: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    """("F" or "B", micro-batch, chunk) in the order `rank` runs them.

    Enough forwards first to fill every later stage of this rank's chunks: (v-1) groups of
    pp for the later chunks, plus two per downstream rank (the forward and the backward that
    must cross it before this rank's first backward arrives); then one forward, one
    backward; then the backwards left."""
    total = m * v
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)

    def step(kind: str, k: int) -> tuple[str, int, int]:
        return (kind, *unit(k, pp, v, backward=kind == "B"))

    order = [step("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [step("F", warmup + i), step("B", i)]
    return order + [step("B", k) for k in range(total - warmup, total)]
