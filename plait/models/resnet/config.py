"""ResNet shapes, kept free of torch so that the CLI can check `--model` before spawning.

The presets follow He et al.: ResNet-18 and -34 stack basic blocks (two 3×3 convolutions),
ResNet-50 bottleneck blocks (1×1, 3×3, 1×1 at four times the width). The channels and
classes come from the data, so they are given when the data is known.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.errors import PlaitError


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a ResNet: block kind, blocks per stage, width of the first stage."""

    block: str = "basic"  # "basic" (two 3×3 convolutions) or "bottleneck" (1×1, 3×3, 1×1, ×4 wide)
    layers: tuple[int, ...] = (2, 2, 2, 2)
    width: int = 64  # channels of the first stage; each later stage doubles them
    in_channels: int = 3
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.block not in ("basic", "bottleneck"):
            raise PlaitError(f"ResNet block must be basic or bottleneck, got {self.block!r}")
        if self.width < 1 or not self.layers or min(self.layers) < 1:
            raise PlaitError(f"ResNet width and blocks per stage must be at least 1: {self.width}, {self.layers}")

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1


PRESETS: dict[str, ResNetConfig] = {
    "resnet18": ResNetConfig("basic", (2, 2, 2, 2)),
    "resnet34": ResNetConfig("basic", (3, 4, 6, 3)),
    "resnet50": ResNetConfig("bottleneck", (3, 4, 6, 3)),
}


def is_resnet(name: str) -> bool:
    return name.partition(",")[0] in PRESETS


def get_resnet(name: str, **fields: object) -> ResNetConfig:
    """"resnet18" or "resnet18,width=16" (the only override: a narrower network), plus the
    data's `in_channels` and `num_classes` passed as keywords."""
    base, _, spec = name.partition(",")
    if base not in PRESETS:
        raise PlaitError(f"unknown ResNet {base!r}", hint=f"choose one of: {', '.join(PRESETS)}")
    for item in filter(None, spec.split(",")):
        key, _, text = item.partition("=")
        if key.strip() != "width" or not text.strip().isdigit():
            raise PlaitError(f"model {name!r}: {item!r} is not width=N", hint="e.g. --model resnet18,width=16")
        fields["width"] = int(text)
    return replace(PRESETS[base], **fields)
