"""The ResNets (plait/models/resnet/model.py) as a family: `--model resnet18`, `--model resnet50,width=16`.

Image classifiers on `--data digits` (scikit-learn's bundled 8×8 digits) or a folder of
class folders, trained data-parallel (DDP or ZeRO, SyncBatchNorm with `--sync-bn`): their
convolutions are not split by tensor parallelism, nor cut into pipeline stages.
"""

from __future__ import annotations

from typing import Any

from plait.errors import PlaitError
from plait.families.record import Family
from plait.models.resnet.config import PRESETS, get_resnet, is_resnet


def check(config: Any) -> None:
    get_resnet(config.model)  # raises naming the presets, or the override that is wrong
    if config.tp > 1 or config.pp > 1 or config.cp > 1:
        raise PlaitError(f"--model {config.model} is trained data-parallel only (DDP or --zero), not with "
                         "--tp, --pp or --cp", hint="drop --tp, --pp and --cp; use --nproc for more data-parallel ranks")
    from plait.train.data.tokens import BUILTIN

    if config.dp_shard:
        raise PlaitError(f"--model {config.model} with --dp-shard: its BatchNorm buffers follow rank 0 over both "
                         "hybrid axes, which the ResNet estimate does not price yet",
                         hint="drop --dp-shard (plain --zero shards over every data rank)")
    if config.data in BUILTIN:
        raise PlaitError(f"--model {config.model} classifies images, and --data is the text corpus {config.data!r}",
                         hint="give --data digits, or a folder of class folders (root/cat/*.png)")


def task(config: Any) -> Any:
    from plait.families.resnet.task import ImageTask

    return ImageTask(config)


FAMILY = Family(name="resnet", models=f"ResNets on images: {', '.join(PRESETS)} (e.g. resnet18,width=16)",
                matches=is_resnet, task=task, check=check, reads=frozenset({"augment", "sync_bn"}))
