"""ResNet-18/34/50-style image classifiers with a stem sized for small images.

He et al.'s ResNet, as CIFAR-sized ports build it: the 7×7 stride-2 convolution and the
max-pool of the ImageNet stem would shrink an 8×8 digit to nothing, so the stem is one 3×3
convolution at stride 1. Four stages follow (strides 1, 2, 2, 2), then global average
pooling and one linear layer. Written here because torchvision does not import beside
every torch build; nothing in it is specific to a dataset.

The adapter at the bottom (`ResNetAdapter`) is what the strategies ask of this family:
its repeated blocks (ZeRO-3 units, recomputation). Convolutions are not split over
tensor-parallel ranks, and a ResNet is not cut into pipeline stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.resnet.config import ResNetConfig


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm; the shortcut is a 1×1 convolution when the shape changes."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut = _shortcut(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1×1 down to `width`, 3×3 at `width`, 1×1 up to 4·width: ResNet-50's block."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        out = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut = _shortcut(cin, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """Images (batch, channels, H, W) -> class logits (batch, num_classes)."""

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        self.stem = nn.Conv2d(config.in_channels, config.width, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(config.width)
        kind = Bottleneck if config.block == "bottleneck" else BasicBlock
        blocks, cin = [], config.width
        for stage, count in enumerate(config.layers):
            width = config.width * 2**stage
            for i in range(count):
                blocks.append(kind(cin, width, 2 if stage > 0 and i == 0 else 1))
                cin = width * config.expansion
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, config.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He init for convolutions; each block's last BatchNorm starts at zero, so every
        residual block begins as the identity (Goyal et al.), which trains faster."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        for block in self.blocks:
            last = block.bn3 if isinstance(block, Bottleneck) else block.bn2
            nn.init.zeros_(last.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(images)))
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_resnet(config: ResNetConfig, seed: int) -> ResNet:
    """Build the full model from a seed, so every layout starts from the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ResNet(config)


class ResNetAdapter:
    """What the strategies ask of a ResNet (see plait.parallel.seam.ModelAdapter)."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)


ResNet.plait_adapter = ResNetAdapter()  # type: ignore[attr-defined]
