"""--memory-limit GIB: refuse, before any process starts, a run the estimate says will not fit.

The figure is plait estimate's peak for the busiest rank (model states, activations, buffers,
fragmentation, and the largest transient of setup or of writing the outputs) on the run's own
layout and batch, the same one the closing report sets beside what the run measured. When it is over the limit, the hint names the smallest
context-parallel degree whose estimate fits: a long sequence is what one rank cannot hold.
Torch-free: it runs where `plait train` validates its options.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.errors import PlaitError

CP_TRIED = (2, 4, 8, 16)  # the degrees the hint may name, times the run's own cp

MemoryOf = Callable[[Any, Any], float]  # (config, layout) -> estimated device bytes per rank: the family's


def check_memory_limit(config: Any, memory: MemoryOf | None) -> None:
    """Refuse the run when its estimated memory per rank exceeds --memory-limit. `memory` is
    the family's price of a layout (plait.families.record.Family.memory); None: it has none."""
    if not config.memory_limit:
        return
    if memory is None:
        raise PlaitError(f"--memory-limit compares plait estimate's memory per rank, and it has no estimate "
                         f"for --model {config.model}", hint="drop --memory-limit")
    limit = config.memory_limit * 2**30
    mine = memory(config, config.layout)
    if mine <= limit:
        return
    fits = next((cp for cp in CP_TRIED if fitting(config, memory, cp * config.cp, limit)), None)
    hint = (f"add --cp {fits * config.cp} (--nproc {config.layout.world * fits}): each rank then holds "
            f"1/{fits * config.cp} of every sequence" if fits else "shorten --seq-len or --micro-batch, or use --zero")
    raise PlaitError(f"{config.layout.describe()} needs an estimated {mine / 2**30:.2f} GiB per rank, more than "
                     f"--memory-limit {config.memory_limit:g} GiB", hint=hint)


def fitting(config: Any, memory: MemoryOf, cp: int, limit: float) -> bool:
    """Whether the run at context-parallel degree `cp` is one plait trains and fits `limit`."""
    try:
        return memory(config, config.layout.replace(cp=cp)) <= limit
    except PlaitError:  # a degree the model or the sequence cannot take
        return False
