"""Cut a run of weighted items into contiguous parts whose heaviest part is as light as it can be.

Torch-free and model-free: the pipeline cuts a model's blocks into stages with it
(plait/parallel/pipeline/split.py), and the estimator predicts that same cut
(plait/estimate/layout.py), so both agree on which rank holds which block.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


def balanced_counts(costs: Sequence[int], parts: int, *, first_extra: int = 0,
                    last_extra: int = 0) -> list[int]:
    """Blocks per stage for contiguous stages minimising the largest stage cost.

    Linear partition by dynamic programming (n·parts·n steps: n is a few dozen layers).
    Ties go to the split whose block counts are most even, so equal layers split evenly, and
    then to the smallest counts in order. The planner asks for the same cuts many times over
    (a published 126-layer model on 64 stages is 250 thousand steps): each is made once.
    """
    return list(_balanced(tuple(costs), parts, first_extra, last_extra))


@lru_cache(maxsize=1024)
def _balanced(costs: tuple[int, ...], parts: int, first_extra: int, last_extra: int) -> tuple[int, ...]:
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    last = parts - 1
    # best[k][i]: (largest stage cost, spread of counts, fewest, most, counts) for blocks[:i] in k + 1 stages
    best: list[dict[int, tuple[int, int, int, int, tuple[int, ...]]]] = [{} for _ in range(parts)]
    for i in range(1, n - parts + 2):
        best[0][i] = (prefix[i] + first_extra + (last_extra if last == 0 else 0), 0, i, i, (i,))
    growing = all(cost >= 0 for cost in costs)  # then a best split's worst part grows with the blocks it cuts
    for k in range(1, parts):
        extra = last_extra if k == last else 0
        before = best[k - 1]
        for i in range(k + 1, n - parts + k + 2):
            key: tuple[int, int] | None = None
            tied: list[tuple[int, int, int]] = []
            for j in range(k, i):
                worst, _, fewest, most, _ = before[j]
                if growing and key is not None and worst > key[0]:
                    break  # every later j's first k stages are as heavy at least
                size = i - j
                fewest, most = min(fewest, size), max(most, size)
                scored = (max(worst, prefix[i] - prefix[j] + extra), most - fewest)
                if key is None or scored < key:
                    key, tied = scored, [(j, fewest, most)]
                elif scored == key:
                    tied.append((j, fewest, most))
            # equal on both: the smallest counts in order, as a comparison of the whole lists would pick
            counts, fewest, most = min((before[j][4] + (i - j,), fewest, most) for j, fewest, most in tied)
            best[k][i] = (*key, fewest, most, counts)
    return best[last][n][4]
