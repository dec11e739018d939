"""Regional compilation: `torch.compile` on each block's forward, under every strategy.

Compiling block by block (torchtitan's choice) rather than the whole model keeps the
compiled graphs small and identical across blocks, so one compilation serves them all, and
keeps plait's machinery outside them: the strategies' module hooks (ZeRO-3's gathers,
the pipeline's stage calls) run around the block, in eager, because only the block's own
`forward` is replaced, not its `__call__`. What runs inside is the block's arithmetic and,
under tensor parallelism, its autograd Functions and their collectives. Recomputation inside
a block (`--recompute full` or `selective`) is torch's non-reentrant checkpoint, which Dynamo
traces as one higher-order op, so the block stays one graph; an autograd Function whose
backward calls `torch.autograd.grad` would break it (tests/test_recompute_compile.py).

Compiled graphs are cached on disk (`cache_dir`: Inductor's FX graph cache, under plait's
cache directory unless TORCHINDUCTOR_CACHE_DIR says otherwise), so a restarted world, or the
next run of the same shapes, loads them instead of compiling again. On a CPU, Inductor
writes C++ and needs a compiler; a machine without one gets one clear error before any
work. Evaluation and sampling run the blocks eagerly (`eager`): their shapes differ from
training's, and compiling them would cost more than it saves.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait import rules
from plait.errors import PlaitError
from plait.runtime.env import cache_root, cxx_compiler

COMPILED_ATTR = "plait_compiled"  # set on a block whose forward is compiled


def cache_dir() -> Path:
    """Where compiled graphs are kept: $TORCHINDUCTOR_CACHE_DIR, else plait's cache directory."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(given) if given else cache_root() / "inductor"


def apply_compile(blocks: list[nn.Module], device: torch.device) -> int:
    """Compile each block's forward in place (once); returns how many blocks were compiled."""
    if not blocks:
        raise PlaitError("--compile compiles the model's blocks, and this model has none that plait can find",
                         hint="give it an adapter naming its blocks (plait.parallel.seam), or drop --compile")
    rules.check_compile_toolchain(device.type, *cxx_compiler())
    # Inductor reads its cache directory from the environment when it first compiles; plait
    # names one that outlives /tmp (restarts find it), unless the user named another.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))
    for block in blocks:
        if not getattr(block, COMPILED_ATTR, False):
            block.forward = torch.compile(block.forward)  # the instance's forward: hooks stay outside
            setattr(block, COMPILED_ATTR, True)
    return len(blocks)


def is_compiled(model: nn.Module) -> bool:
    return any(getattr(m, COMPILED_ATTR, False) for m in model.modules())


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled blocks eagerly inside (evaluation, sampling); torch before 2.6 has no
    stance to set, and compiles them there too."""
    if not hasattr(torch.compiler, "set_stance"):
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def compile_stats() -> dict[str, Any]:
    """Graph breaks and graphs made so far in this process, and the FX cache's hits and misses."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    return {"graph_breaks": breaks, "break_reasons": dict(counters["graph_break"]),
            "graphs": counters["stats"].get("unique_graphs", 0),
            "cache_hits": counters["inductor"].get("fxgraph_cache_hit", 0),
            "cache_misses": counters["inductor"].get("fxgraph_cache_miss", 0)}
