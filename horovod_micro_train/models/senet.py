"""SENet-18 (Hu et al., 2018) for 32x32 inputs, as in the MiCRO paper's CIFAR runs.

ResNet-18's layout with pre-activation basic blocks, each ending in a squeeze-and-excitation
gate: global average pool, a bottleneck of two 1x1 convolutions (reduction 16), a sigmoid
that rescales the block's channels before the residual sum.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class SqueezeExcite(nn.Module):
    """Channel gate ``x * sigmoid(W2 relu(W1 avgpool(x)))``."""

    def __init__(self, channels: int, reduction: int = 16):
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // reduction, 1)
        self.expand = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.adaptive_avg_pool2d(x, 1)
        gate = torch.sigmoid(self.expand(F.relu(self.reduce(gate))))
        return x * gate


class PreActSEBlock(nn.Module):
    """BN-ReLU-conv, BN-ReLU-conv, SE gate, plus shortcut (projected on shape change)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.se = SqueezeExcite(planes)
        self.shortcut = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return self.se(out) + shortcut


class SENet(nn.Module):
    """CIFAR SENet: 3x3 stem, four stages of :class:`PreActSEBlock`, pool, linear."""

    def __init__(self, blocks_per_stage: tuple[int, ...], num_classes: int = 10,
                 in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        stages, in_planes = [], 64
        for index, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks_per_stage)):
            layers = []
            for block in range(count):
                stride = 2 if index > 0 and block == 0 else 1
                layers.append(PreActSEBlock(in_planes, planes, stride))
                in_planes = planes
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(512)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.stages(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def senet18(num_classes: int = 10) -> SENet:
    """SENet-18 for 32x32 RGB images."""
    return SENet((2, 2, 2, 2), num_classes=num_classes)
