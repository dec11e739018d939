"""Elastic restarts: a run resumed on a world of another size trains the same model.

A checkpoint is layout-free and the sampler hands out the same global batch at every step
whatever the dp degree (plait.train.data.corpus), so a run that lost a node can continue on the
ranks it still has, and one given more can use them. What must not change is the global
batch: it is the optimizer's step. So when a resumed run's dp differs from its checkpoint's,

- tp, pp and the other choices stay as the flags give them, and dp follows the world
  (plait.layout.Layout.fill, as for any run);
- --grad-accum is recomputed so that micro-batch × grad-accum × dp is the checkpoint's
  global batch; a world on which no whole number of micro-batches does that is refused
  before any step, naming the world sizes that can.

Only the reduction order differs from the run that never changed size (the losses agree to
rounding). The same holds when only --micro-batch or --grad-accum changed: the global batch
is the checkpoint's whatever the flags say. What else decides which samples a step trains on,
the seed (it shuffles the data) and the sequence length (it cuts the samples), may change on
purpose (a longer context, another order after a loss spike), never silently: rank 0 says
that the samples from there on are another run's. Torch-free: the CLI checks a restart before
spawning, and the spawner asks `world_sizes` which smaller world it may restart on.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plait.errors import PlaitError
from plait.train.checkpoint.restart import read_index, resolve


@dataclass(frozen=True)
class SavedBatch:
    """What a checkpoint says of the run that wrote it: its world, dp, global batch, and the
    settings that decide its samples (SAMPLE_SETTINGS)."""

    path: Path
    world_size: int
    dp: int
    global_batch: int
    samples: dict[str, Any]
    step: int


# Besides the global batch, what decides the samples of each step (plait.train.data.corpus):
# the seed shuffles them, the sequence length cuts them.
SAMPLE_SETTINGS = ("seed", "seq_len")


def saved_batch(checkpoint: str | Path) -> SavedBatch | None:
    """The checkpoint's world and global batch, read from its index (None: written without
    the trainer's config, e.g. by the Python API's own save)."""
    path = resolve(checkpoint)
    index = read_index(path)
    saved = index.get("trainer", {}).get("config")
    if not saved:
        return None
    dp = int(index.get("layout", {}).get("dp") or saved.get("dp") or 1)
    return SavedBatch(path, int(index["world_size"]), dp, int(saved["micro_batch"]) * int(saved["grad_accum"]) * dp,
                      {name: saved[name] for name in SAMPLE_SETTINGS if name in saved}, int(index["step"]))


def accumulation(global_batch: int, micro_batch: int, dp: int) -> int | None:
    """The --grad-accum that makes micro_batch × it × dp the global batch, or None."""
    per_rank, left = divmod(global_batch, micro_batch * dp)
    return per_rank if per_rank >= 1 and left == 0 else None


def world_sizes(global_batch: int, micro_batch: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
                up_to: int | None = None, ep: int = 1, dp_shard: int = 0, sync_bn: bool = False) -> list[int]:
    """Every world size (at most `up_to`) that keeps the global batch with this micro-batch
    and these fixed degrees: tp·pp·cp·dp for each dp that leaves a whole --grad-accum (every
    pipeline schedule takes any count; with --sync-bn, none above 1 on more than one data rank:
    rules.check_sync_bn_accumulation), that ep divides, and whose dp·cp ranks --dp-shard's
    groups divide."""
    fixed = tp * pp * cp

    def accepted(dp: int) -> bool:
        accum = accumulation(global_batch, micro_batch, dp)
        return accum is not None and not (sync_bn and dp > 1 and accum > 1)

    return [dp * fixed for dp in range(1, global_batch // micro_batch + 1)
            if (up_to is None or dp * fixed <= up_to) and dp % ep == 0 and (dp * cp) % (dp_shard or 1) == 0
            and accepted(dp)]


def fit_world(config: Any) -> Any:  # TrainConfig -> TrainConfig (config.py imports this module)
    """A resumed run keeps its checkpoint's global batch through --grad-accum when dp or the
    micro-batch changed (said in one line), or it is refused naming the world sizes that
    could; another seed or sequence length is said in one line (`say_other_samples`)."""
    if not config.resume:
        return config
    saved = saved_batch(config.resume)
    if saved is None:
        return config
    say_other_samples(config, saved)
    layout = config.layout
    if saved.dp == layout.dp and config.micro_batch * config.grad_accum * layout.dp == saved.global_batch:
        return config
    accum = accumulation(saved.global_batch, config.micro_batch, layout.dp)
    if accum is None:
        sizes = world_sizes(saved.global_batch, config.micro_batch, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                            ep=layout.ep, dp_shard=layout.dp_shard, sync_bn=config.sync_bn)
        raise PlaitError(
            f"{layout.world} process(es) (dp={layout.dp}) cannot keep the global batch of {saved.global_batch} "
            f"samples that {saved.path.name} was trained with, at --micro-batch {config.micro_batch}",
            hint=f"world sizes that can: {', '.join(map(str, sizes)) or 'none at this micro-batch'}"
                 " (or change --micro-batch)")
    if saved.dp != layout.dp:
        _say(config, f"plait: elastic resume: {saved.path.name} was written by {saved.world_size} process(es) "
                     f"(dp={saved.dp}); this world has {layout.world} (dp={layout.dp}): --grad-accum {accum} keeps "
                     f"the global batch of {saved.global_batch}")
    else:
        _say(config, f"plait: resume: {saved.path.name} was trained with a global batch of {saved.global_batch} "
                     f"samples; at --micro-batch {config.micro_batch} on dp={layout.dp}, --grad-accum {accum} keeps it")
    return replace(config, grad_accum=accum)


def say_other_samples(config: Any, saved: SavedBatch) -> None:
    """A resume that changes the seed or the sequence length trains the rest of the run on
    other samples than the run it continues would have: a choice a user may make (a longer
    context), said in one line so that it is never a silent one."""
    for name, value in saved.samples.items():
        given = getattr(config, name)
        if given != value:
            flag = "--" + name.replace("_", "-")
            _say(config, f"plait: resume: {flag} {given} differs from the {value} that {saved.path.name} was trained "
                         f"with: the samples from step {saved.step + 1} on are not those the run would have trained on")


def _say(config: Any, line: str) -> None:
    """Said once per world: by rank 0, or by a run that trains in this very process (not by
    the spawner before it starts the ranks, which say it)."""
    rank = os.environ.get("RANK")
    if rank == "0" or (rank is None and config.nproc == 1):
        print(line, file=sys.stderr, flush=True)
