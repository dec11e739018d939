"""Cut a run of weighted items into contiguous parts whose heaviest part is as light as it can be.

Torch-free and model-free: the pipeline cuts a model's blocks into stages with it
(plait/parallel/pipeline/split.py), and the estimator predicts that same cut
(plait/estimate/layout.py), so both agree on which rank holds which block.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_counts(costs: Sequence[int], parts: int, *, first_extra: int = 0,
                    last_extra: int = 0) -> list[int]:
    """Blocks per stage for contiguous stages minimising the largest stage cost.

    Linear partition by dynamic programming (n·parts·n steps: n is a few dozen layers).
    Ties go to the split whose block counts are most even, so equal layers split evenly.
    """
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def cost_of(start: int, end: int, part: int) -> int:
        extra = (first_extra if part == 0 else 0) + (last_extra if part == parts - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[k][i]: (largest stage cost, spread of counts) for blocks[:i] in k + 1 stages.
    best: list[dict[int, tuple[tuple[int, int], list[int]]]] = [{} for _ in range(parts)]
    for i in range(1, n - parts + 2):
        best[0][i] = ((cost_of(0, i, 0), 0), [i])
    for k in range(1, parts):
        for i in range(k + 1, n - parts + k + 2):
            options = []
            for j in range(k, i):
                (worst, _), counts = best[k - 1][j]
                new = counts + [i - j]
                options.append(((max(worst, cost_of(j, i, k)), max(new) - min(new)), new))
            best[k][i] = min(options)
    return best[parts - 1][n][1]
